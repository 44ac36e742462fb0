"""The training loop shared by every head family.

``train(method, target, train_data, cfg, optim, eval_data)`` runs any ``Method``
(``specheads.methods``) on any ``BatchSource`` (``batches.py``) under Accelerate: one CPU process,
or ``accelerate launch`` on several processes, GPUs or nodes (DDP, DeepSpeed ZeRO-2/3 or FSDP through
a launcher config in ``conf/launcher/``). The module handed to Accelerate is a ``TrainingModule``:
its ``forward`` runs the method's whole loss, so the wrapper's gradient sync and parameter
gathering apply to all of it. The loop does gradient accumulation, clipping, the LR schedule,
mixed precision, atomic resumable checkpoints (``checkpoint.py``; written in the background where that is
safe, ``train.async_checkpoint``), logs (``run_log.py``), a stop on
a non-finite loss, periodic held-out evaluation (``heldout.py``) and a time budget.

Optional ``Method`` hooks the loop uses when present:
  ``on_step_start(step: int)``        before each optimizer step (e.g. Medusa-2's head warm-up)
  ``summarize(metrics: dict) -> dict`` derived held-out metrics (e.g. perplexity from NLL)
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specheads.methods.base import Method, TrainingModule
from specheads.targets import Target
from specheads.training.accelerator import peak_rss_mb, resume_path, rss_anon_mb, trim_heap, gathered, make_accelerator, make_optimizer
from specheads.training.batches import BatchSource, micro_batches, prepare_batch
from specheads.training.checkpoint import Checkpointer, check_resume_settings, load_checkpoint, remove_partial
from specheads.training.config import NonFiniteLossError, OptimConfig, TrainConfig
from specheads.training.heldout import evaluate
from specheads.training.run_log import SUMMARY_FILE, RunLogger, read_losses
from specheads.training.schedule import TimeBudget, make_scheduler
from specheads.training import sequence_parallel

log = logging.getLogger(__name__)



@dataclass
class _State:
    step: int = 0
    epoch: int = 0
    pos: int = 0  # next batch index within the epoch
    tokens: int = 0
    train_s: float = 0.0
    peak_anon_mb: float | None = None  # this process's, sampled at log steps (not checkpointed, like ru_maxrss)


def train(method: Method, target: Target, train_data: BatchSource, cfg: TrainConfig,
          optim: OptimConfig | None = None, eval_data: BatchSource | None = None, accelerator=None,
          reload_target: Callable[[], Target] | None = None) -> dict[str, Any]:
    """Train ``method``'s module; write checkpoints/, head/, metrics.jsonl and train_summary.json
    under ``cfg.output_dir``; return the summary.

    reload_target: when given and ``cfg.free_target_layers``, the target's decoder layers are freed once the
    method's module is built (training batches must then carry their features: a feature store) and
    reloaded from it for the measured decode of held-out prompts (``Target.release_layers``)."""
    from accelerate.utils import set_seed

    optim = optim or OptimConfig()
    acc = accelerator or make_accelerator(cfg, method)
    if cfg.deterministic and acc.device.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    set_seed(cfg.seed)
    sequence_parallel.enable(method, cfg.sequence_parallel)  # before the module is built and wrapped
    out = Path(cfg.output_dir)
    ckpt_root = out / "checkpoints"
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        remove_partial(ckpt_root)
    model = TrainingModule(method, method.build(target), target)
    if reload_target is not None and cfg.free_target_layers:
        target.release_layers(reload_target)
    optimizer = make_optimizer(model, optim)
    st = _State()
    budget = TimeBudget(60 * cfg.max_minutes, lambda: st.train_s) if cfg.max_minutes else None  # reads st as rebound
    scheduler = make_scheduler(optimizer, optim.warmup_steps, cfg.max_steps, optim.min_lr_ratio, optim.schedule, budget)
    model, optimizer = acc.prepare(model, optimizer)
    acc.register_for_checkpointing(scheduler)  # stepped by hand: once per optimizer step at any world size

    resumed = resume_path(cfg, ckpt_root)
    if resumed is not None and cfg.settings:
        check_resume_settings(resumed, cfg.settings, f"output_dir={cfg.output_dir}")
    if resumed is not None:
        saved = load_checkpoint(acc, resumed)
        st = _State(saved["step"], saved["epoch"], saved["pos"], saved["tokens"], saved["train_s"])
        log.info("resumed from %s at step %d", resumed, st.step)
    logger = RunLogger(cfg, out, acc, method.name, st.step)
    saver = Checkpointer(acc, ckpt_root, cfg.keep_checkpoints, cfg.async_checkpoint)
    try:
        last_eval = _loop(method, model, target, train_data, eval_data, cfg, acc, optimizer, scheduler, st, logger, saver)
        logger.end_progress()
        summary = _finish(method, model, target, eval_data, cfg, acc, st, last_eval, resumed, out, saver)
    except BaseException:
        saver.close()  # a checkpoint being written is finished (its state was complete), then the error goes on
        logger.close()
        raise
    logger.close(summary)
    return summary


def _loop(method, model, target, train_data, eval_data, cfg, acc, optimizer, scheduler, st, logger, saver):
    stream = micro_batches(train_data, st.epoch, st.pos,  # a sequence-parallel group's ranks read one batch
                           *sequence_parallel.data_share(acc.num_processes, acc.process_index, cfg.sequence_parallel))
    params = [p for p in model.parameters() if p.requires_grad]
    last_eval: dict[str, float] | None = None
    model.train()
    while st.step < cfg.max_steps:
        if cfg.max_minutes is not None and st.train_s >= 60 * cfg.max_minutes:
            log.info("time budget of %.1f min reached at step %d of %d; stopping there", cfg.max_minutes,
                     st.step, cfg.max_steps)
            saver.save(st.step, _ckpt_state(st, cfg))
            break
        if hasattr(method, "on_step_start"):
            method.on_step_start(st.step)
        t0 = time.perf_counter()
        loss, metrics, tokens = _optimizer_step(method, model, target, stream, cfg, acc, optimizer, params, st)
        st.step += 1
        saver.check()  # a checkpoint that failed in the background stops the run here
        if cfg.malloc_trim_every and st.step % cfg.malloc_trim_every == 0 and acc.device.type == "cpu":
            trim_heap()
        st.tokens += tokens
        st.train_s += time.perf_counter() - t0
        if acc.num_processes > 1:  # one clock for all ranks: a time budget stops and decays them alike
            st.train_s = _slowest(st.train_s, acc.device)
        scheduler.step()  # after the clock: a time budget's decay reads st.train_s
        record = {"loss": loss, "lr": scheduler.get_last_lr()[0], "tokens": st.tokens, "train_s": st.train_s, **metrics}
        log_step = st.step % max(1, cfg.log_every) == 0
        if log_step or st.step == 1:
            anon = rss_anon_mb()
            if anon is not None:
                record["rss_anon_mb"] = anon
                st.peak_anon_mb = max(st.peak_anon_mb or 0.0, anon)
        logger.log(st.step, record, to_wandb=log_step)
        logger.progress(st.step, loss, record["lr"], st.train_s)
        if eval_data is not None and cfg.eval_every and st.step % cfg.eval_every == 0 and st.step < cfg.max_steps:
            last_eval = evaluate(method, model, target, eval_data, acc, _measure_opts(cfg))
            logger.log(st.step, {f"eval/{k}": v for k, v in last_eval.items()})
        if (cfg.save_every and st.step % cfg.save_every == 0) or st.step == cfg.max_steps:
            saver.save(st.step, _ckpt_state(st, cfg))
    return last_eval


def _slowest(seconds: float, device) -> float:
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


def _measure_opts(cfg: TrainConfig) -> dict[str, int]:
    return {"prompts": cfg.measure_prompts, "k": cfg.measure_k, "tokens": cfg.measure_tokens,
            "fans": tuple(cfg.measure_fans)}


def _peak_anon(st: _State) -> float | None:
    """Peak anonymous memory (MB) over the log-step samples and now (None where not reported):
    ``peak_rss_mb`` also counts every page of a memory-mapped feature store read so far."""
    seen = [v for v in (st.peak_anon_mb, rss_anon_mb()) if v is not None]
    return max(seen) if seen else None


def _ckpt_state(st: _State, cfg: TrainConfig) -> dict[str, Any]:
    state = {"epoch": st.epoch, "pos": st.pos, "tokens": st.tokens, "train_s": st.train_s}
    return {**state, "settings": cfg.settings} if cfg.settings else state


def _optimizer_step(method, model, target, stream, cfg, acc, optimizer, params, st):
    """``grad_accum`` micro-batches and one optimizer step; returns (mean loss, mean metrics, local tokens)."""
    losses, sums, tokens, norm = [], {}, 0, None
    for micro in range(cfg.grad_accum):
        st.epoch, st.pos, batch = next(stream)
        batch = prepare_batch(batch, target, method.feature_spec, acc.device)
        tokens += int(batch["attention_mask"].sum())
        with acc.accumulate(model):
            with acc.autocast():
                out = model(batch)  # the wrapper's forward: Method.loss inside (TrainingModule)
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


def _finish(method, model, target, eval_data, cfg, acc, st, last_eval, resumed, out: Path, saver) -> dict[str, Any]:
    if eval_data is not None:
        if acc.is_main_process:  # minutes with no bar: say what runs
            log.info("training stopped at step %d; held-out evaluation%s", st.step,
                     f" and a measured decode of {cfg.measure_prompts} held-out prompts with the head (acceptance per "
                     "draft depth)" if cfg.measure_prompts else "")
        last_eval = evaluate(method, model, target, eval_data, acc, _measure_opts(cfg))
        if acc.is_main_process:
            log.info("held-out after step %d: %s", st.step,
                     {k: round(v, 4) for k, v in last_eval.items() if isinstance(v, float)})
    head_dir = out / "head"
    if acc.is_main_process:
        log.info("saving the head to %s", head_dir)
    _save_head(method, model, target, acc, head_dir)
    # The ranks of a tensor-parallel target group, or of a sequence-parallel group, train on the same batches:
    # count them once.
    tokens = int(acc.reduce(torch.tensor(st.tokens, device=acc.device), "sum")) // target.layout.tp_size \
        // cfg.sequence_parallel
    ev = last_eval or {}
    summary = {
        "method": method.name, "steps": st.step, "epoch": st.epoch, "train_tokens": tokens,
        "tokens_per_s": tokens / st.train_s if st.train_s else None, "train_s": st.train_s,
        "peak_rss_mb": peak_rss_mb(), "peak_anon_mb": _peak_anon(st), "num_processes": acc.num_processes,
        "sequence_parallel": cfg.sequence_parallel,  # processes per row (a group reads the same batches)
        # DeepSpeed ZeRO-3 keeps a partitioned parameter's full size in ds_numel
        "trainable_params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad),
        "final_loss": read_losses(out).get(st.step) if acc.is_main_process else None,
        "eval": {k: v for k, v in ev.items() if not k.startswith("_")},
        "tau_estimate": ev.get("tau_estimate"), "tau_basis": ev.get("_tau_basis"),
        "head_dir": str(head_dir), "resumed_from": str(resumed) if resumed else None,
    }
    saver.wait()  # the last checkpoint, written while the held-out evaluation and the head's save ran
    if acc.is_main_process:
        tmp = out / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(summary, indent=1))
        os.replace(tmp, out / SUMMARY_FILE)
    acc.wait_for_everyone()
    return summary


def _save_head(method, model, target, acc, head_dir: Path) -> None:
    """``Method.save`` on the main process, with sharded parameters (ZeRO-3, FSDP) gathered first."""
    acc.wait_for_everyone()
    with gathered(model, acc) as trained:
        if acc.is_main_process:
            method.save(trained, str(head_dir), target)
    acc.wait_for_everyone()
