"""The on-disk feature store: safetensors shards, one JSON record per shard, and a manifest.

Layout of a store folder::

    plan.json                 settings + sample plan of this collection (written first)
    shards/00007.safetensors  one shard: samples concatenated along the token axis
    shards/00007.json         its record (checksum, size, ids, lengths), written after the shard
    manifest.json             everything above in one file, written once all shards are done

A shard holds ``input_ids (N,) int32``, ``loss_mask (N,) int8``, ``offsets (S+1,) int64`` (sample
``s`` is rows ``offsets[s]:offsets[s+1]``) and, as the method needs, ``hidden_last (N, H)`` with
``target_argmax (N,) int32`` (the target's argmax over its whole vocabulary, computed from it at
collection) and ``hidden_aux (N, k*H)``; a target that uses M-RoPE adds ``positions (N, 3) int32``.
With ``fp8_e4m3`` each hidden tensor has a float32 scale per token (and per aux layer):
``hidden_last_scale (N, 1)``, ``hidden_aux_scale (N, k)``.

Every file is written to a temporary name and moved into place with ``os.replace``, so a killed
writer leaves either nothing or a complete file; a shard counts as done only once its record exists
and its size and SHA-256 match the record.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specheads.errors import ConfigError, UserError
from specheads.prepared import DataMismatchError

STORE_FORMAT = "specheads.features/1"
MANIFEST = "manifest.json"
PLAN = "plan.json"
SHARD_DIR = "shards"
FP8_MAX = 448.0  # largest finite float8_e4m3fn value


# The batch key of the target's full-vocabulary argmax at each position (B, T) long, from hidden_last: feature
# stores hold it (computed once at collection), so a method reads it instead of the target's full logits.
ARGMAX_KEY = "target_argmax"
POSITIONS_KEY = "positions"  # (B, T, 3) a vision-language target's 3-D M-RoPE positions (Qwen2-VL family)


@dataclass(frozen=True)
class FeatureSpec:
    """Which target tensors a method trains on (see ``specheads.targets`` for the layer convention): the contract
    between a method (``Method.feature_spec``), which declares it, and collection and the trainer, which read it.

    aux_layers: inputs of these decoder layers, concatenated in this order into ``hidden_aux``
    need_last:  the post-norm last hidden state, as ``hidden_last``
    online_only: the target itself is trained (Medusa-2), so stored features would go stale
    image_rows: the method trains on a vision-language target's image rows as the serving engine drafts there
    (EAGLE-3: the token embeddings the engine's draft reads at image slots, the target's M-RoPE positions)
    """

    aux_layers: tuple[int, ...] = ()
    need_last: bool = True
    online_only: bool = False
    image_rows: bool = False


STORE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "fp8_e4m3",
                 "float8_e4m3fn": "fp8_e4m3", "half": "float16"}


class StoreError(RuntimeError):
    """A feature store is missing, incomplete or unusable."""


class CorruptShardError(StoreError, UserError):
    """A shard's bytes do not match its recorded size or checksum (the message names the file and the fix:
    re-run the collection, which re-checks every shard and redoes only the bad ones)."""


class StoreMismatchError(StoreError, DataMismatchError):
    """A store made for another target, tokenizer, layer set or collection setting."""


class InsufficientDiskError(StoreError):
    """Not enough free disk for the planned store."""


def disk_slack(needed: int) -> int:
    """Free bytes to keep beyond a store of ``needed`` bytes: a tenth of it plus 64 MiB (a shard's temporary file, the
    manifest, the file system's own reserve), at most 1 GiB. Not a flat 1 GiB: a small store fits a nearly full disk."""
    return min(2**30, 64 * 2**20 + needed // 10)


def fits_on_disk(needed: int, free: int) -> bool:
    """Whether a store of ``needed`` bytes fits ``free`` bytes with its slack."""
    return needed + disk_slack(needed) <= free


def canonical_dtype(name: str, setting: str = "collect.dtype") -> str:
    """'bf16' -> 'bfloat16' etc.; an unknown name is a ``ConfigError`` naming ``setting`` and the accepted ones."""
    name = DTYPE_ALIASES.get(str(name), str(name))
    if name not in STORE_DTYPES:
        raise ConfigError(f"{setting}={name}: unknown store dtype; use one of {', '.join(STORE_DTYPES)} (or bf16, "
                          "fp16, fp8)")
    return name


def bytes_per_token(hidden_size: int, num_aux: int, need_last: bool, dtype: str) -> int:
    """Disk bytes one token costs in a shard (ids + mask + hidden states + fp8 scales)."""
    dtype = canonical_dtype(dtype)
    elem = torch.empty((), dtype=STORE_DTYPES[dtype]).element_size()
    vectors = num_aux + int(need_last)
    scales = 4 * vectors if dtype == "fp8_e4m3" else 0
    return 4 + 1 + 4 * int(need_last) + vectors * hidden_size * elem + scales


# --------------------------------------------------------------------------- fp8 codec


def quantize_fp8(x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, G*H) float -> (N, G*H) float8_e4m3fn and (N, G) float32 scales (one per token and group).

    Each token's group is scaled so its largest magnitude maps to 448, the largest e4m3 value.
    """
    n, d = x.shape
    xg = x.float().view(n, groups, d // groups)
    scale = xg.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(n, d), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: (N, G*H) fp8, (N, G) -> (N, G*H) float32."""
    n, d = q.shape
    groups = scale.shape[-1]
    return (q.float().view(n, groups, d // groups) * scale.float().unsqueeze(-1)).view(n, d)


def encode_hidden(name: str, x: torch.Tensor, dtype: str, groups: int = 1) -> dict[str, torch.Tensor]:
    """Tensors to store for one hidden block (N, G*H): the cast values, plus ``<name>_scale`` for fp8."""
    if dtype == "fp8_e4m3":
        q, scale = quantize_fp8(x, groups)
        return {name: q, f"{name}_scale": scale}
    y = x.to(STORE_DTYPES[dtype]).contiguous()
    if dtype == "float16" and torch.isinf(y).any():
        raise StoreError(f"{name}: values up to {x.abs().max().item():.4g} overflow float16 (max 65504); "
                         f"store bfloat16 or fp8_e4m3 (scaled) instead")
    return {name: y}


def decode_hidden(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored rows (T, D) (and fp8 scales (T, G)) -> float32 (T, D)."""
    if scale is not None:
        return dequantize_fp8(values, scale)
    return values.float()


# --------------------------------------------------------------------------- files


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to ``<path>.tmp<pid>``, fsync, then ``os.replace`` (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def shard_file(index: int) -> str:
    return f"{SHARD_DIR}/{index:05d}.safetensors"


def record_file(index: int) -> str:
    return f"{SHARD_DIR}/{index:05d}.json"


@dataclass
class ShardRecord:
    """What the manifest knows about one shard (ids and lengths in storage order)."""

    index: int
    file: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    ids: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    plan_hash: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardRecord":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def write_shard(root: Path, index: int, tensors: dict[str, torch.Tensor], ids: list[str],
                plan_hash: str) -> ShardRecord:
    """Serialize one shard straight to a temporary file (no copy of it in memory), checksum the file, move it into
    place, then write its record. Returns the record."""
    from safetensors.torch import save_file

    # One metadata key: safetensors writes metadata from an unordered map, and a shard's bytes must
    # not depend on that order (identical runs give identical checksums).
    meta = json.dumps({"format": STORE_FORMAT, "ids": ids, "plan_hash": plan_hash}, sort_keys=True)
    path = root / shard_file(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"specheads": meta})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    offsets = tensors["offsets"]
    record = ShardRecord(
        index=index, file=shard_file(index), sha256=sha256_file(tmp), bytes=tmp.stat().st_size,
        num_samples=len(ids), num_tokens=int(offsets[-1]), num_loss_tokens=int(tensors["loss_mask"].sum()),
        ids=list(ids), lengths=(offsets[1:] - offsets[:-1]).tolist(), plan_hash=plan_hash,
    )
    os.replace(tmp, path)
    atomic_write_json(root / record_file(index), asdict(record))
    return record


REDO_SHARD = ("re-run `specheads collect` with the same settings: it re-checks every shard, redoes only the bad "
              "ones and keeps the rest (or delete the file first)")


def check_shard_file(root: Path, record: ShardRecord, full: bool = True) -> None:
    """Raise ``CorruptShardError`` naming the file if it is missing, resized or (``full``) altered."""
    path = root / record.file
    if not path.exists():
        raise CorruptShardError(f"feature shard {path} is missing (listed in the store's records); {REDO_SHARD}")
    size = path.stat().st_size
    if size != record.bytes:
        raise CorruptShardError(f"feature shard {path} has {size} bytes, its record says {record.bytes} (truncated or "
                                f"replaced); {REDO_SHARD}")
    if full:
        digest = sha256_file(path)
        if digest != record.sha256:
            raise CorruptShardError(
                f"feature shard {path} is corrupt: its SHA-256 {digest[:16]}... differs from the recorded "
                f"{record.sha256[:16]}...; {REDO_SHARD}")


def read_record(root: Path, index: int) -> ShardRecord | None:
    """The record of shard ``index`` or None when absent/unreadable (then the shard counts as not done)."""
    path = root / record_file(index)
    try:
        return ShardRecord.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def remove_stale_temps(root: Path, indices: list[int]) -> int:
    """Delete temporary files a killed writer left for these shards; returns how many."""
    removed = 0
    shard_dir = root / SHARD_DIR
    if not shard_dir.exists():
        return 0
    prefixes = tuple(f"{i:05d}." for i in indices)
    for p in shard_dir.iterdir():
        if p.name.startswith(prefixes) and ".tmp" in p.name:
            p.unlink(missing_ok=True)
            removed += 1
    return removed


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of a finished store, or a clear error for a folder that is not one (yet)."""
    root = Path(root)
    path = root / MANIFEST
    if not path.exists():
        hint = (" (plan.json is there: the collection has not finished; re-run it to complete the store)"
                if (root / PLAN).exists() else "; run `specheads collect` to build it")
        raise StoreError(f"{root} holds no feature store manifest{hint}")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != STORE_FORMAT:
        raise StoreMismatchError(f"{path}: format {manifest.get('format')!r}, expected {STORE_FORMAT!r}")
    return manifest


def verify_store(root: str | Path) -> dict[str, Any]:
    """Check every shard's size and SHA-256 against the manifest; returns the manifest.

    Raises ``CorruptShardError`` listing every bad shard by path.
    """
    root = Path(root)
    manifest = read_manifest(root)
    problems = []
    for rec in manifest["shards"]:
        try:
            check_shard_file(root, ShardRecord.from_dict(rec))
        except CorruptShardError as e:
            problems.append(str(e))
    if problems:
        raise CorruptShardError(f"{len(problems)} bad shard(s) in {root}:\n" + "\n".join(problems))
    return manifest


# --------------------------------------------------------------------------- background writer


class ShardWriter:
    """Encodes, serializes, checksums and writes shards in a background thread.

    The collecting thread hands over each forward's padded float features with ``add`` and closes a
    shard with ``finish``; casting (or fp8 quantization), concatenation, hashing and the disk write
    happen here, overlapping the next forward passes. At most ``max_pending`` items, and batches of at most
    ``max_pending_tokens`` padded tokens in all (None: no limit but the items'), wait in the queue, so memory is
    bounded in tokens whatever the rows' length: a batch of one row longer than that waits alone. An error in the
    thread is re-raised on the next call from the caller.
    """

    def __init__(self, root: Path, dtype: str, aux_groups: int, plan_hash: str, max_pending: int = 4,
                 max_pending_tokens: int | None = None):
        import queue
        import threading

        self.root, self.dtype, self.aux_groups, self.plan_hash = Path(root), dtype, aux_groups, plan_hash
        self.records: list[ShardRecord] = []
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._tokens_limit, self._tokens = max_pending_tokens, 0  # padded tokens handed over, not yet encoded
        self._tokens_free = threading.Condition()
        self._parts: dict[str, list[torch.Tensor]] = {}
        self._thread = threading.Thread(target=self._run, name="specheads-shard-writer", daemon=True)
        self._thread.start()

    def add(self, batch: dict[str, torch.Tensor]) -> None:
        """batch: attention_mask (B, T), input_ids, loss_mask (B, T), hidden_* (B, T, D) float, any device.

        On a GPU the padding is dropped and the dtype cast (or fp8 quantization) done there, and the
        result copied to pinned host memory without blocking; the writer waits for that copy. On the
        CPU the whole encoding happens in the writer thread.
        """
        tokens = batch["input_ids"].numel()
        with self._tokens_free:  # wait while earlier batches hold the pending tokens (one batch always goes)
            while self._tokens_limit and self._tokens and self._tokens + tokens > self._tokens_limit:
                self._tokens_free.wait()
            self._tokens += tokens
        if batch["input_ids"].is_cuda:
            rows = self._rows(batch)
            host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                    for k, v in rows.items()}
            event = torch.cuda.Event()
            event.record()
            self._put(("rows", host, event, tokens))
        else:
            self._put(("batch", batch, None, tokens))

    def finish(self, index: int, ids: list[str]) -> None:
        """Write everything added since the last ``finish`` as shard ``index`` holding samples ``ids``."""
        self._put(("finish", index, list(ids)))

    def drain(self) -> None:
        """Wait until everything handed over so far is processed (finished shards written); re-raises a
        writer error."""
        import threading

        done = threading.Event()
        self._put(("drain", done, None))
        done.wait()
        self._raise()

    def close(self, check: bool = True) -> list[ShardRecord]:
        """Wait for pending writes; returns the records written (``check``: re-raise a writer error)."""
        self._queue.put(None)
        self._thread.join()
        if check:
            self._raise()
        return self.records

    def _put(self, item) -> None:
        self._raise()
        self._queue.put(item)

    def _raise(self) -> None:
        if self.error is not None:
            raise StoreError(f"writing shards to {self.root} failed: {self.error}") from self.error

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if item[0] == "drain":
                item[1].set()
                continue
            if item[0] == "finish":  # after an error: drained so the producer never blocks (it re-raises it)
                if self.error is None:
                    try:
                        self._write(item[1], item[2])
                    except BaseException as e:  # noqa: BLE001 - handed to the producer thread
                        self.error = e
                continue
            kind, data, event, tokens = item
            item = None
            try:
                if self.error is None:
                    if event is not None:
                        event.synchronize()
                    for k, v in (self._rows(data) if kind == "batch" else data).items():
                        self._parts.setdefault(k, []).append(v)
            except BaseException as e:  # noqa: BLE001 - handed to the producer thread
                self.error = e
            finally:
                data = None  # the padded batch is freed before the producer may hand over its next tokens
                self._release_tokens(tokens)

    def _rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Padded batch -> real-token rows in the store's dtypes (on the batch's device)."""
        keep = batch["attention_mask"].bool()
        rows = {"input_ids": batch["input_ids"][keep].to(torch.int32),
                "loss_mask": batch["loss_mask"][keep].to(torch.int8),
                "lengths": keep.sum(dim=1).to(torch.int64)}
        if "target_argmax" in batch:
            rows["target_argmax"] = batch["target_argmax"][keep].to(torch.int32)
        if "positions" in batch:  # a target's 3-D M-RoPE positions (N, 3)
            rows["positions"] = batch["positions"][keep].to(torch.int32)
        for name, groups in (("hidden_last", 1), ("hidden_aux", self.aux_groups)):
            if name in batch:
                rows.update(encode_hidden(name, batch[name][keep], self.dtype, groups))
        return rows

    def _release_tokens(self, tokens: int) -> None:
        with self._tokens_free:
            self._tokens -= tokens
            self._tokens_free.notify_all()

    def _write(self, index: int, ids: list[str]) -> None:
        parts, self._parts = self._parts, {}
        # one column at a time, its parts dropped once joined: a shard is in memory about once, not twice
        tensors = {k: torch.cat(parts.pop(k)) for k in [k for k in parts if k != "lengths"]}
        lengths = torch.cat(parts["lengths"])
        if len(lengths) != len(ids):
            raise StoreError(f"shard {index}: {len(lengths)} samples encoded but {len(ids)} ids given")
        tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self.records.append(write_shard(self.root, index, tensors, ids, self.plan_hash))
