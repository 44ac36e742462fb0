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

import collections
import itertools
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from specheads.data.dedup import DEDUP_VERSION, DedupReport, benchmark_keys, unique_conversations
from specheads.data.capture_cache import CaptureCache, capture_dir
from specheads.data.engine_answers import capture_layers, model_len
from specheads.data import images as img
from specheads.data.regenerate import RegenerateConfig, count_retokenized, count_truncated, regenerate
from specheads.data.render import (ChatRenderer, TemplateError, ToolTurnError, chat_id, chat_template_sha,
                                   render_image_samples, render_samples)
from specheads.data.sources import (MIXTURE, Conversation, MixturePart, SkipReport, SourceError, check_sources,
                                    iter_conversations, iter_mixture, mixture_counts, mixture_parts)
from specheads.errors import ConfigError, UserError, check_output_folder
# load_prepared is re-exported: recipes, scripts and users read prepared sets as specheads.data.prepare.load_prepared
from specheads.prepared import FORMAT, META_FILE, DataMismatchError, load_prepared  # noqa: F401
from specheads.targets import Target, tokenizer_fingerprint
from specheads.targets.context import context_limit

log = logging.getLogger(__name__)

ROWS_FILE = "rows.arrow"  # the rows streamed into the work folder, before save_to_disk
NO_LOSS_TOKENS = "no assistant token within max_length"
TEMPLATE_REFUSED = "chat template cannot render the chat"
NO_REGENERATED_ANSWER = "no regenerated answer (prompt over regenerate.max_prompt_tokens, or empty answer)"
TOOL_TURN_NOT_RENDERED = "tool turn the chat template does not render"
REGENERATE_VERSION = 2  # 2: regenerated answers are the target's token ids (1 decoded and re-tokenized them)
PREPARED_FILES = re.compile(r"(data|cache)-.+\.arrow|dataset_info\.json|state\.json")  # what save_to_disk writes
STALE_TMP_SECONDS = 3600  # a work folder of a dead process untouched this long is removed (see _remove_stale_tmp)


class PrepareError(UserError, ValueError):
    """Nothing usable came out of the source (the message says what was skipped and why)."""


@dataclass
class PrepareConfig:
    """source/path/split: see ``iter_conversations``; num_samples: conversations to read (None: all), of which
    duplicates are dropped (``specheads.data.dedup``); source ``mixture``: ``parts`` (``sources.MixturePart``:
    name, source, path, split, num_samples or weight, domain) read in turn, ``num_samples`` the total the
    weighted parts share; regenerate: replace answers with the target's own (None: keep the dataset's answers);
    chat_template_kwargs: the template's switches, as the serving engine passes them (``enable_thinking``);
    num_proc: processes rendering and tokenizing (None: every core, at most 8); chunk_size: chats per task;
    image_folder: where relative image paths are read (None: beside the data file; ``specheads.data.images``)."""

    source: str = "sharegpt"
    path: str | None = None
    split: str = "train"
    max_length: int = 2048
    num_samples: int | None = 1000
    domain: str = "chat"
    regenerate: RegenerateConfig | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    parts: list[dict[str, Any]] | None = None
    num_proc: int | None = None
    chunk_size: int = 256
    image_folder: str | None = None

    def __post_init__(self):
        if self.source == MIXTURE:
            self.parts = [asdict(p) for p in mixture_parts(self.parts or [])]  # checked before any work
            mixture_counts([MixturePart(**p) for p in self.parts], self.num_samples)
        elif self.parts:
            raise SourceError(f"data.parts is for data.source=mixture (source is {self.source!r})")
        if self.max_length <= 0 or (self.num_samples is not None and self.num_samples <= 0) or self.chunk_size <= 0:
            raise SourceError(f"data.max_length, data.num_samples and data.chunk_size must be positive (got "
                              f"{self.max_length}, {self.num_samples}, {self.chunk_size})")
        if self.num_proc is not None and (isinstance(self.num_proc, bool) or self.num_proc < 1):
            raise ConfigError(f"data.num_proc={self.num_proc}: give the number of processes rendering and "
                              "tokenizing (1 or more), or null for every core (at most 8)")


def read_conversations(cfg: PrepareConfig, report: SkipReport, part_reports: dict[str, SkipReport]):
    """The configured conversations, lazily: one source's first ``num_samples``, or a mixture's parts."""
    if cfg.source == MIXTURE:
        parts = [MixturePart(**p) for p in cfg.parts]

        def counted():
            for conv in iter_mixture(parts, cfg.num_samples, part_reports):
                report.read, report.kept = (sum(r.read for r in part_reports.values()),
                                            sum(r.kept for r in part_reports.values()))
                yield conv
        return counted()
    return itertools.islice(iter_conversations(cfg.source, cfg.path, cfg.split, report, cfg.domain, cfg.image_folder),
                            cfg.num_samples)


@dataclass
class RenderStats:
    """What rendering kept and dropped, summed over the worker processes' chunks."""

    later: Counter = field(default_factory=Counter)
    first_error: dict[str, str] = field(default_factory=dict)
    truncated: int = 0
    cut_answers: int = 0
    reasoning_turns: int = 0
    split: dict[str, int] = field(default_factory=lambda: {"chats": 0, "samples": 0, "extra_tokens": 0,
                                                           "turns_written_after_prompt": 0})

    def add(self, other: "RenderStats") -> None:
        self.later.update(other.later)
        for k, v in other.first_error.items():
            self.first_error.setdefault(k, v)
        self.truncated += other.truncated
        self.cut_answers += other.cut_answers
        self.reasoning_turns += other.reasoning_turns
        for k, v in other.split.items():
            self.split[k] += v


_WORKER: dict[str, Any] = {}


def _render_chunk(convs: list[Conversation], renderer=None, max_length=None, vision=None):
    """Rows (id, input_ids int32, loss_mask int8, domain) of a chunk of chats, and its ``RenderStats``; for a
    vision-language target (``vision``) each row also holds its images' references and grids."""
    renderer = renderer or _WORKER["renderer"]
    max_length = max_length or _WORKER["max_length"]
    vision = vision or _WORKER.get("vision")
    stats, rows = RenderStats(), []
    for conv in convs:
        if vision is not None:
            rows += _render_vision(conv, renderer, vision, max_length, stats)
            continue
        out = _render(conv, renderer, max_length, stats.later, stats.first_error)
        if out is None:
            continue
        kept = [r for r in out.samples if any(r.loss_mask)]
        if not kept:
            stats.later[NO_LOSS_TOKENS] += 1
            continue
        if out.split:
            stats.split["chats"] += 1
            stats.split["samples"] += len(kept)
            stats.split["extra_tokens"] += sum(len(r.input_ids) for r in kept) - len(renderer.tokens(renderer.text(
                [{k: v for k, v in m.items() if k != "token_ids"} for m in conv.messages])))
        stats.split["turns_written_after_prompt"] += out.written_turns
        stats.reasoning_turns += sum(1 for m in conv.messages if m.get("reasoning_content") or "</think>" in m["content"])
        stats.truncated += sum(r.truncated for r in kept)
        stats.cut_answers += count_truncated([conv])
        for r in kept:
            rows.append((conv.id + r.suffix, np.asarray(r.input_ids, dtype=np.int32),
                         np.asarray(r.loss_mask, dtype=np.int8), conv.domain))
    return rows, stats


def _render_vision(conv: Conversation, renderer, vision, max_length: int, stats: RenderStats) -> list[tuple]:
    """The rows of one chat for a vision-language target: (id, ids, mask, domain, image refs, grids). A chat whose
    image cannot be read is one line naming the row and the file, skipped and counted."""
    try:
        samples = render_image_samples(conv, renderer, vision, max_length)
    except img.ImageError as e:
        log.warning("skipping conversation %s: image %s", conv.id, e)
        stats.first_error.setdefault(img.IMAGE_UNREADABLE, f"{conv.id}: {e}")
        stats.later[img.IMAGE_UNREADABLE] += 1
        return []
    except ToolTurnError as e:
        stats.first_error.setdefault(TOOL_TURN_NOT_RENDERED, str(e))
        stats.later[TOOL_TURN_NOT_RENDERED] += 1
        return []
    except TemplateError as e:
        stats.first_error.setdefault(TEMPLATE_REFUSED, str(e))
        stats.later[TEMPLATE_REFUSED] += 1
        return []
    kept = [r for r in samples if any(r.loss_mask)]
    if not kept:
        stats.later[NO_LOSS_TOKENS] += 1
        return []
    stats.truncated += sum(r.truncated for r in kept)
    if len(samples) > 1:
        stats.split["chats"] += 1
        stats.split["samples"] += len(kept)
    return [(conv.id + r.suffix, np.asarray(r.input_ids, dtype=np.int32), np.asarray(r.loss_mask, dtype=np.int8),
             conv.domain, list(r.images), [list(g) for g in r.grids]) for r in kept]


def check_image_rows(convs: Iterable[Conversation], vision, regenerating: bool) -> Iterator[Conversation]:
    """The conversations, refusing in one line at the first image chat when the target reads no images or its
    answers are to be regenerated (the regeneration loops answer text prompts)."""
    for conv in convs:
        if img.has_images(conv.messages):
            if vision is None:
                raise PrepareError(f"conversation {conv.id} shows images, and the target has no vision part (its "
                                   "config has no vision_config): give a vision-language target, or text-only data")
            if vision.refusal:
                raise PrepareError(f"conversation {conv.id} shows images: {vision.refusal}")
            if regenerating:
                raise PrepareError(f"conversation {conv.id} shows images: regenerated answers are for text "
                                   "conversations so far; prepare image chats with the data set's answers")
        yield conv


def _chunks(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def render_stream(convs: Iterable[Conversation], renderer: ChatRenderer, max_length: int, stats: RenderStats,
                  num_proc: int = 1, chunk_size: int = 256, vision=None) -> Iterator[tuple]:
    """The rendered rows of ``convs`` in order, chunks rendered by ``num_proc`` forked worker processes with at
    most two chunks each in flight, so memory holds a few chunks whatever the number of chats. ``vision``: a
    vision-language target's ``images.VisionRenderer`` (rows then carry their images)."""
    if num_proc <= 1:
        for chunk in _chunks(convs, chunk_size):
            rows, st = _render_chunk(chunk, renderer, max_length, vision)
            stats.add(st)
            yield from rows
        return
    import multiprocessing as mp

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers tokenize; no threads in each
    _WORKER.update(renderer=renderer, max_length=max_length, vision=vision)  # inherited by the forked workers
    try:
        with mp.get_context("fork").Pool(num_proc) as pool:
            pending: collections.deque = collections.deque()
            for chunk in _chunks(convs, chunk_size):
                pending.append(pool.apply_async(_render_chunk, (chunk,)))
                if len(pending) >= 2 * num_proc:
                    rows, st = pending.popleft().get()
                    stats.add(st)
                    yield from rows
            while pending:
                rows, st = pending.popleft().get()
                stats.add(st)
                yield from rows
    finally:
        _WORKER.clear()


def default_num_proc() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def prepare(target: Target, cfg: PrepareConfig, out_dir: str | Path, vision=None) -> dict[str, Any]:
    """Run the stage and write ``out_dir`` atomically. Returns the metadata written.

    ``target`` needs only a tokenizer unless ``cfg.regenerate`` is set (then the model generates); ``vision``: a
    vision-language target's image processing (``images.load_vision``), None for a text-only target.
    Conversations stream from the source through dedup and rendering (worker processes) into an Arrow
    file, so memory does not grow with their number; regeneration holds the chats it answers.
    """
    t0 = time.time()
    out_dir = Path(out_dir)
    check_prepare_output(out_dir)
    check_sources(cfg.source, cfg.path, cfg.parts)
    _remove_stale_tmp(out_dir)
    given = cfg  # the settings as given: what a later run compares (``prepared_is_current``)
    cfg = _settle_engine(target, cfg)
    tok = target.tokenizer
    report, part_reports = SkipReport(), {}
    dedup = DedupReport()
    convs = unique_conversations(read_conversations(cfg, report, part_reports), benchmark_keys(), dedup)
    convs = check_image_rows(convs, vision, cfg.regenerate is not None)
    if vision is not None and vision.refusal:  # its text conversations only (an image one is refused above)
        vision = None
    stats = RenderStats()
    renderer = ChatRenderer(tok, cfg.chat_template_kwargs)  # a tokenizer without a template is refused here
    retokenized = None
    if cfg.regenerate is not None:
        convs, retokenized = _regenerate_chats(target, convs, cfg, renderer, stats, report, out_dir)
    num_proc = cfg.num_proc or default_num_proc()
    rows = render_stream(convs, renderer, cfg.max_length, stats, num_proc, cfg.chunk_size, vision)
    tmp, counts = _write_rows(rows, out_dir, vision is not None)
    if not counts["samples"]:
        shutil.rmtree(tmp, ignore_errors=True)
        _refuse_empty(cfg, report, dedup, stats)
    meta = _metadata(target, cfg, given, out_dir, counts, stats, report, part_reports, dedup, retokenized,
                     num_proc, vision, t0)
    _finish(tmp, meta, out_dir)
    _log_prepared(meta, cfg, counts, stats, report, dedup, num_proc)
    return meta


def _settle_engine(target: Target, cfg: PrepareConfig) -> PrepareConfig:
    """The settings with the regenerating engine's context settled, refused before any work where the engine
    could not capture the longest rows or answer within it (its capture layers checked against the target)."""
    engine = cfg.regenerate.engine if cfg.regenerate is not None else None
    if engine is not None:  # vLLM's context: as set, or room for the longest row and the longest prompt and answer
        limit = context_limit(getattr(target.model, "config", None), target.tokenizer)
        engine = replace(engine, max_model_len=model_len(
            engine, cfg.max_length, cfg.regenerate.max_prompt_tokens, cfg.regenerate.max_new_tokens, limit,
            target.name))
        cfg = replace(cfg, regenerate=replace(cfg.regenerate, engine=engine))
    if engine is not None and engine.capture:  # before any work: the engine captures whole rows
        if cfg.max_length > engine.max_model_len:
            raise PrepareError(f"data.max_length={cfg.max_length} is longer than regenerate.engine.max_model_len="
                               f"{engine.max_model_len}: the engine could not capture the longest rows; raise it")
        capture_layers(engine, target)
    if engine is not None and cfg.regenerate.max_prompt_tokens >= engine.max_model_len:
        raise PrepareError(f"regenerate.max_prompt_tokens={cfg.regenerate.max_prompt_tokens} leaves no room for an "
                           f"answer within regenerate.engine.max_model_len={engine.max_model_len}: raise it")
    return cfg


def _regenerate_chats(target: Target, convs, cfg: PrepareConfig, renderer: ChatRenderer, stats: RenderStats,
                      report: SkipReport, out_dir: Path) -> tuple[list[Conversation], Any]:
    """The chats the template renders, answered again by the target (those left unanswered counted), and the
    re-tokenization counts of an endpoint's text answers (None for an engine's)."""
    convs = [c for c in convs if _renders(c, renderer, cfg.max_length, stats.later, stats.first_error)]  # regenerate only chats the template can render
    if not convs and not report.kept:
        _no_usable_conversation(cfg, report)
    asked = len(convs)
    convs = regenerate(target, convs, out_dir.with_name(out_dir.name + ".regen.jsonl"), cfg.regenerate,
                       template_kwargs=cfg.chat_template_kwargs, capture=capture_dir(out_dir),
                       rows_of=lambda conv: _sample_ids(conv, renderer, cfg.max_length))
    if asked > len(convs):
        stats.later[NO_REGENERATED_ANSWER] += asked - len(convs)
    retokenized = None
    if cfg.regenerate.endpoint:
        # answers from a serving endpoint that returned text only: chats re-tokenized, and those whose
        # re-tokenization differs from the engine's ids or text
        retokenized = count_retokenized(convs)
    return convs, retokenized


def _refuse_empty(cfg: PrepareConfig, report: SkipReport, dedup: DedupReport, stats: RenderStats) -> None:
    """Raise why no sample was prepared: no usable conversation, every one a duplicate, or every one dropped while
    rendering."""
    if not report.kept:
        _no_usable_conversation(cfg, report)
    if not dedup.kept:
        raise PrepareError(f"every conversation read repeats an earlier one's first user turn ({dedup.within}) "
                           f"or is an MT-bench/HumanEval prompt ({dedup.of_evaluation}): nothing left to train on")
    why = "; ".join(f"{n} ({reason}; first: {stats.first_error.get(reason, '?')})" for reason, n in stats.later.items())
    raise PrepareError(f"every conversation was dropped while rendering: {why}")


def _metadata(target: Target, cfg: PrepareConfig, given: PrepareConfig, out_dir: Path, counts: dict[str, Any],
              stats: RenderStats, report: SkipReport, part_reports: dict[str, SkipReport], dedup: DedupReport,
              retokenized, num_proc: int, vision, t0: float) -> dict[str, Any]:
    """The prepared set's metadata (``specheads_meta.json``): what it holds, where from, and what was skipped."""
    tok = target.tokenizer
    later, split = stats.later, stats.split
    meta = {
        "format": FORMAT, "target": target.name, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "chat_template_sha": chat_template_sha(tok), "max_length": cfg.max_length,
        "num_samples": counts["samples"], "num_tokens": counts["tokens"],
        "num_loss_tokens": counts["loss_tokens"], "num_truncated": stats.truncated,
        "source": {"source": cfg.source, "path": cfg.path, "split": cfg.split, **report.to_dict()},
        "skipped": dict(report.counts + sum((r.counts for r in part_reports.values()), Counter()) + later),
        "regenerated": cfg.regenerate is not None,
        "chat_template_kwargs": dict(cfg.chat_template_kwargs),
        # chats whose template rewrites earlier turns: one sample per turn (the context repeated in extra_tokens)
        "per_turn_samples": split, "reasoning_turns": stats.reasoning_turns,
        "regenerate": asdict(cfg.regenerate) if cfg.regenerate else None,
        "regenerate_version": REGENERATE_VERSION if cfg.regenerate else None,
        # regenerated chats ending with an answer cut at max_new_tokens (kept open: no end-of-turn token)
        "regenerated_truncated": stats.cut_answers if cfg.regenerate else None,
        "regenerated_retokenized": retokenized,
        # states captured while vLLM answered (<prepared>.capture/, specheads.data.capture_cache): collection reads them
        "captured": _captured(out_dir) if cfg.regenerate is not None and cfg.regenerate.engine is not None else None,
        # duplicate conversations dropped before rendering (specheads.data.dedup)
        "dedup": dedup.to_dict(),
        # a mixture: each part's source, what its reader kept and skipped, and what it gave the prepared set
        "mixture": [{**p, **part_reports.get(p["name"], SkipReport()).to_dict(), **counts["parts"].get(p["name"], {})}
                    for p in cfg.parts] if cfg.source == MIXTURE else None,
        "seconds": round(time.time() - t0, 1), "config": _config_key(given), "num_proc": num_proc,
    }
    if vision is not None:  # what collection needs to recompute each row's pixel inputs from its references
        meta["images"] = {**vision.describe(), "rows": counts["image_rows"], "images": counts["images"]}
    return meta


def _log_prepared(meta: dict[str, Any], cfg: PrepareConfig, counts: dict[str, Any], stats: RenderStats,
                  report: SkipReport, dedup: DedupReport, num_proc: int) -> None:
    """Log what was prepared, what was dropped and why, and the per-turn and cut-answer counts."""
    later, split = stats.later, stats.split
    log.info("prepared %d samples from %d conversations (%d tokens, %d truncated to %d) in %.1f s with %d "
             "process(es); %s%s", meta["num_samples"], counts["chats"], meta["num_tokens"], stats.truncated,
             cfg.max_length, meta["seconds"], num_proc, report.summary(),
             "".join(f"; dropped {n} ({why})" for why, n in later.items()))
    if dedup.within or dedup.of_evaluation:
        log.info("dropped %d conversation(s) repeating an earlier one's first user turn and %d whose first user "
                 "turn is an MT-bench or HumanEval prompt (%s)", dedup.within, dedup.of_evaluation,
                 "examples, dropped -> kept or matched: " + "; ".join(
                     f"{a} -> {b}" for a, b in dedup.examples["within"][:2] + dedup.examples["of_evaluation"][:2]))
    if split["chats"]:
        log.info("the chat template rewrites earlier turns: %d chats became %d per-turn samples (%d tokens of "
                 "repeated context, %.0f%% of the prepared tokens)", split["chats"], split["samples"],
                 split["extra_tokens"], 100 * split["extra_tokens"] / max(1, meta["num_tokens"]))
    if stats.cut_answers:
        log.info("%d regenerated chats end with an answer cut at regenerate.max_new_tokens (kept without an "
                 "end-of-turn token; counted as regenerated_truncated in %s)", stats.cut_answers, META_FILE)


def _no_usable_conversation(cfg: PrepareConfig, report: SkipReport) -> None:
    raise PrepareError(f"no usable conversation in source '{cfg.source}' {cfg.path or ''}: {report.summary()}")


def _captured(out_dir: Path) -> dict | None:
    folder = capture_dir(out_dir)
    if not (folder / "meta.json").is_file():
        return None
    cache = CaptureCache(folder)
    return {"folder": folder.name, "layers": cache.layers, "dtype": cache.meta.get("dtype"),
            "engine": f"vllm {cache.meta.get('version')}", "rows": len(cache.index())}


def _sample_ids(conv, renderer, max_length: int) -> list[list[int]]:
    """The token ids of the rows a chat renders to (what ``_render_chunk`` writes), none if it does not render."""
    out = _render(conv, renderer, max_length, Counter(), {})
    return [list(r.input_ids) for r in out.samples if any(r.loss_mask)] if out is not None else []


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
    """The settings the prepared rows depend on (how many processes rendered them is not one)."""
    key = json.loads(json.dumps(asdict(cfg)))
    for k in ("num_proc", "chunk_size"):
        key.pop(k, None)
    if not key.get("parts"):
        key.pop("parts", None)
    if key.get("image_folder") is None:
        key.pop("image_folder", None)
    return key


def prepared_is_current(out_dir: str | Path, cfg: PrepareConfig, target: Target, vision=None) -> bool:
    """True when ``out_dir`` already holds data prepared with this configuration and tokenizer (and, for a
    vision-language target, ``vision``: the same image processing)."""
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
            and (cfg.regenerate is None or meta.get("regenerate_version") == REGENERATE_VERSION)
            and _same_images(meta.get("images"), vision))


def _same_images(recorded: dict | None, vision) -> bool:
    """Whether prepared rows' image processing (the metadata's ``images``) is ``vision``'s (None: no image columns)."""
    current = vision.describe() if vision is not None and not vision.refusal else None
    if recorded is None or current is None:
        return recorded is None and current is None
    return all(recorded.get(k) == v for k, v in current.items())


def _features(with_images: bool = False):
    """The prepared columns; a vision-language target's rows add ``images`` (references) and ``image_grid_thw``."""
    import datasets

    columns = {
        "id": datasets.Value("string"), "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")), "domain": datasets.Value("string"),
    }
    if with_images:
        columns[IMAGE_COLUMNS[0]] = datasets.Sequence(datasets.Value("string"))
        columns[IMAGE_COLUMNS[1]] = datasets.Sequence(datasets.Sequence(datasets.Value("int32"), length=3))
    return datasets.Features(columns)


IMAGE_COLUMNS = ("images", "image_grid_thw")


def _write_rows(rows: Iterable[tuple], out_dir: Path, with_images: bool = False) -> tuple[Path, dict[str, Any]]:
    """Stream rows into an Arrow file in a work folder beside ``out_dir`` (returned with the counts: samples,
    chats, tokens, loss tokens, per mixture part); ``_finish`` saves it only once the counts are checked."""
    from datasets.arrow_writer import ArrowWriter

    tmp = _tmp_dir(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    counts: dict[str, Any] = {"samples": 0, "chats": 0, "tokens": 0, "loss_tokens": 0, "parts": {},
                              "image_rows": 0, "images": 0}
    last_chat = None
    try:
        with ArrowWriter(features=_features(with_images), path=str(tmp / ROWS_FILE), writer_batch_size=1000) as writer:
            for rid, ids, mask, domain, *pictures in rows:
                row = {"id": rid, "input_ids": ids, "loss_mask": mask, "domain": domain}
                if with_images:
                    row.update(zip(IMAGE_COLUMNS, pictures))
                    counts["image_rows"] += bool(pictures[0])
                    counts["images"] += len(pictures[0])
                writer.write(row)
                chat = chat_id(rid)
                part = counts["parts"].setdefault(rid.split(":", 1)[0] if ":" in rid else "",
                                                  {"chats": 0, "samples": 0, "tokens": 0})
                if chat != last_chat:
                    counts["chats"] += 1
                    part["chats"] += 1
                    last_chat = chat
                counts["samples"] += 1
                counts["tokens"] += len(ids)
                counts["loss_tokens"] += int(mask.sum())
                part["samples"] += 1
                part["tokens"] += len(ids)
            writer.finalize()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a source that fails half way leaves no work folder behind
        raise
    return tmp, counts


def _finish(tmp: Path, meta: dict[str, Any], out_dir: Path) -> None:
    """Save the written rows as a ``save_to_disk`` folder with its metadata and swap it into place: an earlier
    prepared set there stays whole until the new one is complete, and is restored if the swap fails."""
    import datasets

    data, old = tmp / "data", tmp / "old"
    try:
        datasets.Dataset.from_file(str(tmp / ROWS_FILE)).save_to_disk(str(data))
        (data / META_FILE).write_text(json.dumps(meta, indent=2))
        if out_dir.exists():
            os.replace(out_dir, old)
        try:
            os.replace(data, out_dir)
        except BaseException:
            if old.exists() and not out_dir.exists():
                os.replace(old, out_dir)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tmp_dir(out_dir: Path) -> Path:
    """This process's work folder beside ``out_dir`` (same file system, so the finished set moves in at once)."""
    return out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")


def _remove_stale_tmp(out_dir: Path) -> None:
    """Remove the work folders beside ``out_dir`` that a killed run left: their process is gone from this machine
    and nothing in them changed for ``STALE_TMP_SECONDS`` (a run on another machine sharing the folder keeps
    writing to its own). A set aside earlier prepared set (``old``) is put back if ``out_dir`` is missing."""
    if not out_dir.parent.is_dir():
        return
    pattern = re.compile(re.escape(out_dir.name) + r"\.tmp(\d+)")
    for tmp in out_dir.parent.iterdir():
        m = pattern.fullmatch(tmp.name)
        if not m or not tmp.is_dir() or int(m.group(1)) == os.getpid() or _pid_alive(int(m.group(1))):
            continue
        try:
            newest = max(p.lstat().st_mtime for p in [tmp, *tmp.rglob("*")])
            if time.time() - newest < STALE_TMP_SECONDS:
                continue
            if (tmp / "old" / META_FILE).is_file() and not out_dir.exists():
                os.replace(tmp / "old", out_dir)
        except OSError:
            continue
        log.info("removing %s, left by a prepare run that was stopped", tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True


def check_prepare_output(out_dir: str | Path, setting: str = "output_dir") -> None:
    """Refuse, before any work, an output folder the stage cannot write or must not replace: a file, inside one or
    not writable (``check_output_folder``), or an existing folder holding anything but a prepared set (its
    ``specheads_meta.json`` and what ``save_to_disk`` writes), which replacing it would delete. A new or empty
    folder, or an earlier prepare's output (replaced when the settings changed), is fine."""
    check_output_folder(out_dir, setting)
    path = Path(out_dir).expanduser()
    if not path.is_dir():
        return
    names = sorted(p.name for p in path.iterdir())
    foreign = [n for n in names if n != META_FILE and not PREPARED_FILES.fullmatch(n)]
    if names and not foreign and META_FILE not in names:
        foreign = [f"{names[0]} without {META_FILE}"]
    elif META_FILE in names and not foreign and _meta_format(path / META_FILE) not in (FORMAT, None):
        foreign = [f"{META_FILE} of format {_meta_format(path / META_FILE)!r}"]
    if foreign:
        raise ConfigError(f"{setting}={out_dir} holds files that are not a prepared dataset (e.g. {foreign[0]}): "
                          f"give a new or empty folder, or the {setting} of an earlier prepare")


def _meta_format(meta_path: Path) -> str | None:
    """The ``format`` a metadata file names (None when it cannot be read: a prepare killed while writing it)."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    return meta.get("format", "") if isinstance(meta, dict) else ""


def write_prepared(rows: dict[str, list], meta: dict[str, Any], out_dir: str | Path) -> None:
    """Write rows (id, input_ids, loss_mask, domain) plus metadata as a prepared folder (for tools and tests),
    the way the stage writes its own."""
    out_dir = Path(out_dir)
    tuples = ((i, np.asarray(x, dtype=np.int32), np.asarray(m, dtype=np.int8), d)
              for i, x, m, d in zip(rows["id"], rows["input_ids"], rows["loss_mask"], rows["domain"]))
    tmp, _ = _write_rows(tuples, out_dir)
    _finish(tmp, {"format": FORMAT, **meta}, out_dir)


def check_prepared_matches(meta: dict[str, Any], target: Target) -> None:
    """Refuse prepared data whose tokenizer is not the target's."""
    want = target.tokenizer_fingerprint()
    got = meta.get("tokenizer_fingerprint")
    if target.tokenizer is not None and got != want:
        raise DataMismatchError(
            f"prepared data was tokenized by another tokenizer (fingerprint {got}, target '{target.name}' has "
            f"{want}); re-run `specheads prepare` for this target")
