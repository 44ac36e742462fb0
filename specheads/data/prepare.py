"""The prepare stage: conversations -> (optionally regenerated) -> tokenized turns with loss masks.

Output (see docs/architecture.md): a ``datasets.save_to_disk`` folder with columns
``id, input_ids, loss_mask, domain`` and ``specheads_meta.json`` recording the tokenizer identity,
chat template, max length and what was skipped, so later stages can refuse a mismatch.

Duplicate conversations are removed before anything else (``specheads.data.dedup``): of the
``num_samples`` conversations read, one whose first user turn (normalised) repeats an earlier one's,
or is an MT-bench or HumanEval prompt, is dropped with its per-turn samples; the counts are the
metadata's ``dedup``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specheads.data.dedup import DEDUP_VERSION, DedupReport, benchmark_keys, drop_duplicates
from specheads.data.regenerate import RegenerateConfig, count_retokenized, count_truncated, regenerate
from specheads.data.render import (ChatRenderer, TemplateError, ToolTurnError, chat_id, chat_template_sha,
                                   render_samples)
from specheads.data.sources import SkipReport, iter_conversations
from specheads.errors import InputNotFoundError, UserError
from specheads.targets import Target, tokenizer_fingerprint

log = logging.getLogger(__name__)

FORMAT = "specheads.prepared/1"
META_FILE = "specheads_meta.json"
NO_LOSS_TOKENS = "no assistant token within max_length"
TEMPLATE_REFUSED = "chat template cannot render the chat"
NO_REGENERATED_ANSWER = "no regenerated answer (prompt over regenerate.max_prompt_tokens, or empty answer)"
TOOL_TURN_NOT_RENDERED = "tool turn the chat template does not render"
REGENERATE_VERSION = 2  # 2: regenerated answers are the target's token ids (1 decoded and re-tokenized them)


class DataMismatchError(UserError, ValueError):
    """Prepared data (or features) made for another tokenizer / target / setting."""


class PrepareError(UserError, ValueError):
    """Nothing usable came out of the source (the message says what was skipped and why)."""


@dataclass
class PrepareConfig:
    """source/path/split: see ``iter_conversations``; num_samples: conversations to read (None: all), of which
    duplicates are dropped (``specheads.data.dedup``);
    regenerate: replace answers with the target's own (None: keep the dataset's answers);
    chat_template_kwargs: the template's switches, as the serving engine passes them (``enable_thinking``)."""

    source: str = "sharegpt"
    path: str | None = None
    split: str = "train"
    max_length: int = 2048
    num_samples: int | None = 1000
    domain: str = "chat"
    regenerate: RegenerateConfig | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def prepare(target: Target, cfg: PrepareConfig, out_dir: str | Path) -> dict[str, Any]:
    """Run the stage and write ``out_dir`` atomically. Returns the metadata written.

    ``target`` needs only a tokenizer unless ``cfg.regenerate`` is set (then the model generates).
    """
    t0 = time.time()
    out_dir = Path(out_dir)
    tok = target.tokenizer
    report = SkipReport()
    convs = list(itertools.islice(
        iter_conversations(cfg.source, cfg.path, cfg.split, report, cfg.domain), cfg.num_samples))
    if not convs:
        raise PrepareError(f"no usable conversation in source '{cfg.source}' {cfg.path or ''}: {report.summary()}")
    dedup = DedupReport()
    convs = drop_duplicates(convs, benchmark_keys(), dedup)
    if dedup.within or dedup.of_evaluation:
        log.info("dropped %d conversation(s) repeating an earlier one's first user turn and %d whose first user "
                 "turn is an MT-bench or HumanEval prompt (%s)", dedup.within, dedup.of_evaluation,
                 "examples, dropped -> kept or matched: " + "; ".join(
                     f"{a} -> {b}" for a, b in dedup.examples["within"][:2] + dedup.examples["of_evaluation"][:2]))
    later = Counter()
    renderer = ChatRenderer(tok, cfg.chat_template_kwargs)  # a tokenizer without a template is refused here
    first_error: dict[str, str] = {}
    if cfg.regenerate is not None:
        convs = [c for c in convs if _renders(c, renderer, cfg.max_length, later, first_error)]  # regenerate only chats the template can render
        asked = len(convs)
        convs = regenerate(target, convs, out_dir.with_name(out_dir.name + ".regen.jsonl"), cfg.regenerate,
                           template_kwargs=cfg.chat_template_kwargs)
        if asked > len(convs):
            later[NO_REGENERATED_ANSWER] += asked - len(convs)
    rows: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": [], "domain": []}
    truncated = cut_answers = 0
    split = {"chats": 0, "samples": 0, "extra_tokens": 0, "turns_written_after_prompt": 0}
    reasoning_turns = 0
    for conv in convs:
        out = _render(conv, renderer, cfg.max_length, later, first_error)
        if out is None:
            continue
        kept = [r for r in out.samples if any(r.loss_mask)]
        if not kept:
            later[NO_LOSS_TOKENS] += 1
            continue
        if out.split:
            split["chats"] += 1
            split["samples"] += len(kept)
            split["extra_tokens"] += sum(len(r.input_ids) for r in kept) - len(renderer.tokens(renderer.text(
                [{k: v for k, v in m.items() if k != "token_ids"} for m in conv.messages])))
        split["turns_written_after_prompt"] += out.written_turns
        reasoning_turns += sum(1 for m in conv.messages if m.get("reasoning_content") or "</think>" in m["content"])
        truncated += sum(r.truncated for r in kept)
        cut_answers += count_truncated([conv])
        for r in kept:
            for k, v in (("id", conv.id + r.suffix), ("input_ids", r.input_ids), ("loss_mask", r.loss_mask),
                         ("domain", conv.domain)):
                rows[k].append(v)
    if not rows["id"]:
        why = "; ".join(f"{n} ({reason}; first: {first_error.get(reason, '?')})" for reason, n in later.items())
        raise PrepareError(f"every conversation was dropped while rendering: {why}")
    meta = {
        "format": FORMAT, "target": target.name, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "chat_template_sha": chat_template_sha(tok), "max_length": cfg.max_length,
        "num_samples": len(rows["id"]), "num_tokens": sum(map(len, rows["input_ids"])),
        "num_loss_tokens": sum(map(sum, rows["loss_mask"])), "num_truncated": truncated,
        "source": {"source": cfg.source, "path": cfg.path, "split": cfg.split, **report.to_dict()},
        "skipped": dict(report.counts + later), "regenerated": cfg.regenerate is not None,
        "chat_template_kwargs": dict(cfg.chat_template_kwargs),
        # chats whose template rewrites earlier turns: one sample per turn (the context repeated in extra_tokens)
        "per_turn_samples": split, "reasoning_turns": reasoning_turns,
        "regenerate": asdict(cfg.regenerate) if cfg.regenerate else None,
        "regenerate_version": REGENERATE_VERSION if cfg.regenerate else None,
        # regenerated chats ending with an answer cut at max_new_tokens (kept open: no end-of-turn token)
        "regenerated_truncated": cut_answers if cfg.regenerate else None,
        # answers from a serving endpoint that returned text only: chats re-tokenized, and those whose
        # re-tokenization differs from the engine's ids or text
        "regenerated_retokenized": count_retokenized(convs) if cfg.regenerate and cfg.regenerate.endpoint else None,
        # duplicate conversations dropped before rendering (specheads.data.dedup)
        "dedup": dedup.to_dict(),
        "seconds": round(time.time() - t0, 1), "config": _config_key(cfg),
    }
    _write(rows, meta, out_dir)
    log.info("prepared %d samples from %d conversations (%d tokens, %d truncated to %d) in %.1f s; %s%s",
             meta["num_samples"], len({chat_id(x) for x in rows["id"]}), meta["num_tokens"], truncated, cfg.max_length, meta["seconds"], report.summary(),
             "".join(f"; dropped {n} ({why})" for why, n in later.items()))
    if split["chats"]:
        log.info("the chat template rewrites earlier turns: %d chats became %d per-turn samples (%d tokens of "
                 "repeated context, %.0f%% of the prepared tokens)", split["chats"], split["samples"],
                 split["extra_tokens"], 100 * split["extra_tokens"] / max(1, meta["num_tokens"]))
    if cut_answers:
        log.info("%d regenerated chats end with an answer cut at regenerate.max_new_tokens (kept without an "
                 "end-of-turn token; counted as regenerated_truncated in %s)", cut_answers, META_FILE)
    return meta


def _render(conv, renderer, max_length: int, later: Counter, first_error: dict[str, str]):
    """The chat's samples (``render_samples``), or None with the reason counted (and its first message kept)."""
    try:
        return render_samples(conv, renderer, max_length)
    except ToolTurnError as e:
        first_error.setdefault(TOOL_TURN_NOT_RENDERED, str(e))
        later[TOOL_TURN_NOT_RENDERED] += 1
    except TemplateError as e:
        first_error.setdefault(TEMPLATE_REFUSED, str(e))
        later[TEMPLATE_REFUSED] += 1
    return None


def _renders(conv, renderer, max_length: int, later: Counter, first_error: dict[str, str]) -> bool:
    """Whether the chat template renders the chat with an exact mask (else the reason is counted)."""
    return _render(conv, renderer, max_length, later, first_error) is not None


def _config_key(cfg: PrepareConfig) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(cfg)))


def prepared_is_current(out_dir: str | Path, cfg: PrepareConfig, target: Target) -> bool:
    """True when ``out_dir`` already holds data prepared with this configuration and tokenizer."""
    meta_path = Path(out_dir) / META_FILE
    if not meta_path.exists():
        return False
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError:
        return False
    return (meta.get("config") == _config_key(cfg)
            and meta.get("tokenizer_fingerprint") == tokenizer_fingerprint(target.tokenizer)
            and (meta.get("dedup") or {}).get("version") == DEDUP_VERSION  # else prepared before this dedup
            and (cfg.regenerate is None or meta.get("regenerate_version") == REGENERATE_VERSION))


def _write(rows: dict[str, list], meta: dict[str, Any], out_dir: Path) -> None:
    import datasets

    features = datasets.Features({
        "id": datasets.Value("string"), "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")), "domain": datasets.Value("string"),
    })
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp))
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def write_prepared(rows: dict[str, list], meta: dict[str, Any], out_dir: str | Path) -> None:
    """Write rows (id, input_ids, loss_mask, domain) plus metadata as a prepared folder (for tools and tests)."""
    _write(rows, {"format": FORMAT, **meta}, Path(out_dir))


def load_prepared(path: str | Path):
    """(datasets.Dataset, meta dict) of a prepared folder; a folder of another kind is refused."""
    import datasets

    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise InputNotFoundError(f"{path} is not a prepared dataset (no {META_FILE}); run `specheads prepare` first")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise DataMismatchError(f"{meta_path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return datasets.load_from_disk(str(path)), meta


def check_prepared_matches(meta: dict[str, Any], target: Target) -> None:
    """Refuse prepared data whose tokenizer is not the target's."""
    want = target.tokenizer_fingerprint()
    got = meta.get("tokenizer_fingerprint")
    if target.tokenizer is not None and got != want:
        raise DataMismatchError(
            f"prepared data was tokenized by another tokenizer (fingerprint {got}, target '{target.name}' has "
            f"{want}); re-run `specheads prepare` for this target")
