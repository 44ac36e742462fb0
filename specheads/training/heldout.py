"""Held-out evaluation during training: summed metrics over every process, the training-time τ
estimate they imply, and the measured τ of a real chain draft (``acceptance.py``).

Held-out metric keys from ``Method.evaluate`` are summed over batches and processes, then
``X_correct / X_total -> X_acc`` and ``X_sum / X_count -> X``. The acceptance estimate reads
``chain{k}_acc`` / ``joint{k}_acc`` (fraction of positions where drafts 0..k are all right) when
present, else ``head{k}_top1_acc`` / ``step{k}_top1_acc`` (product of marginals).
"""

from __future__ import annotations

import itertools
import re
from typing import Sequence

import torch
from torch import nn

from specheads.methods.base import Method
from specheads.targets import Target
from specheads.training.batches import BatchSource, micro_batches, prepare_batch


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
    """Held-out metrics: ``Method.evaluate`` (through ``TrainingModule.forward(batch, evaluate=True)``)
    summed over this rank's batches (every ``world``-th, a ragged tail included), summed over
    processes. The unwrapped module is used, so ranks need not run in lockstep; with sharded
    parameters (ZeRO-3, FSDP) the wrapped module is called so it gathers them, ranks run in lockstep
    and a ragged tail is dropped.
    ``measure``: {prompts, k, tokens} for the measured acceptance of a real chain draft (``_measured``)."""
    from specheads.training.accelerator import sharding

    world, rank = accelerator.num_processes, accelerator.process_index
    unwrapped = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    sharded = sharding(accelerator)
    if sharded:
        batches = (b for _, _, b in itertools.takewhile(lambda x: x[0] == 0, micro_batches(source, 0, 0, world, rank)))
    else:
        batches = (b() if callable(b) else b for i, b in enumerate(source.batches(0)) if i % world == rank)
    runner = model if sharded else unwrapped
    sums: dict[str, float] = {}
    for batch in batches:
        batch = prepare_batch(batch, target, method.feature_spec, accelerator.device)
        with accelerator.autocast():
            for k, v in runner(batch, evaluate=True).items():
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
    if not sharded:
        metrics.update(_measured(method, unwrapped.model, target, source, accelerator, measure or {}, metrics))
    return metrics


def _measured(method, model, target, source, accelerator, measure: dict, metrics: dict) -> dict[str, float]:
    """Measured τ of a real chain draft on a few held-out prompts, beside the estimate for that chain
    (main process; the caller skips it under ZeRO-3/FSDP, whose sharded weights cannot decode on one rank)."""
    from specheads.training.acceptance import estimate_for_chain, held_out_prompts, measure_acceptance

    n = measure.get("prompts", 0)
    if not n or not hasattr(method, "drafter") or not accelerator.is_main_process:
        return {}
    prompts = held_out_prompts(source.batches(0), n)
    out = measure_acceptance(method, model, target, prompts, measure["k"], measure["tokens"])
    est = estimate_for_chain(metrics, int(out.get("measured_k", measure["k"])))
    if out and est is not None:
        out["tau_estimate_chain"] = est
        out["tau_gap"] = out["measured_tau"] - est
    return out
