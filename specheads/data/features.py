"""Hidden-state features: one function computes them, offline collection stores them, a reader serves them.

- ``compute_features(target, batch, spec)`` runs the frozen target and adds ``hidden_last`` /
  ``hidden_aux`` (float32, zero on padding) to a batch; for a store also ``target_argmax`` (the target's
  full-vocabulary argmax at each position, from ``hidden_last``), so training never redoes it. Collection and online training both call it,
  so offline and online features are the same tensors.
- ``collect_hidden_states`` writes them for a prepared dataset into a store (``specheads.data.store``),
  sorted by length, one disjoint share of the shards per process, resumable after a kill.
- ``FeatureDataset`` + ``collate_features`` + ``LengthGroupedBatchSampler`` read a store back as the
  trainer's batch dict; ``TokenDataset`` + ``OnlineFeatures`` give the same batches without a store.

Layer convention: see ``specheads.targets`` (aux layer i = input of decoder layer i; last = post-norm).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Sampler
from tqdm import tqdm

from specheads.data import budget
from specheads.data.store import (
    ARGMAX_KEY, MANIFEST, PLAN, POSITIONS_KEY, SHARD_DIR, STORE_FORMAT, CorruptShardError, FeatureSpec,
    InsufficientDiskError, ShardRecord, ShardWriter, StoreMismatchError, atomic_write_json, bytes_per_token,
    canonical_dtype, check_shard_file, decode_hidden, disk_slack, fits_on_disk, read_manifest, read_record,
    record_file, remove_stale_temps,
)
from specheads.errors import ConfigError
from specheads.families import aliases, find
from specheads.ranges import check_number
from specheads.data.images import image_reader, with_pixels
from specheads.targets import Target, default_eagle3_layers, target_argmax
from specheads.targets.model import uses_mrope

log = logging.getLogger(__name__)

HIDDEN_KEYS = ("hidden_last", "hidden_aux")
IMAGE_ROWS = "image_rows"  # a store's source: how many of its rows show images
POSITIONS = POSITIONS_KEY  # (T, 3) the 3-D M-RoPE positions of a target that uses them (Qwen2-VL family)
PIXEL_KEYS = ("pixel_values", "image_grid_thw")  # a vision-language batch's pixel inputs (``with_pixels``)


def spec_for_method(method: str, num_layers: int, aux_layers: Sequence[int] | None = None) -> FeatureSpec:
    """The features a head family (or training method) trains on, from its registry entry: the last state
    (Medusa, EAGLE-1, MTP), or aux layers (default ``default_eagle3_layers``) plus the last state (its target
    distribution = lm_head(last)); online only for Medusa-2; image rows where the family trains on them."""
    method = method.lower().replace("-", "").replace("_", "")
    fam = find(method)
    if fam is None:
        raise ValueError(f"unknown method {method!r}; expected one of {', '.join(aliases())}")
    online = method in fam.online_methods
    if not fam.aux_states:
        return FeatureSpec(aux_layers=(), need_last=True, online_only=online)
    layers = tuple(aux_layers) if aux_layers else default_eagle3_layers(num_layers)
    return FeatureSpec(aux_layers=tuple(int(i) for i in layers), need_last=True, image_rows=fam.image_rows,
                       online_only=online)


# --------------------------------------------------------------------------- computing


def compute_features(target: Target, batch: dict[str, torch.Tensor], spec: FeatureSpec,
                     argmax: bool = False) -> dict[str, torch.Tensor]:
    """Add the spec's hidden states to a batch (a new dict; tensors moved to the target's device).

    batch: input_ids (B, T), attention_mask (B, T) (1 = real token, right padding), loss_mask (B, T)
    adds:  hidden_last (B, T, H) float32 if ``spec.need_last`` (with ``argmax``: also target_argmax (B, T)
           long, 0 on padding: collection stores it; online training lets the method compute what it needs);
           hidden_aux (B, T, k*H) float32, aux layers concatenated in spec order, if ``spec.aux_layers``;
           positions (B, T, 3) long, the 3-D M-RoPE positions, for a target that uses them.
    A vision-language batch also holds its rows' pixel inputs (``with_pixels``); image positions get the states
    the language model computed over the vision features there.
    Padding positions are zero, so the result does not depend on what the padded rows computed.
    """
    device = target.device
    out = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
    ids = out["input_ids"]
    mask = out.get("attention_mask")
    if mask is None:
        mask = out["attention_mask"] = torch.ones_like(ids)
    if any(out.pop("images", None) or ()):  # references ``with_pixels`` did not read: a token-only batch loader's
        raise ConfigError("online features of image rows are not computed yet: collect a feature store "
                          "(specheads collect) and train from it (features_dir)")
    pixels = {k: out.pop(k) for k in PIXEL_KEYS if torch.is_tensor(out.get(k))}
    out.pop("image_grid_thw", None)  # a batch without images: its rows' (empty) grid lists
    feats = target.forward_features(ids, mask, aux_layers=spec.aux_layers, need_last=spec.need_last, **pixels)
    pad = ~mask.bool().unsqueeze(-1)
    if feats.positions is not None:
        out[POSITIONS] = feats.positions.long().masked_fill(pad, 0)
    if spec.need_last:
        out["hidden_last"] = feats.last.float().masked_fill(pad, 0.0)
        if argmax:
            am = feats.argmax if feats.argmax is not None else target_argmax(target.logits, feats.last)
            out[ARGMAX_KEY] = am.to(device).masked_fill(pad[..., 0], 0)
    if spec.aux_layers:
        out["hidden_aux"] = torch.cat([a.float() for a in feats.aux], dim=-1).masked_fill(pad, 0.0)
    return out


def add_features(batch: dict[str, torch.Tensor], target: Target, spec: FeatureSpec) -> dict[str, torch.Tensor]:
    """The engine's entry point: an offline batch (already holding the spec's hidden states) passes
    through unchanged; a token-only batch gets them computed from the frozen target."""
    needed = (["hidden_last"] if spec.need_last else []) + (["hidden_aux"] if spec.aux_layers else [])
    if all(k in batch for k in needed):
        return batch
    return compute_features(target, batch, spec)


class OnlineFeatures:
    """``add_features`` bound to a target and spec: ``OnlineFeatures(target, spec)(batch) -> batch``."""

    def __init__(self, target: Target, spec: FeatureSpec):
        self.target, self.spec = target, spec

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return add_features(batch, self.target, self.spec)


# --------------------------------------------------------------------------- batching


def collate_features(samples: list[dict[str, Any]], pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad samples of different lengths into the trainer's batch dict.

    samples: dicts with input_ids (T_i,), loss_mask (T_i,), optionally hidden_last (T_i, H), hidden_aux (T_i, D),
    target_argmax (T_i,)
    returns: input_ids, attention_mask, loss_mask (B, T) long; hidden_* (B, T, D) float32, zero padded;
    target_argmax (B, T) long when every sample has it.
    """
    longest = max(len(s["input_ids"]) for s in samples)
    T = math.ceil(longest / pad_to_multiple_of) * pad_to_multiple_of
    B = len(samples)
    batch = {k: torch.zeros(B, T, dtype=torch.long) for k in ("input_ids", "attention_mask", "loss_mask")}
    for key in HIDDEN_KEYS:
        if key in samples[0]:
            batch[key] = torch.zeros(B, T, samples[0][key].shape[-1], dtype=torch.float32)
    if all(ARGMAX_KEY in s for s in samples):
        batch[ARGMAX_KEY] = torch.zeros(B, T, dtype=torch.long)
    if all(POSITIONS in s for s in samples):
        batch[POSITIONS] = torch.zeros(B, T, 3, dtype=torch.long)
    for b, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][b, :n] = torch.as_tensor(s["input_ids"])
        batch["loss_mask"][b, :n] = torch.as_tensor(s["loss_mask"])
        batch["attention_mask"][b, :n] = 1
        for key in (*HIDDEN_KEYS, ARGMAX_KEY, POSITIONS):
            if key in batch:
                batch[key][b, :n] = torch.as_tensor(s[key])
    if "images" in samples[0]:  # references and grids, in row order: ``with_pixels`` reads the pixels
        batch["images"] = [list(s["images"]) for s in samples]
        batch["image_grid_thw"] = [list(map(list, s["image_grid_thw"])) for s in samples]
    return batch


def length_batches(order: Sequence[int], lengths: Sequence[int], max_tokens: int | None,
                   max_batch_size: int | None) -> list[list[int]]:
    """Cut ``order`` (indices, ideally sorted by length) into consecutive batches whose padded size
    ``len(batch) * longest`` stays within ``max_tokens`` and whose size within ``max_batch_size``.
    A sample longer than ``max_tokens`` forms a batch of its own."""
    batches: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        too_many = max_batch_size is not None and len(cur) >= max_batch_size
        too_big = max_tokens is not None and (len(cur) + 1) * new_longest > max_tokens
        if cur and (too_many or too_big):
            batches.append(cur)
            cur, new_longest = [], lengths[i]
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    return batches


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of similar-length samples (little padding), under a token budget, in shuffled order.

    lengths: per-sample token counts; max_tokens: padded tokens per batch; batch_size: samples per batch.
    With ``world_size > 1`` each rank iterates a disjoint share of the batches (same count on every rank).
    """

    def __init__(self, lengths: Sequence[int], max_tokens: int | None = None, batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1):
        if max_tokens is None and batch_size is None:
            raise ValueError("give max_tokens, batch_size or both")
        self.lengths, self.max_tokens, self.batch_size = list(lengths), max_tokens, batch_size
        self.shuffle, self.seed, self.rank, self.world_size, self.epoch = shuffle, seed, rank, world_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        tie = torch.randperm(len(self.lengths), generator=g).tolist() if self.shuffle else range(len(self.lengths))
        order = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], tie[i]))
        batches = length_batches(order, self.lengths, self.max_tokens, self.batch_size)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
        per_rank = len(batches) // self.world_size if self.world_size > 1 else len(batches)
        return batches[self.rank * per_rank:(self.rank + 1) * per_rank]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


# --------------------------------------------------------------------------- prepared tokens


def sample_lengths(dataset) -> list[int]:
    """Token count of each row of a prepared ``datasets.Dataset`` (read from Arrow, no row decoding)."""
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")["input_ids"]
    return pc.list_value_length(column).to_pylist()


class TokenDataset(Dataset):
    """A prepared dataset as samples ``{id, input_ids (T,), loss_mask (T,)}`` (the online-mode input); a vision-language
    target's rows also hold ``images`` and ``image_grid_thw``, read as pixels by ``batch`` with ``vision``
    (``images.VisionRenderer``)."""

    def __init__(self, dataset, vision=None):
        for col in ("input_ids", "loss_mask"):
            if col not in dataset.column_names:
                raise ValueError(f"prepared dataset lacks column '{col}' (has {dataset.column_names})")
        self.dataset = dataset
        self.has_ids = "id" in dataset.column_names
        self.has_images = "images" in dataset.column_names
        self.vision = vision
        self.lengths = sample_lengths(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows([i])[0]

    def rows(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Several samples in one Arrow read."""
        cols = self.dataset[list(indices)]
        ids = cols["id"] if self.has_ids else [str(i) for i in indices]
        rows = [{"id": str(ids[j]), "input_ids": torch.tensor(cols["input_ids"][j], dtype=torch.long),
                 "loss_mask": torch.tensor(cols["loss_mask"][j], dtype=torch.long)} for j in range(len(indices))]
        if self.has_images:  # a vision-language target's rows: their images' references and patch grids
            for j, row in enumerate(rows):
                row.update(images=cols["images"][j], image_grid_thw=cols["image_grid_thw"][j])
        return rows

    def batch(self, indices: Sequence[int]) -> dict[str, Any]:
        """The collated batch of the samples ``indices``, with their images' pixel inputs (``with_pixels``)."""
        batch = collate_features(self.rows(indices))
        return with_pixels(batch, self.vision) if self.has_images else batch

    def token_rows(self, indices: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(input_ids, loss_mask) lists of the samples ``indices`` (for count baselines)."""
        cols = self.dataset[list(indices)]
        return cols["input_ids"], cols["loss_mask"]


# --------------------------------------------------------------------------- collection


@dataclass
class CollectOptions:
    """How to collect. dtype: bfloat16 | float16 | float32 | fp8_e4m3 (per-token scale).

    shard_bytes: target size of one shard (sets tokens per shard); shard_samples: cap on samples per shard;
    batch_tokens / max_batch_size: padded tokens / samples per forward; rank / world_size: this
    process's share (shards rank, rank+W, ...); check_disk: refuse when the disk lacks room;
    verify_done: re-hash finished shards on a re-run (else only their size is checked);
    estimate_time: time one small forward first to log the expected collection time;
    write: False for the ranks of a tensor-parallel group other than its first: they run the same
    forward passes (collectives) on the same share but leave writing to it. With a tensor-parallel
    target, rank / world_size are the group's data-parallel rank and size (``ParallelLayout``);
    progress: show a bar of the tokens collected (rank 0); max_minutes: collect only the prepared rows, in
    their order, that fit this many minutes at the measured rate (``specheads.data.budget``; None: all).
    """

    dtype: str = "bfloat16"
    shard_bytes: int = 512 * 2**20
    shard_samples: int = 8192
    batch_tokens: int = 8192
    max_batch_size: int = 64
    rank: int = 0
    world_size: int = 1
    check_disk: bool = True
    verify_done: bool = True
    estimate_time: bool = True
    write: bool = True
    progress: bool = True  # a bar over this rank's tokens (rank 0), with its ETA
    max_minutes: float | None = None  # a time budget: the prepared rows, in order, that fit it (``data.budget``)


COLLECT_RULES = {"shard_bytes": (">= 1", "bytes per shard (sets its tokens)"),
                 "shard_samples": (">= 1", "samples per shard at most"),
                 "batch_tokens": (">= 1", "padded tokens per forward pass"),
                 "max_batch_size": (">= 1", "samples per forward pass at most")}


def check_collect_options(opts: CollectOptions) -> None:
    """Every setting of ``opts`` in its range, named as the recipe's ``collect.<name>`` (a ``ConfigError`` with
    the values it takes), before any work: a zero or negative size would plan one-row shards or no batches."""
    canonical_dtype(opts.dtype)
    for name, (rule, note) in COLLECT_RULES.items():
        check_number(f"collect.{name}", getattr(opts, name), rule, integer=True, note=note)
    check_number("collect.max_minutes", opts.max_minutes, "?> 0",
                 note="a time budget in minutes; null collects every prepared row")
    for name in ("check_disk", "verify_done", "estimate_time", "write", "progress"):
        if not isinstance(getattr(opts, name), bool):
            raise ConfigError(f"collect.{name}={getattr(opts, name)}: use true or false")
    if not 0 <= opts.rank < opts.world_size:
        raise ValueError(f"rank {opts.rank} is outside world_size {opts.world_size}")


def check_store_plan(root: str | Path, **facts: Any) -> None:
    """Refuse, before the target loads, to collect into ``root`` when it holds a store begun with other settings or
    data. ``facts``: the keys of ``store_header`` known without the target (``target``, ``num_layers``,
    ``hidden_size``, ``aux_layers``, ``has_last``, ``dtype``, ``num_samples``, ``num_tokens``); one that is None is
    not compared (``open_plan`` compares the whole plan once the target is loaded)."""
    try:
        old = json.loads((Path(root) / PLAN).read_text())
    except (OSError, ValueError):  # no store yet (or an unreadable plan: ``open_plan`` reports it)
        return
    diff = [f"{k} {old[k]} (now {v})" for k, v in facts.items() if v is not None and k in old and old[k] != v]
    if diff:
        raise StoreMismatchError(f"{root} holds a store begun with other settings or data (differs in: "
                                 f"{'; '.join(diff)}); collect into a new output_dir or delete {root}")


def plan_shards(lengths: Sequence[int], shard_tokens: int, shard_samples: int) -> list[list[int]]:
    """Sort samples by length (ties by index) and cut them into shards of at most ``shard_tokens``
    tokens and ``shard_samples`` samples. The plan depends only on the data, never on the process count."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    shards: list[list[int]] = []
    cur: list[int] = []
    tokens = 0
    for i in order:
        if cur and (tokens + lengths[i] > shard_tokens or len(cur) >= shard_samples):
            shards.append(cur)
            cur, tokens = [], 0
        cur.append(i)
        tokens += lengths[i]
    if cur:
        shards.append(cur)
    return shards


def store_header(target: Target, spec: FeatureSpec, opts: CollectOptions, ids: list[str],
                 lengths: list[int], shards: list[list[int]], source: dict | None = None) -> dict[str, Any]:
    """Identity and settings of a store; ``plan_hash`` covers everything that changes shard contents."""
    dtype = canonical_dtype(opts.dtype)
    header = {
        "format": STORE_FORMAT, "target": target.name, "target_config_hash": target.config_hash(),
        "tokenizer_fingerprint": target.tokenizer_fingerprint(), "num_layers": target.num_layers,
        "hidden_size": target.hidden_size, "aux_layers": list(spec.aux_layers), "has_last": spec.need_last,
        "has_argmax": spec.need_last,
        "last": "post-norm final hidden state (HF hidden_states[N]); target logits = lm_head(last)",
        "aux": "inputs of the listed decoder layers (HF hidden_states[i])", "dtype": dtype,
        "bytes_per_token": bytes_per_token(target.hidden_size, len(spec.aux_layers), spec.need_last, dtype),
        "num_shards": len(shards), "num_samples": len(ids), "num_tokens": int(sum(lengths)),
    }
    if uses_mrope(getattr(target, "config", None)):  # stores of other targets keep their header (and plan hash)
        header[POSITIONS] = "3-D M-RoPE positions (temporal, height, width) of each token, as the target ran"
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    h.update(json.dumps([[ids[i], lengths[i]] for shard in shards for i in shard] + [len(s) for s in shards]).encode())
    header["plan_hash"] = h.hexdigest()[:24]
    header["source"] = source or {}
    return header


def open_plan(root: Path, header: dict[str, Any], adopt_from: str | None = None,
              contents: list[tuple[list[str], list[int]]] | None = None) -> None:
    """Record the plan in a new store, or check that an existing one was begun with the same plan.
    ``adopt_from``: a plan this one replaces (a budget's cut, ``replan``, with the new plan's shard
    ``contents``): a store begun with it is moved over."""
    path = root / PLAN
    if path.exists():
        old = json.loads(path.read_text())
        if adopt_from is not None and old.get("plan_hash") == adopt_from:
            replan(root, header, adopt_from, contents or [])
            return
        if old.get("plan_hash") != header["plan_hash"]:
            diff = [k for k in header if k not in ("plan_hash", "source") and old.get(k) != header[k]]
            raise StoreMismatchError(
                f"{root} holds a store begun with other settings or data (differs in: {diff or 'sample ids/lengths'}); "
                f"collect into a new output_dir or delete {root}")
        return
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, header)


def replan(root: Path, header: dict[str, Any], from_plan: str, contents: list[tuple[list[str], list[int]]]) -> None:
    """Move a store from plan ``from_plan`` to ``header``'s, a plan of fewer rows whose first shards are the
    old plan's (a budget's cut; ``contents``: each new shard's ids and lengths): a finished shard holding what
    the new plan has at its index is relabelled, any other is deleted, then the new plan is written.
    Idempotent, so a kill part-way is completed by the re-run."""
    for index in range(max(len(contents), _highest_record(root) + 1)):
        record = read_record(root, index)
        if record is None or record.plan_hash == header["plan_hash"]:
            continue
        if (record.plan_hash == from_plan and index < len(contents)
                and (record.ids, record.lengths) == tuple(contents[index])):
            record.plan_hash = header["plan_hash"]
            atomic_write_json(root / record_file(index), asdict(record))
        else:
            (root / record_file(index)).unlink(missing_ok=True)
            (root / record.file).unlink(missing_ok=True)
    atomic_write_json(root / PLAN, header)


def _highest_record(root: Path) -> int:
    folder = root / SHARD_DIR
    found = [int(p.stem) for p in folder.glob("*.json") if p.stem.isdigit()] if folder.exists() else []
    return max(found, default=-1)


def shard_is_done(root: Path, index: int, plan_hash: str, full: bool) -> bool:
    """True when shard ``index`` has a record of this plan and its file matches it; a corrupt one is
    reported (by name) and counted as not done, so it is redone."""
    record = read_record(root, index)
    if record is None or record.plan_hash != plan_hash:
        return False
    try:
        check_shard_file(root, record, full=full)
    except CorruptShardError as e:
        log.warning("%s; redoing it", e)
        return False
    return True


def finalize_store(root: str | Path) -> dict[str, Any] | None:
    """Write manifest.json once every planned shard has its record; returns it, or None if shards remain.

    Every process calls this after its own shards, so the last one to finish writes the manifest
    (the content is deterministic, so two writers racing write the same file).
    """
    root = Path(root)
    header = json.loads((root / PLAN).read_text())
    records = [read_record(root, i) for i in range(header["num_shards"])]
    if any(r is None or r.plan_hash != header["plan_hash"] for r in records):
        return None
    for r in records:
        check_shard_file(root, r, full=False)
    shards = [{k: v for k, v in r.__dict__.items() if k != "plan_hash"} for r in records]
    manifest = {**header, "shards": shards, "num_loss_tokens": sum(r.num_loss_tokens for r in records),
                "bytes_on_disk": sum(r.bytes for r in records)}
    atomic_write_json(root / MANIFEST, manifest)
    return manifest


def check_disk_space(root: Path, needed: int) -> None:
    """Refuse (``InsufficientDiskError``) when ``needed`` bytes plus their slack (``store.disk_slack``) exceed the
    free space."""
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if not fits_on_disk(needed, free):
        raise InsufficientDiskError(
            f"not enough disk for the feature store in {root}: it needs ~{needed / 2**30:.2f} GiB "
            f"(+{disk_slack(needed) / 2**30:.2f} GiB slack), "
            f"{free / 2**30:.2f} GiB are free. Free space, choose another output_dir, or store dtype=fp8_e4m3 "
            f"(about half of bf16)")


def _estimate(target, spec, tokens: TokenDataset, batches: list[list[int]], todo_tokens: int,
              header: dict, opts: CollectOptions, root: Path, rate: float | None = None) -> None:
    """Log the store size and the collection time, at ``rate`` tokens/s (a time budget's measured rate) or from one
    timed forward; check the disk."""
    needed = todo_tokens * header["bytes_per_token"]
    log.info("feature store %s: %d samples, %d tokens, %s, %d B/token -> ~%.3f GiB in all; rank %d/%d writes ~%.3f GiB",
             root, header["num_samples"], header["num_tokens"], header["dtype"], header["bytes_per_token"],
             header["num_tokens"] * header["bytes_per_token"] / 2**30, opts.rank, opts.world_size, needed / 2**30)
    if opts.check_disk:
        check_disk_space(root, needed)
    if not batches or not opts.estimate_time:
        return
    how = "the budget's measured rate"
    if not rate:
        probe = batches[len(batches) // 2][:4]  # a few mid-length samples: cheap, and time scales with tokens
        batch = tokens.batch(probe)
        t0 = time.perf_counter()
        compute_features(target, batch, spec, argmax=spec.need_last)
        rate, how = batch["input_ids"].numel() / max(time.perf_counter() - t0, 1e-9), "one timed batch"
    padded = sum(len(b) * max(tokens.lengths[i] for i in b) for b in batches)
    log.info("estimated collection time for rank %d: ~%.1f min (%d padded tokens at ~%.0f tokens/s, %s)",
             opts.rank, padded / rate / 60, padded, rate, how)


def _within_budget(target, spec, dataset, tokens: TokenDataset, opts: CollectOptions, root: Path, source):
    """The prepared rows that fit ``opts.max_minutes`` (``budget.decide``), the source record saying so."""
    if opts.max_minutes <= 0:
        raise ValueError(f"collect.max_minutes must be positive (or null for no budget), got {opts.max_minutes}")

    def forward(rows: list[int]) -> int:
        batch = tokens.batch(rows)
        compute_features(target, batch, spec, argmax=spec.need_last)
        return batch["input_ids"].numel()

    def rate() -> float:
        return budget.measure_rate(forward, tokens.lengths, opts.batch_tokens)

    first = opts.rank == 0 and opts.write
    if opts.rank == 0 and not opts.write and target.layout.tp_size > 1:
        rate()  # a tensor-parallel peer of the first process: the same forwards (collectives), nothing decided
    decision = budget.decide(root, tokens.lengths, opts.max_minutes, opts.world_size, first, rate)
    if decision.get("cut"):  # stopped at its deadline before: the rows it kept
        dataset = dataset.select(decision["cut"]["kept_rows"])
        tokens = TokenDataset(dataset, tokens.vision)
    elif decision["rows"] < len(tokens):
        dataset = dataset.select(range(decision["rows"]))
        tokens = TokenDataset(dataset, tokens.vision)
    return dataset, tokens, {**(source or {}), "budget": decision}


def _cut_at_deadline(target, spec, dataset, tokens: TokenDataset, shards: list[list[int]], shard: int,
                     done: list[int], header: dict, opts: CollectOptions, root: Path, writer: "ShardWriter") -> None:
    """Stop a budgeted collection past its deadline: keep the finished shards (every one before ``shard``)
    and the rows ``done`` of ``shard``; record the cut (``budget.cut``), move the store to the plan of those
    rows (``replan``), and hand the writer the new plan for the rows of ``shard`` it holds."""
    kept = sorted([i for sh in shards[:shard] for i in sh] + done)
    renumber = {old: new for new, old in enumerate(kept)}
    lengths = [tokens.lengths[i] for i in kept]
    new_shards = plan_shards(lengths, max(1, opts.shard_bytes // header["bytes_per_token"]), opts.shard_samples)
    expected = [[renumber[i] for i in sh] for sh in shards[:shard]] + ([[renumber[i] for i in done]] if done else [])
    if new_shards != expected:  # plan_shards packs a prefix of its order the same way: this cannot differ
        raise RuntimeError(f"{root}: the cut's plan does not reproduce the finished shards; not cutting")
    ids = [str(x) for x in dataset.select(kept)["id"]] if tokens.has_ids else [str(i) for i in kept]
    source = dict(header["source"])
    new = store_header(target, spec, opts, ids, lengths, new_shards, source)
    source["budget"] = budget.cut(root, source["budget"], kept, sum(lengths), header["plan_hash"], new["plan_hash"])
    new["source"] = source
    writer.drain()  # the shards finished before the cut are on disk, under the old plan
    replan(root, new, header["plan_hash"], [([ids[i] for i in sh], [lengths[i] for i in sh]) for sh in new_shards])
    writer.plan_hash = new["plan_hash"]
    if done:
        writer.finish(shard, [ids[renumber[i]] for i in done])


def collect_hidden_states(target: Target, dataset, spec: FeatureSpec, out_dir: str | Path,
                          opts: CollectOptions | None = None, source: dict | None = None,
                          vision=None) -> dict[str, Any]:
    """Write the spec's features of a prepared dataset into a store at ``out_dir`` (this rank's share).

    dataset: ``datasets.Dataset`` with id, input_ids, loss_mask (and, prepared for a vision-language target,
    images and image_grid_thw: their pixels are read with ``vision``, the target's ``images.VisionRenderer``,
    loaded from the target's folder when None). Finished shards of the same plan are skipped; partial or corrupt
    ones are redone. Returns a summary (shards written/skipped, tokens, seconds, tokens/s, and ``manifest`` when
    this process completed the store).
    """
    opts = opts or CollectOptions()
    if spec.online_only:
        raise ValueError("this method trains the target itself (online_only); its features cannot be stored, "
                         "train it in online mode")
    check_collect_options(opts)
    root = Path(out_dir)
    tokens = TokenDataset(dataset, image_reader(target, dataset, vision))
    if opts.max_minutes is not None:
        dataset, tokens, source = _within_budget(target, spec, dataset, tokens, opts, root, source)
    if tokens.has_images:  # recorded: a trainer refuses image rows until it trains as the engine drafts them
        source = {**(source or {}), IMAGE_ROWS: sum(1 for refs in dataset["images"] if refs)}
    ids, shards, header, cut = _open_store(target, spec, dataset, tokens, opts, root, source)
    mine = list(range(opts.rank, len(shards), opts.world_size))
    if opts.write:
        remove_stale_temps(root, mine)
    todo = [s for s in mine if not shard_is_done(root, s, header["plan_hash"], opts.verify_done)]
    plan = {s: length_batches(shards[s], tokens.lengths, opts.batch_tokens, opts.max_batch_size) for s in todo}
    todo_tokens = sum(tokens.lengths[i] for s in todo for i in shards[s])
    budget_rate = ((source or {}).get("budget") or {}).get("tokens_per_s") if opts.max_minutes is not None else None
    _estimate(target, spec, tokens, [b for s in todo for b in plan[s]], todo_tokens, header, opts, root, budget_rate)
    log.info("rank %d: %d of its %d shards to do (%d finished already)", opts.rank, len(todo), len(mine),
             len(mine) - len(todo))
    t0 = time.perf_counter()
    if not opts.write:  # a tensor-parallel peer: the same forward passes, nothing written
        return _compute_for_writer(target, spec, tokens, todo, plan, len(mine), opts, t0)
    records = _write_shards(target, spec, dataset, tokens, shards, todo, plan, ids, header, cut, todo_tokens, opts,
                            root, t0)
    return _written_summary(root, records, len(mine) - len(todo), opts, t0)


def _open_store(target, spec: FeatureSpec, dataset, tokens: TokenDataset, opts: CollectOptions, root: Path,
                source: dict | None):
    """Plan the store's shards and open its plan at ``root`` (a budget's cut adopts the plan it came from);
    returns the row ids, the shards, the store's header and the cut (None if none)."""
    ids = [str(x) for x in dataset["id"]] if tokens.has_ids else [str(i) for i in range(len(tokens))]
    bpt = bytes_per_token(target.hidden_size, len(spec.aux_layers), spec.need_last, opts.dtype)
    shards = plan_shards(tokens.lengths, max(1, opts.shard_bytes // bpt), opts.shard_samples)
    header = store_header(target, spec, opts, ids, tokens.lengths, shards, source)
    cut = ((source or {}).get("budget") or {}).get("cut") if opts.max_minutes is not None else None
    open_plan(root, header, adopt_from=cut and cut["from_plan"],
              contents=[([ids[i] for i in sh], [tokens.lengths[i] for i in sh]) for sh in shards] if cut else None)
    return ids, shards, header, cut


def _compute_for_writer(target, spec: FeatureSpec, tokens: TokenDataset, todo: list[int], plan: dict, n_mine: int,
                        opts: CollectOptions, t0: float) -> dict[str, Any]:
    """A tensor-parallel peer's share: the same forward passes as its group's writer, nothing written."""
    for s in todo:
        for b in plan[s]:
            compute_features(target, tokens.batch(b), spec, argmax=spec.need_last)
    log.info("rank %d: computed its group's %d shards for the group's writer", opts.rank, len(todo))
    return {"rank": opts.rank, "shards_written": 0, "shards_skipped": n_mine - len(todo), "samples": 0,
            "tokens": 0, "seconds": time.perf_counter() - t0, "tokens_per_s": 0.0, "manifest": None}


def _write_shards(target, spec: FeatureSpec, dataset, tokens: TokenDataset, shards: list[list[int]], todo: list[int],
                  plan: dict, ids: list[str], header: dict, cut, todo_tokens: int, opts: CollectOptions, root: Path,
                  t0: float) -> list:
    """Compute and write the shards ``todo`` (a budget's deadline cuts the store where it passes); returns the
    records of the shards written."""
    # what waits for the writer is bounded in tokens (four batches' worth): a long row's batch waits alone
    writer = ShardWriter(root, header["dtype"], max(1, len(spec.aux_layers)), header["plan_hash"],
                         max_pending_tokens=4 * opts.batch_tokens)
    # this rank's tokens still to collect: tqdm's ETA is their count left at the pace so far (rank 0 shows it)
    bar = tqdm(total=todo_tokens, desc=f"collect rank {opts.rank}" if opts.world_size > 1 else "collect",
               unit="tok", unit_scale=True, dynamic_ncols=True, disable=opts.rank != 0 or not opts.progress)
    # a budget's deadline (``budget.OVERRUN``): one process only, whose store the cut can move; rows with ids
    deadline = None
    if opts.max_minutes is not None and opts.world_size == 1 and not cut and tokens.has_ids:
        deadline = t0 + opts.max_minutes * 60 * budget.OVERRUN
    try:
        stopped = False
        for s in todo:
            done: list[int] = []
            for b in plan[s]:
                stopped = deadline is not None and time.perf_counter() > deadline and bool(done or s != todo[0])
                if stopped:
                    _cut_at_deadline(target, spec, dataset, tokens, shards, s, done, header, opts, root, writer)
                    break
                writer.add(compute_features(target, tokens.batch(b), spec, argmax=spec.need_last))
                bar.update(sum(tokens.lengths[i] for i in b))
                done += b
            if stopped:
                break
            writer.finish(s, [ids[i] for i in shards[s]])
    except BaseException:
        writer.close(check=False)  # keep the shards finished so far; the original error propagates
        raise
    finally:
        bar.close()
    return writer.close()


def _written_summary(root: Path, records: list, skipped: int, opts: CollectOptions, t0: float) -> dict[str, Any]:
    """Finalize the store if this process completed it, log what was written and return the summary."""
    seconds = time.perf_counter() - t0
    done_tokens = sum(r.num_tokens for r in records)
    manifest = finalize_store(root)
    log.info("rank %d wrote %d shards (%d tokens) in %.1f s (%.0f tokens/s)%s", opts.rank, len(records),
             done_tokens, seconds, done_tokens / max(seconds, 1e-9),
             "; store complete, manifest written" if manifest else "; other shards still pending")
    return {"rank": opts.rank, "shards_written": len(records), "shards_skipped": skipped,
            "samples": sum(r.num_samples for r in records), "tokens": done_tokens, "seconds": seconds,
            "tokens_per_s": done_tokens / max(seconds, 1e-9), "manifest": manifest}


# --------------------------------------------------------------------------- reading


def check_manifest(manifest: dict[str, Any], spec: FeatureSpec | None = None, target: Target | None = None,
                   where: str | Path = "") -> None:
    """Refuse a store collected from another target / tokenizer, or lacking layers the spec needs."""
    where = f"feature store {where}".strip()
    if target is not None:
        for key, want, what in (("target_config_hash", target.config_hash(), "config hash"),
                                ("tokenizer_fingerprint", target.tokenizer_fingerprint(), "tokenizer fingerprint")):
            if manifest.get(key) != want:
                raise StoreMismatchError(
                    f"{where} was collected from target '{manifest.get('target')}' with {what} {manifest.get(key)}, "
                    f"but the trainer's target '{target.name}' has {what} {want}; collect features for this "
                    f"target (`specheads collect`) or use online features")
    if spec is not None:
        if (manifest.get("source") or {}).get(IMAGE_ROWS) and not spec.image_rows:
            raise StoreMismatchError(
                f"{where} holds {manifest['source'][IMAGE_ROWS]} image rows of a vision-language target, and this "
                "method does not train on image rows as the serving engine drafts there: train EAGLE-3 "
                "(method=eagle3), or from a store of text rows")
        if spec.online_only:
            raise StoreMismatchError(f"this method trains the target (online_only); it cannot train from {where}")
        missing = [i for i in spec.aux_layers if i not in manifest["aux_layers"]]
        if missing:
            raise StoreMismatchError(f"{where} holds aux layers {manifest['aux_layers']}, the method needs "
                                     f"{list(spec.aux_layers)} (missing {missing}); re-collect with those layers")
        if spec.need_last and not manifest["has_last"]:
            raise StoreMismatchError(f"{where} holds no last hidden state, which the method needs")


class FeatureDataset(Dataset):
    """Samples of a feature store, read through memory-mapped shards (``safe_open``).

    Item: ``{id, input_ids (T,) long, loss_mask (T,) long, hidden_last (T, H) float32,
    target_argmax (T,) long, hidden_aux (T, k*H) float32}`` holding what ``spec`` asks for (default: everything stored), aux
    layers in the spec's order. The manifest is checked against ``target``/``spec``; each shard's
    size is checked on open and (``verify``) its SHA-256 before its first read in this process.
    """

    def __init__(self, root: str | Path, spec: FeatureSpec | None = None, target: Target | None = None,
                 verify: bool = True):
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        check_manifest(self.manifest, spec, target, self.root)
        stored = tuple(self.manifest["aux_layers"])
        self.spec = spec or FeatureSpec(aux_layers=stored, need_last=self.manifest["has_last"])
        self.aux_index = [stored.index(i) for i in self.spec.aux_layers]
        self.hidden_size, self.verify = self.manifest["hidden_size"], verify
        self.records = [ShardRecord.from_dict(r) for r in self.manifest["shards"]]
        self.locations: list[tuple[int, int, int]] = []
        self.ids: list[str] = []
        self.lengths: list[int] = []
        for s, rec in enumerate(self.records):
            check_shard_file(self.root, rec, full=False)
            start = 0
            for n in rec.lengths:
                self.locations.append((s, start, start + n))
                start += n
            self.ids += rec.ids
            self.lengths += rec.lengths
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.locations)

    def __getstate__(self):  # DataLoader workers reopen the shards themselves
        return {**self.__dict__, "_handles": {}}

    def _shard(self, s: int):
        if s not in self._handles:
            from safetensors import safe_open

            rec = self.records[s]
            check_shard_file(self.root, rec, full=self.verify)
            self._handles[s] = safe_open(str(self.root / rec.file), framework="pt")
        return self._handles[s]

    def token_rows(self, indices: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """(input_ids, loss_mask) lists of the samples ``indices``, features left unread."""
        return self.column_rows(indices, "input_ids"), self.column_rows(indices, "loss_mask")

    def column_rows(self, indices: Sequence[int], name: str) -> list[list[int]] | None:
        """The lists of one per-token column (``input_ids``, ``loss_mask``, ``target_argmax``) of the samples
        ``indices``, features left unread; None when the store does not hold that column."""
        out = []
        for i in indices:
            s, a, b = self.locations[i]
            f = self._shard(s)
            if name not in f.keys():
                return None
            out.append(f.get_slice(name)[a:b].tolist())
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        s, a, b = self.locations[i]
        f = self._shard(s)
        names = set(f.keys())

        def rows(name):
            return f.get_slice(name)[a:b] if name in names else None

        item = {"id": self.ids[i], "input_ids": rows("input_ids").long(), "loss_mask": rows("loss_mask").long()}
        if POSITIONS in names:
            item[POSITIONS] = rows(POSITIONS).long()
        if self.spec.need_last:
            item["hidden_last"] = decode_hidden(rows("hidden_last"), rows("hidden_last_scale"))
            if ARGMAX_KEY in names:  # stores collected before it was stored: the trainer computes it
                item[ARGMAX_KEY] = rows(ARGMAX_KEY).long()
        if self.spec.aux_layers:
            aux = decode_hidden(rows("hidden_aux"), rows("hidden_aux_scale"))
            aux = aux.view(b - a, -1, self.hidden_size)[:, self.aux_index]
            item["hidden_aux"] = aux.reshape(b - a, -1)
        return item


def feature_loader(dataset: Dataset, max_tokens: int | None = 8192, batch_size: int | None = None,
                   shuffle: bool = True, seed: int = 0, num_workers: int = 0, rank: int = 0,
                   world_size: int = 1) -> torch.utils.data.DataLoader:
    """A DataLoader of trainer batches over a ``FeatureDataset`` or ``TokenDataset`` (length-grouped)."""
    sampler = LengthGroupedBatchSampler(dataset.lengths, max_tokens, batch_size, shuffle, seed, rank, world_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_features,
                                       num_workers=num_workers)
