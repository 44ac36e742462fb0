"""States captured while the target regenerated the answers, kept for collection (``regenerate=engine``).

A cache folder sits next to the prepared data (``<prepared>.capture/``): ``meta.json`` (the target, engine,
dtype and layers the states come from), part files ``part-NNNNN.safetensors`` written atomically (one per
regenerated batch: ``aux_<i>``, ``last``, ``argmax``, the batch's rows one after another) and ``index.jsonl``,
appended with fsync after its part is in place: a row's key (SHA-256 of its int32 token ids), its part, offset
and length, the part's SHA-256 and the line's own check. A row is looked up by its ids, so a prepared row is
served only with states computed on exactly its tokens; a part whose bytes do not match its checksum, or an index
line that does not match its check, is refused, not trusted.

A run killed while writing leaves at most a part no line names, a temporary file or a torn last index line: the
next run that writes (``open_for_writing``) removes them, and a row already indexed is not written again, so a
resumed regeneration ends with the folder an uninterrupted one writes.

``CapturedTarget`` serves collection from the cache: rows found come from it, the rest from a target that runs
a forward (the Hugging Face model or the engine), started only when a row is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specheads.errors import UserError
from specheads.hardware import DTYPES, Choice
from specheads.targets import Target, TargetFeatures, target_argmax

log = logging.getLogger(__name__)

META = "meta.json"
INDEX = "index.jsonl"


class CaptureCacheError(UserError):
    """A capture cache that cannot be trusted (a part whose checksum differs, a corrupt index line)."""


def row_key(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int32).tobytes()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _line_check(rec: dict) -> str:
    """An index line's own checksum: over its other fields (a flipped offset would otherwise serve another row)."""
    body = {k: v for k, v in rec.items() if k != "check"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def capture_dir(prepared_dir: str | Path) -> Path:
    prepared_dir = Path(prepared_dir)
    return prepared_dir.with_name(prepared_dir.name + ".capture")


class CaptureCache:
    """The cache folder (module doc). ``open_for_writing`` starts over when ``identity`` differs from the folder's."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / META).read_text())
        self._index: dict[str, dict] | None = None
        self._checked: set[str] = set()

    @classmethod
    def open_for_writing(cls, folder: str | Path, identity: dict) -> "CaptureCache":
        folder = Path(folder)
        if (folder / META).is_file():
            try:
                if json.loads((folder / META).read_text()) == identity:
                    cache = cls(folder)
                    cache._tidy()
                    return cache
            except json.JSONDecodeError:
                pass
            log.info("%s holds states of other settings or another target: starting it over", folder)
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / (META + ".tmp")
        tmp.write_text(json.dumps(identity, indent=1, sort_keys=True))
        os.replace(tmp, folder / META)
        return cls(folder)

    def _tidy(self) -> None:
        """What a killed writer left (module doc): a torn last index line cut off, so the next line starts on its own;
        parts no line names and temporary files removed."""
        path = self.folder / INDEX
        if path.exists():
            raw = path.read_bytes()
            good_end = raw.rfind(b"\n") + 1
            if good_end < len(raw):
                log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path,
                            len(raw) - good_end)
                with path.open("r+b") as f:
                    f.truncate(good_end)
                    os.fsync(f.fileno())
        named = {rec["part"] for rec in self.index().values()}
        for stray in sorted(self.folder.glob("part-*")):
            if stray.name not in named:
                log.info("%s: removing %s, left by an interrupted run before its rows were indexed", self.folder,
                         stray.name)
                stray.unlink()

    @property
    def layers(self) -> list[int]:
        return [int(i) for i in self.meta["layers"]]

    def index(self) -> dict[str, dict]:
        """Row key -> where its states are; a torn last line (a crash mid-append) is ignored."""
        if self._index is None:
            self._index = {}
            path = self.folder / INDEX
            raw = path.read_bytes() if path.exists() else b""
            raw = raw[: raw.rfind(b"\n") + 1]
            for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
                try:
                    rec = json.loads(line)
                    if "check" in rec and rec["check"] != _line_check(rec):
                        raise ValueError("its fields differ from its check")
                    self._index[rec["key"]] = rec
                except (ValueError, KeyError, TypeError) as e:
                    raise CaptureCacheError(f"{path}:{lineno}: corrupt index line ({e}); delete {self.folder} to "
                                            "collect with a forward instead") from e
        return self._index

    def add(self, rows: list[list[int]], states: list[dict[str, torch.Tensor]]) -> None:
        """Write one part holding the states of ``rows`` not indexed already (a batch a killed run captured is
        captured again whole), then index them."""
        from safetensors.torch import save_file

        index = self.index()
        kept = [(ids, st) for ids, st in zip(rows, states) if row_key(ids) not in index]
        if not kept:
            return
        rows, states = [ids for ids, _ in kept], [st for _, st in kept]
        numbers = [int(p[len("part-"):-len(".safetensors")]) for p in {rec["part"] for rec in index.values()}]
        part = f"part-{max(numbers, default=-1) + 1:05d}.safetensors"
        tensors = {k: torch.cat([s[k] for s in states]).contiguous() for k in states[0]}
        tmp = self.folder / (part + ".tmp")
        save_file(tensors, str(tmp))
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.folder / part)
        _fsync_dir(self.folder)  # the part's name is on disk before a line names it
        sha = _sha256(self.folder / part)
        lines, at = [], 0
        for ids in rows:
            rec = {"key": row_key(ids), "part": part, "offset": at, "length": len(ids), "sha256": sha}
            rec["check"] = _line_check(rec)
            lines.append(json.dumps(rec) + "\n")
            index[rec["key"]] = rec
            at += len(ids)
        with (self.folder / INDEX).open("a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())

    def covers(self, aux_layers, need_last: bool) -> bool:
        return set(int(i) for i in aux_layers) <= set(self.layers) and (not need_last or bool(self.meta.get("last")))

    def count(self, rows) -> int:
        index = self.index()
        return sum(1 for ids in rows if row_key(ids) in index)

    def get(self, ids) -> dict[str, torch.Tensor] | None:
        """The states of the row with exactly these token ids, or None."""
        from safetensors import safe_open

        rec = self.index().get(row_key(ids))
        if rec is None or rec["length"] != len(ids):
            return None
        path = self.folder / rec["part"]
        if rec["part"] not in self._checked:
            if not path.is_file() or _sha256(path) != rec["sha256"]:
                raise CaptureCacheError(f"{path}: missing or its bytes differ from the checksum in {INDEX}; delete "
                                        f"{self.folder} to collect with a forward instead")
            self._checked.add(rec["part"])
        with safe_open(str(path), "pt") as f:
            return {k: f.get_slice(k)[rec["offset"]:rec["offset"] + rec["length"]] for k in f.keys()}


class CapturedTarget(Target):
    """A ``Target`` for collection whose states come from a ``CaptureCache`` (module doc); ``fallback`` builds the
    target that computes a row the cache lacks (called at most once, when the first such row comes)."""

    def __init__(self, described: Target, cache: CaptureCache, fallback: Callable[[], Target] | None):
        super().__init__(described.model, described.tokenizer, described.name)
        self.layout = described.layout
        self.cache = cache
        self._fallback_factory = fallback
        self._fallback: Target | None = None
        self.rows_from_cache = self.rows_computed = 0
        dtype = str(cache.meta.get("dtype", "float32"))
        self._dtype = DTYPES[dtype]
        self.dtype_choice = Choice(dtype, f"captured by vLLM {cache.meta.get('version')} while answering")

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a captured target has no LM head here: the cache holds the argmax")

    def forward_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         aux_layers=(), need_last: bool = True) -> TargetFeatures:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        B, T = input_ids.shape
        H = self.hidden_size
        lengths = mask.sum(-1).tolist()
        found = [self.cache.get(input_ids[b, :n].tolist()) for b, n in enumerate(lengths)]
        aux = [torch.zeros(B, T, H, dtype=self._dtype) for _ in aux_layers]
        last = torch.zeros(B, T, H, dtype=self._dtype) if need_last else None
        argmax = torch.zeros(B, T, dtype=torch.long) if need_last else None
        missing = [b for b, f in enumerate(found) if f is None]
        computed = None
        if missing:
            if self._fallback is None:
                if self._fallback_factory is None:
                    raise CaptureCacheError(f"a prepared row is not in {self.cache.folder} and no forward was set up")
                self._fallback = self._fallback_factory()
            width = max(lengths[b] for b in missing)
            computed = self._fallback.forward_features(input_ids[missing, :width], mask[missing, :width],
                                                       aux_layers=aux_layers, need_last=need_last)
            if need_last and computed.argmax is None:
                computed.argmax = target_argmax(self._fallback.logits, computed.last)
        for b, f in enumerate(found):
            n = lengths[b]
            if f is not None:
                for j, i in enumerate(aux_layers):
                    aux[j][b, :n] = f[f"aux_{int(i)}"]
                if need_last:
                    last[b, :n] = f["last"]
                    argmax[b, :n] = f["argmax"]
            else:
                k = missing.index(b)
                for j in range(len(aux_layers)):
                    aux[j][b, :n] = computed.aux[j][k, :n].to(self._dtype)
                if need_last:
                    last[b, :n] = computed.last[k, :n].to(self._dtype)
                    argmax[b, :n] = computed.argmax[k, :n]
        self.rows_from_cache += B - len(missing)
        self.rows_computed += len(missing)
        return TargetFeatures(aux=tuple(aux), last=last, argmax=argmax)

    def close(self) -> None:
        if self._fallback is not None and hasattr(self._fallback, "close"):
            self._fallback.close()
