"""The training engine shared by every head family.

``train(method, target, train_data, cfg, optim, eval_data)`` runs any ``Method``
(``specheads.training.method``) on any ``BatchSource`` under Accelerate: one CPU process, or
``accelerate launch`` on several GPUs/nodes (DeepSpeed ZeRO-2/3 through a launcher config in
``conf/launcher/``). It does gradient accumulation, clipping, warm-up + cosine LR, mixed precision,
atomic resumable checkpoints (``checkpoint.py``), wandb (offline by default) + console + JSONL logs,
a stop on a non-finite loss, periodic held-out evaluation and a training-time acceptance estimate.

Batches come from a ``BatchSource``: ``batches(epoch, start)`` yields the epoch's micro-batches from
index ``start`` on, in an order fixed by the epoch number, so the data position (epoch, index) is
enough to resume. Features a batch lacks (``hidden_last`` / ``hidden_aux``) are computed online from
the frozen target, so offline (feature store) and online batches go through the same loop.

Optional ``Method`` hooks the engine uses when present:
  ``on_step_start(step: int)``        before each optimizer step (e.g. Medusa-2's head warm-up)
  ``summarize(metrics: dict) -> dict`` derived held-out metrics (e.g. perplexity from NLL)

Held-out metric keys from ``Method.evaluate`` are summed over batches and processes, then
``X_correct / X_total -> X_acc`` and ``X_sum / X_count -> X``. The acceptance estimate reads
``chain{k}_acc`` (fraction of positions where drafts 0..k are all right = product of conditional
accuracies) when present, else ``head{k}_top1_acc`` / ``step{k}_top1_acc`` (product of marginals).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import re
import resource
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
from torch import nn

from specheads.targets import Target
from specheads.training.checkpoint import (latest_checkpoint, load_checkpoint, remove_partial,
                                           save_checkpoint)
from specheads.training.method import FeatureSpec, Method
from specheads.training.schedule import make_scheduler

log = logging.getLogger(__name__)

SUMMARY_FILE = "train_summary.json"
METRICS_FILE = "metrics.jsonl"


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; the run stops without saving."""


# --------------------------------------------------------------------------- configuration


@dataclass
class OptimConfig:
    """AdamW + warm-up/cosine schedule. Weight decay applies to matrices only (not biases/norms)."""

    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"


@dataclass
class TrainConfig:
    """How long and how to train; steps are optimizer steps (``grad_accum`` micro-batches each)."""

    output_dir: str
    max_steps: int = 1000
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 | auto (bf16 where the GPU has it)
    seed: int = 0
    deterministic: bool = True
    log_every: int = 10
    eval_every: int = 0  # 0: only after the last step
    save_every: int = 100  # 0: only after the last step
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto (latest checkpoint if any) | never | a checkpoint folder
    wandb_mode: str = "offline"  # offline | online | disabled; WANDB_MODE in the environment wins
    wandb_project: str = "specheads"
    run_name: str | None = None
    progress: bool = True
    micro_batch_size: int = 1  # only told to DeepSpeed, which wants it in its config
    max_minutes: float | None = None  # time budget: stop (checkpoint, evaluate, save) once training took this long
    # Measured acceptance at each held-out evaluation: decode this many held-out prompts with the head
    # (greedy, top-1 chain of measure_k drafts, measure_tokens new tokens); 0 turns it off.
    measure_prompts: int = 4
    measure_k: int = 3
    measure_tokens: int = 32


# --------------------------------------------------------------------------- methods

METHODS: dict[str, str] = {
    "medusa1": "specheads.training.medusa_method:Medusa1Method",
    "medusa2": "specheads.training.medusa_method:Medusa2Method",
    "eagle1": "specheads.heads.eagle:Eagle1Method",
    "eagle3": "specheads.heads.eagle3:Eagle3Method",
}


def build_method(name: str, **kwargs) -> Method:
    """The ``Method`` registered as ``name`` (see ``METHODS``), constructed with ``kwargs``."""
    import importlib

    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHODS)}")
    module, cls = METHODS[name].split(":")
    try:
        factory = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"method {name!r} needs {METHODS[name]}, which cannot be imported: {e}") from e
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise TypeError(f"bad settings for method {name!r} ({cls}): {e}") from e


# --------------------------------------------------------------------------- batches


class BatchSource(Protocol):
    """Micro-batches (dicts of tensors, see ``Method``) of one epoch, from index ``start`` on."""

    def batches(self, epoch: int, start: int = 0) -> Iterable[dict[str, torch.Tensor]]: ...


class IterableSource:
    """Wrap ``fn(epoch) -> iterable of batches`` (deterministic per epoch) as a ``BatchSource``."""

    def __init__(self, fn: Callable[[int], Iterable[dict[str, torch.Tensor]]]):
        self.fn = fn

    def batches(self, epoch: int, start: int = 0) -> Iterable[dict[str, torch.Tensor]]:
        return itertools.islice(self.fn(epoch), start, None)


class DatasetBatches:
    """A ``BatchSource`` over a map-style dataset with ``lengths`` (``specheads.data.features``'
    ``FeatureDataset`` for a store, ``TokenDataset`` for prepared tokens): length-grouped batches
    under a token budget, shuffled per epoch by ``(seed, epoch)``. ``indices`` selects a subset;
    ``max_length`` cuts every sample to its first ``max_length`` tokens.
    Batches are yielded as loaders (zero-argument callables) so each process reads only its share.
    """

    def __init__(self, dataset, max_tokens: int | None = 4096, batch_size: int | None = None,
                 shuffle: bool = True, seed: int = 0, indices: Sequence[int] | None = None,
                 max_length: int | None = None):
        self.dataset, self.max_tokens, self.batch_size = dataset, max_tokens, batch_size
        self.shuffle, self.seed, self.max_length = shuffle, seed, max_length
        self.indices = list(range(len(dataset))) if indices is None else list(indices)
        self.lengths = [min(dataset.lengths[i], max_length or dataset.lengths[i]) for i in self.indices]
        if not self.indices:
            raise ValueError("DatasetBatches over an empty selection: nothing to train or evaluate on")

    def _plan(self, epoch: int) -> list[list[int]]:
        from specheads.data.features import LengthGroupedBatchSampler

        sampler = LengthGroupedBatchSampler(self.lengths, self.max_tokens, self.batch_size, self.shuffle, self.seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    def __len__(self) -> int:
        return len(self._plan(0))

    def batches(self, epoch: int, start: int = 0) -> Iterator[Callable[[], dict[str, torch.Tensor]]]:
        for idx in self._plan(epoch)[start:]:
            yield functools.partial(self._load, [self.indices[i] for i in idx])

    def _load(self, rows: list[int]) -> dict[str, torch.Tensor]:
        from specheads.data.features import collate_features

        ds = self.dataset
        samples = ds.rows(rows) if hasattr(ds, "rows") else [ds[i] for i in rows]
        if self.max_length:
            samples = [{k: (v[: self.max_length] if torch.is_tensor(v) else v) for k, v in x.items()} for x in samples]
        return collate_features(samples)


def split_rows(n: int, eval_rows: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic (train indices, held-out indices) of ``n`` rows, ``eval_rows`` held out."""
    if not 0 <= eval_rows < n:
        raise ValueError(f"cannot hold out {eval_rows} of {n} rows")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[eval_rows:]), sorted(perm[:eval_rows])


def _shard(source: BatchSource, epoch: int, start: int, world: int, rank: int) -> Iterator[tuple[int, dict]]:
    """Yield (next position, this rank's batch) per group of ``world`` batches; a ragged tail is dropped.

    A source may yield loaders (zero-argument callables) instead of batches; only this rank's is called.
    """
    group: list = []
    pos = start
    for batch in source.batches(epoch, start):
        group.append(batch)
        if len(group) == world:
            pos += world
            mine = group[rank]
            yield pos, (mine() if callable(mine) else mine)
            group = []


def micro_batches(source: BatchSource, epoch: int, pos: int, world: int = 1, rank: int = 0):
    """Endless stream of (epoch, next position, batch) from the data position (epoch, pos) on."""
    while True:
        got = False
        for nxt, batch in _shard(source, epoch, pos, world, rank):
            got = True
            yield epoch, nxt, batch
        if not got and pos == 0:
            raise ValueError(f"epoch {epoch} of the training data holds fewer than {world} batches")
        epoch, pos = epoch + 1, 0


def prepare_batch(batch: dict[str, torch.Tensor], target: Target, spec: FeatureSpec, device) -> dict[str, torch.Tensor]:
    """Move a batch to ``device``, cast stored features to float32 (what online features are),
    compute missing features with ``specheads.data.features.add_features`` (the function collection uses)."""
    from specheads.data.features import add_features

    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if k.startswith("hidden_") and v.is_floating_point() and v.dtype != torch.float32:
                v = v.float()
        out[k] = v
    return add_features(out, target, spec)


# --------------------------------------------------------------------------- metrics


def summarize_counts(sums: dict[str, float]) -> dict[str, float]:
    """``X_correct/X_total -> X_acc``, ``X_sum/X_count -> X``; other keys pass through."""
    out: dict[str, float] = {}
    for k, v in sums.items():
        if k.endswith("_correct"):
            total = sums.get(k[: -len("_correct")] + "_total", 0.0)
            out[k[: -len("_correct")] + "_acc"] = v / total if total else float("nan")
        elif k.endswith("_sum"):
            count = sums.get(k[: -len("_sum")] + "_count", 0.0)
            out[k[: -len("_sum")]] = v / count if count else float("nan")
        elif not k.endswith(("_total", "_count")):
            out[k] = v
    return out


def chain_tau(accs: Sequence[float], conditional: bool) -> float:
    """τ of a chain: 1 + Σ_k P(drafts 0..k all accepted).

    conditional=True: ``accs[k]`` already is P(drafts 0..k right) (measured jointly per position);
    False: ``accs[k]`` is draft k's marginal accuracy and the probabilities are products of marginals.
    """
    tau, run = 1.0, 1.0
    for a in accs:
        run = a if conditional else run * a
        tau += run
    return tau


def _indexed(metrics: dict[str, float], pattern: str) -> list[float]:
    found = {int(m.group(1)): v for k, v in metrics.items() if (m := re.fullmatch(pattern, k))}
    return [found[i] for i in range(len(found)) if i in found] if found else []


def estimate_tau(metrics: dict[str, float]) -> tuple[float | None, str]:
    """(τ estimate, basis) from summarized held-out metrics; basis names what it was built from."""
    for prefix in ("chain", "joint"):  # Medusa: chain{k}; EAGLE unroll: joint{k}
        chain = _indexed(metrics, prefix + r"(\d+)_acc")
        if chain:
            return chain_tau(chain, conditional=True), f"{prefix}: per-position joint accuracy of drafts 0..k (conditional)"
    for prefix in ("head", "step"):
        marg = _indexed(metrics, prefix + r"(\d+)_(?:top1_)?acc")
        if marg:
            return chain_tau(marg, conditional=False), f"product of marginal {prefix} top-1 accuracies"
    return None, "no per-draft accuracies reported"


@torch.no_grad()
def evaluate(method: Method, model: nn.Module, target: Target, source: BatchSource, accelerator,
             measure: dict | None = None) -> dict[str, float]:
    """Held-out metrics: ``Method.evaluate`` sums over this rank's batches (every ``world``-th, a
    ragged tail included), summed over processes. The unwrapped module is used, so ranks need not
    run in lockstep; under ZeRO-3 (whose forward gathers parameters) they do, and a ragged tail is dropped.
    ``measure``: {prompts, k, tokens} for the measured acceptance of a real chain draft (``_measured``)."""
    world, rank = accelerator.num_processes, accelerator.process_index
    unwrapped = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds is not None and ds.zero_stage == 3:
        batches = (b for _, _, b in itertools.takewhile(lambda x: x[0] == 0, micro_batches(source, 0, 0, world, rank)))
    else:
        batches = (b() if callable(b) else b for i, b in enumerate(source.batches(0)) if i % world == rank)
    sums: dict[str, float] = {}
    for batch in batches:
        batch = prepare_batch(batch, target, method.feature_spec, accelerator.device)
        with accelerator.autocast():
            for k, v in method.evaluate(unwrapped, batch, target).items():
                sums[k] = sums.get(k, 0.0) + float(v)
    if world > 1:
        from accelerate.utils import gather_object

        keys = sorted(set(gather_object(list(sums))))
        t = torch.tensor([sums.get(k, 0.0) for k in keys], device=accelerator.device, dtype=torch.float64)
        sums = dict(zip(keys, accelerator.reduce(t, "sum").tolist()))
    model.train(was_training)
    metrics = summarize_counts(sums)
    if hasattr(method, "summarize"):
        metrics.update(method.summarize(metrics))
    tau, basis = estimate_tau(metrics)
    if tau is not None:
        metrics["tau_estimate"] = tau
    metrics["_tau_basis"] = basis
    metrics.update(_measured(method, unwrapped, target, source, accelerator, measure or {}, metrics))
    return metrics


def _measured(method, model, target, source, accelerator, measure: dict, metrics: dict) -> dict[str, float]:
    """Measured τ of a real chain draft on a few held-out prompts, beside the estimate for that chain
    (main process; skipped under ZeRO-3, whose sharded weights cannot decode on one rank)."""
    from specheads.training.acceptance import estimate_for_chain, held_out_prompts, measure_acceptance

    n = measure.get("prompts", 0)
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    if not n or not hasattr(method, "drafter") or not accelerator.is_main_process or (ds and ds.zero_stage == 3):
        return {}
    prompts = held_out_prompts(source.batches(0), n)
    out = measure_acceptance(method, model, target, prompts, measure["k"], measure["tokens"])
    est = estimate_for_chain(metrics, int(out.get("measured_k", measure["k"])))
    if out and est is not None:
        out["tau_estimate_chain"] = est
        out["tau_gap"] = out["measured_tau"] - est
    return out


# --------------------------------------------------------------------------- logging


class RunLogger:
    """wandb (main process; offline unless told otherwise), ``metrics.jsonl`` and a tqdm bar."""

    def __init__(self, cfg: TrainConfig, out: Path, accelerator, method_name: str, start_step: int):
        self.main = accelerator.is_main_process
        self.run = self.bar = None
        self.jsonl = out / METRICS_FILE
        if not self.main:
            return
        _truncate_jsonl(self.jsonl, start_step)
        mode = os.environ.get("WANDB_MODE", cfg.wandb_mode)
        if mode != "disabled":
            self.run = _init_wandb(cfg, out, mode, method_name)
        if cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.max_steps, initial=start_step, desc=f"train {method_name}", dynamic_ncols=True)

    def log(self, step: int, record: dict[str, float], to_wandb: bool = True) -> None:
        if not self.main:
            return
        clean = {k: v for k, v in record.items() if not k.startswith("_")}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.run is not None and to_wandb:
            self.run.log(clean, step=step)

    def progress(self, step: int, loss: float, lr: float) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")

    def close(self, summary: dict[str, Any] | None = None) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            if summary:
                self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            self.run.finish()


def _init_wandb(cfg: TrainConfig, out: Path, mode: str, method_name: str):
    import wandb

    id_file = out / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(project=cfg.wandb_project, name=cfg.run_name or f"{method_name}-{out.name}", id=run_id,
                      resume="allow", mode=mode, dir=str(out), config={"train": asdict(cfg), "method": method_name})


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records past the step we resume from (they came from the killed run)."""
    if not path.exists():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= last_step]
    path.write_text("".join(ln + "\n" for ln in keep))


def read_losses(output_dir: str | Path) -> dict[int, float]:
    """Step -> training loss from a run's ``metrics.jsonl``."""
    out = {}
    for ln in (Path(output_dir) / METRICS_FILE).read_text().splitlines():
        rec = json.loads(ln)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


# --------------------------------------------------------------------------- set-up


def make_accelerator(cfg: TrainConfig, method: Method | None = None):
    """An ``Accelerator`` for this config (DeepSpeed comes from ``accelerate launch --config_file``).

    A method whose module leaves parameters unused in some steps (Medusa-2's head warm-up) sets
    ``find_unused_parameters = True`` so DDP does not wait for their gradients.
    """
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    if mp not in ("no", "bf16", "fp16"):
        raise ValueError(f"mixed_precision must be no, bf16, fp16 or auto, got {cfg.mixed_precision!r}")
    ddp = DistributedDataParallelKwargs(find_unused_parameters=bool(getattr(method, "find_unused_parameters", False)))
    # Several CPU processes (torchrun / accelerate launch --cpu) need cpu=True for Accelerate to use gloo.
    cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
    acc = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mp, kwargs_handlers=[ddp],
                      cpu=cpu)
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if ds is not None:  # without a prepared dataloader DeepSpeed cannot fill these "auto" values itself
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        if ds.deepspeed_config.get("gradient_clipping") == "auto":
            ds.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm or 0.0
    return acc


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the method built a module with no trainable parameters")
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps)


def _resume_path(cfg: TrainConfig, ckpt_root: Path) -> Path | None:
    if cfg.resume == "never":
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(ckpt_root)
    path = Path(cfg.resume)
    if not path.is_dir():
        raise FileNotFoundError(f"resume={cfg.resume!r}: no such checkpoint folder (use auto, never or a folder)")
    return path


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --------------------------------------------------------------------------- the loop


@dataclass
class _State:
    step: int = 0
    epoch: int = 0
    pos: int = 0  # next batch index within the epoch
    tokens: int = 0
    train_s: float = 0.0


def train(method: Method, target: Target, train_data: BatchSource, cfg: TrainConfig,
          optim: OptimConfig | None = None, eval_data: BatchSource | None = None, accelerator=None) -> dict[str, Any]:
    """Train ``method``'s module; write checkpoints/, head/, metrics.jsonl and train_summary.json
    under ``cfg.output_dir``; return the summary."""
    from accelerate.utils import set_seed

    optim = optim or OptimConfig()
    acc = accelerator or make_accelerator(cfg, method)
    if cfg.deterministic and acc.device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    ckpt_root = out / "checkpoints"
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        remove_partial(ckpt_root)
    model = method.build(target)
    optimizer = make_optimizer(model, optim)
    scheduler = make_scheduler(optimizer, optim.warmup_steps, cfg.max_steps, optim.min_lr_ratio, optim.schedule)
    model, optimizer = acc.prepare(model, optimizer)
    acc.register_for_checkpointing(scheduler)  # stepped by hand: once per optimizer step at any world size

    st, resumed = _State(), _resume_path(cfg, ckpt_root)
    if resumed is not None:
        saved = load_checkpoint(acc, resumed)
        st = _State(saved["step"], saved["epoch"], saved["pos"], saved["tokens"], saved["train_s"])
        log.info("resumed from %s at step %d", resumed, st.step)
    logger = RunLogger(cfg, out, acc, method.name, st.step)
    try:
        last_eval = _loop(method, model, target, train_data, eval_data, cfg, acc, optimizer, scheduler, st, logger, ckpt_root)
        summary = _finish(method, model, target, eval_data, cfg, acc, st, last_eval, resumed, out)
    except BaseException:
        logger.close()
        raise
    logger.close(summary)
    return summary


def _loop(method, model, target, train_data, eval_data, cfg, acc, optimizer, scheduler, st, logger, ckpt_root):
    stream = micro_batches(train_data, st.epoch, st.pos, acc.num_processes, acc.process_index)
    params = [p for p in model.parameters() if p.requires_grad]
    last_eval: dict[str, float] | None = None
    model.train()
    while st.step < cfg.max_steps:
        if cfg.max_minutes is not None and st.train_s >= 60 * cfg.max_minutes:
            log.info("time budget of %.1f min reached at step %d of %d; stopping there", cfg.max_minutes,
                     st.step, cfg.max_steps)
            save_checkpoint(acc, ckpt_root, st.step, _ckpt_state(st), cfg.keep_checkpoints)
            break
        if hasattr(method, "on_step_start"):
            method.on_step_start(st.step)
        t0 = time.perf_counter()
        loss, metrics, tokens = _optimizer_step(method, model, target, stream, cfg, acc, optimizer, params, st)
        scheduler.step()
        st.step += 1
        st.tokens += tokens
        st.train_s += time.perf_counter() - t0
        record = {"loss": loss, "lr": scheduler.get_last_lr()[0], "tokens": st.tokens, "train_s": st.train_s, **metrics}
        logger.log(st.step, record, to_wandb=st.step % max(1, cfg.log_every) == 0)
        logger.progress(st.step, loss, record["lr"])
        if eval_data is not None and cfg.eval_every and st.step % cfg.eval_every == 0 and st.step < cfg.max_steps:
            last_eval = evaluate(method, model, target, eval_data, acc, _measure_opts(cfg))
            logger.log(st.step, {f"eval/{k}": v for k, v in last_eval.items()})
        if (cfg.save_every and st.step % cfg.save_every == 0) or st.step == cfg.max_steps:
            save_checkpoint(acc, ckpt_root, st.step, _ckpt_state(st), cfg.keep_checkpoints)
    return last_eval


def _measure_opts(cfg: TrainConfig) -> dict[str, int]:
    return {"prompts": cfg.measure_prompts, "k": cfg.measure_k, "tokens": cfg.measure_tokens}


def _ckpt_state(st: _State) -> dict[str, Any]:
    return {"epoch": st.epoch, "pos": st.pos, "tokens": st.tokens, "train_s": st.train_s}


def _optimizer_step(method, model, target, stream, cfg, acc, optimizer, params, st):
    """``grad_accum`` micro-batches and one optimizer step; returns (mean loss, mean metrics, local tokens)."""
    losses, sums, tokens, norm = [], {}, 0, None
    for micro in range(cfg.grad_accum):
        st.epoch, st.pos, batch = next(stream)
        batch = prepare_batch(batch, target, method.feature_spec, acc.device)
        tokens += int(batch["attention_mask"].sum())
        with acc.accumulate(model):
            with acc.autocast():
                out = method.loss(model, batch, target)
            value = float(acc.reduce(out.loss.detach().float(), "mean"))
            if not math.isfinite(value):
                raise NonFiniteLossError(f"{method.name}: loss is {value} at step {st.step + 1} (micro-batch "
                                         f"{micro + 1}/{cfg.grad_accum}, epoch {st.epoch}); stopping without "
                                         "saving. Lower the learning rate or check the data and features.")
            acc.backward(out.loss)
            if acc.sync_gradients and cfg.max_grad_norm:
                norm = acc.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(value)
        for k, v in out.metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    metrics = {k: v / cfg.grad_accum for k, v in sums.items()}
    if norm is not None:  # the norm before clipping
        metrics["grad_norm"] = float(norm)
    return sum(losses) / len(losses), metrics, tokens


def _finish(method, model, target, eval_data, cfg, acc, st, last_eval, resumed, out: Path) -> dict[str, Any]:
    if eval_data is not None:
        last_eval = evaluate(method, model, target, eval_data, acc, _measure_opts(cfg))
        if acc.is_main_process:
            log.info("held-out after step %d: %s", st.step,
                     {k: round(v, 4) for k, v in last_eval.items() if isinstance(v, float)})
    head_dir = out / "head"
    _save_head(method, model, target, acc, head_dir)
    tokens = int(acc.reduce(torch.tensor(st.tokens, device=acc.device), "sum"))
    ev = last_eval or {}
    summary = {
        "method": method.name, "steps": st.step, "epoch": st.epoch, "train_tokens": tokens,
        "tokens_per_s": tokens / st.train_s if st.train_s else None, "train_s": st.train_s,
        "peak_rss_mb": _peak_rss_mb(), "num_processes": acc.num_processes,
        "final_loss": read_losses(out).get(st.step) if acc.is_main_process else None,
        "eval": {k: v for k, v in ev.items() if not k.startswith("_")},
        "tau_estimate": ev.get("tau_estimate"), "tau_basis": ev.get("_tau_basis"),
        "head_dir": str(head_dir), "resumed_from": str(resumed) if resumed else None,
    }
    if acc.is_main_process:
        tmp = out / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, out / SUMMARY_FILE)
    acc.wait_for_everyone()
    return summary


def _save_head(method, model, target, acc, head_dir: Path) -> None:
    """``Method.save`` on the main process, with ZeRO-3 parameters gathered first."""
    acc.wait_for_everyone()
    unwrapped = acc.unwrap_model(model)
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if ds is not None and ds.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(unwrapped.parameters()), modifier_rank=None):
            if acc.is_main_process:
                method.save(unwrapped, str(head_dir), target)
    elif acc.is_main_process:
        method.save(unwrapped, str(head_dir), target)
    acc.wait_for_everyone()
