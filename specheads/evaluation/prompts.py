"""The evaluation's prompts: which benchmarks (``BenchmarkSpec``, ``load_benchmarks``), the held-out chat
slice of a prepared dataset, what keeps them apart from training (``separation_record``), and their token
ids through the target's chat template (``encode``). The benchmark files themselves are read by
``specheads.data.benchmarks``.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from specheads.data.benchmarks import JSONL_FORMAT, EvalPrompt, load_humaneval, load_jsonl, load_mtbench
from specheads.decoding.vision_prompts import ImagePrompt
from specheads.errors import ConfigError, InputNotFoundError, UserError


@dataclass
class BenchmarkSpec:
    """Which prompts to evaluate. ``None`` = all of that set; 0 = none. The defaults are
    ``conf/eval/default.yaml``'s: one MT-bench question per category, both turns (16 prompts), 2 HumanEval
    prompts and, with ``chat_dir``, 2 held-out chat prompts (20 in all)."""

    mtbench_per_category: int | None = 1
    mtbench_turns: tuple[int, ...] = (1, 2)
    humaneval: int | None = 2
    chat: int | None = 2
    chat_dir: str | None = None
    jsonl: str | None = None
    jsonl_limit: int | None = None


def chat_heldout_ids(sample_ids: list[str]) -> set[str]:
    """The held-out chat slice: the sample ids of the last 1% (at least one) of the chats, sorted as
    strings (a chat's per-turn samples, ``<chat id>@turn<i>``, go together). Training leaves these rows
    out of its training *and* held-out rows (``recipes/train.py``), so nothing measured before scoring
    (the shape choice's acceptance) reads them; the prepared set holds no other chat with the same first
    user turn (``specheads.data.dedup``)."""
    from specheads.data.render import chat_id

    chats = sorted({chat_id(x) for x in sample_ids})
    held = set(chats[len(chats) - max(1, math.ceil(len(chats) / 100)):]) if chats else set()
    return {x for x in sample_ids if chat_id(x) in held}


def chat_sample_ids(prompts: list[EvalPrompt]) -> set[str]:
    """The prepared-dataset ids of the held-out chats among ``prompts`` (``load_chat_heldout``'s rows)."""
    return {p.id.removeprefix("chat/") for p in prompts if p.benchmark == "chat"}


def scored_chat_ids(prompts: list[EvalPrompt]) -> set[str]:
    """The chats (``render.chat_id``: every per-turn sample of one) of the held-out chat prompts among ``prompts``."""
    from specheads.data.render import chat_id

    return {chat_id(x) for x in chat_sample_ids(prompts)}


def separation_record(spec: BenchmarkSpec, prompts: list[EvalPrompt]) -> dict:
    """What keeps the scored prompts apart from training, for the report: the prompts scored per
    benchmark, and the duplicate conversations the chat slice's prepared set dropped
    (``specheads.data.dedup``; None without a chat slice, ``prepared_without_dedup`` when the set was
    prepared before duplicates were removed)."""
    scored: dict[str, int] = defaultdict(int)
    for p in prompts:
        scored[p.benchmark or "other"] += 1
    out: dict = {"scored": dict(scored), "chat_dir": spec.chat_dir, "prepared_dedup": None}
    if spec.chat_dir and spec.chat != 0:
        from specheads.data.prepare import META_FILE

        meta = json.loads((Path(spec.chat_dir) / META_FILE).read_text())
        dedup = meta.get("dedup")
        out["prepared_dedup"] = {k: v for k, v in dedup.items() if k != "examples"} if dedup else None
        out["prepared_without_dedup"] = not dedup
    return out


IMAGE_DOMAIN = "image"  # the domain of held-out rows whose prompt shows images (a vision-language target's)


def load_chat_heldout(prepared_dir: str | Path, limit: int | None = 4) -> list[EvalPrompt]:
    """Held-out chat: the last 1% of a prepared dataset's ids (sorted), each cut at its first
    assistant token (the prompt is the conversation up to the first assistant turn). A row of a vision-language
    target's set whose prompt shows images is scored in the ``image`` domain, its ids an ``ImagePrompt`` naming
    the images before the cut (their pixels are read once the target is known: ``read_prompt_images``)."""
    from specheads.data.prepare import load_prepared

    ds, meta = load_prepared(prepared_dir)
    image_token = (meta.get("images") or {}).get("image_token_id")
    keep = chat_heldout_ids([str(x) for x in ds["id"]])
    held = sorted((i for i in range(len(ds)) if str(ds[i]["id"]) in keep), key=lambda i: str(ds[i]["id"]))
    out = []
    for i in held:
        row = ds[i]
        mask = list(row["loss_mask"])
        if 1 not in mask:
            continue
        cut = mask.index(1)
        if cut < 2:
            continue
        ids = [int(x) for x in row["input_ids"][:cut]]
        shown = _images_shown(ids, image_token) if row.get("images") else 0
        if shown:
            ids = ImagePrompt(ids, image_grid_thw=torch.tensor([list(g) for g in row["image_grid_thw"][:shown]]),
                              refs=list(row["images"][:shown]))
        out.append(EvalPrompt(f"chat/{row['id']}", IMAGE_DOMAIN if shown else "chat", input_ids=ids,
                              benchmark="chat"))
        if limit is not None and len(out) >= limit:
            break
    return out


def _images_shown(ids: list[int], image_token: int | None) -> int:
    """How many images a prompt's ids show: the runs of the image token (images sit apart, between their vision
    start and end tokens)."""
    if image_token is None:
        return 0
    return sum(1 for j, t in enumerate(ids) if t == image_token and (j == 0 or ids[j - 1] != image_token))


def read_prompt_images(prompts: list[EvalPrompt], target) -> None:
    """Read the images of the image prompts among ``prompts`` (in place) with the target's image processor, each
    checked against the patch grid prepared; a target without a vision part is refused in one line."""
    pending = [p for p in prompts if isinstance(p.input_ids, ImagePrompt) and p.input_ids.pixel_values is None]
    if not pending:
        return
    from specheads.data.images import load_vision, open_image

    vision = load_vision(target.name, target.tokenizer) if getattr(target, "vision_language", False) else None
    if vision is None or vision.refusal:
        raise UserError(f"eval.chat_dir: {len(pending)} held-out prompts show images and target '{target.name}' "
                        "reads none; evaluate with the vision-language target the data was prepared for")
    for p in pending:
        ids = p.input_ids
        pixels = vision.pixel_inputs([open_image(r) for r in ids.refs])
        if not torch.equal(pixels["image_grid_thw"], ids.image_grid_thw.long()):
            raise UserError(f"{p.id}: the image processor gives patch grids {pixels['image_grid_thw'].tolist()}, the "
                            f"prepared row {ids.image_grid_thw.tolist()} (its images or the target changed since "
                            "prepare); prepare the data again")
        ids.pixel_values, ids.image_grid_thw = pixels["pixel_values"], pixels["image_grid_thw"]


def check_benchmark_files(spec: BenchmarkSpec) -> None:
    """The files a spec names exist, refused under the recipe's setting names (``eval.jsonl``, ``eval.chat_dir``)
    before the target loads; ``load_benchmarks`` then reads them (a malformed line: its file and line number)."""
    if spec.jsonl and not Path(spec.jsonl).is_file():
        raise InputNotFoundError(f"eval.jsonl={spec.jsonl}: no such file; give a JSONL file of prompts, "
                                 f"{JSONL_FORMAT}")
    if spec.chat != 0 and spec.chat_dir and not Path(spec.chat_dir).is_dir():
        raise InputNotFoundError(f"eval.chat_dir={spec.chat_dir}: no such folder; give the output_dir of "
                                 "`specheads prepare` (its held-out chats are scored), or leave eval.chat_dir out")


def load_benchmarks(spec: BenchmarkSpec) -> list[EvalPrompt]:
    """All prompts a spec asks for, in a fixed order."""
    out: list[EvalPrompt] = []
    if spec.mtbench_per_category != 0:
        out += load_mtbench(spec.mtbench_per_category, spec.mtbench_turns)
    if spec.humaneval != 0:
        out += load_humaneval(spec.humaneval)
    if spec.chat != 0 and spec.chat_dir:
        out += load_chat_heldout(spec.chat_dir, spec.chat)
    if spec.jsonl:
        out += load_jsonl(spec.jsonl, spec.jsonl_limit)
    if not out:
        raise ConfigError("the evaluation set is empty: enable MT-bench (eval.mtbench_per_category), HumanEval "
                          "(eval.humaneval), chat (eval.chat with eval.chat_dir) or give eval.jsonl (with prompts)")
    return out


def encode(prompt: EvalPrompt, tokenizer, answers: dict[str, str], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt through the chat template (with its switches, ``template_kwargs``), as a
    serving engine renders it. ``answers[id of turn t]`` holds the model's answer to earlier turns
    (needed for turn >= 2)."""
    if prompt.input_ids is not None:  # an image prompt stays one (its images go with its ids)
        return prompt.input_ids.copy() if isinstance(prompt.input_ids, ImagePrompt) else list(prompt.input_ids)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"prompt {prompt.id}: the target's tokenizer has no chat template")
    messages = []
    for t in range(prompt.turn + 1):
        messages.append({"role": "user", "content": prompt.turns[t]})
        if t < prompt.turn:
            key = turn_id(prompt, t)
            if key not in answers:
                raise KeyError(f"prompt {prompt.id}: the answer to turn {t + 1} ({key}) was not generated first")
            messages.append({"role": "assistant", "content": answers[key]})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def turn_id(prompt: EvalPrompt, turn: int) -> str:
    """The id of the same conversation's prompt at another turn (0-based)."""
    base = prompt.id.rsplit("/t", 1)[0]
    return f"{base}/t{turn + 1}"
