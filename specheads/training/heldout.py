"""Held-out evaluation during training: summed metrics over every process, the training-time τ
estimate they imply, and the measured τ of a real chain draft (``acceptance.py``).

Held-out metric keys from ``Method.evaluate`` are summed over batches and processes, then
``X_correct / X_total -> X_acc`` and ``X_sum / X_count -> X``. The τ estimate is
``specheads.acceptance_math.estimate_tau`` (its one preference order: joint ``joint{k}_acc`` /
``chain{k}_acc`` accuracies, else products of marginal ``step{k}`` / ``head{k}`` top-1 accuracies).
"""

from __future__ import annotations


import torch
from torch import nn

from specheads.acceptance_math import estimate_tau
from specheads.methods.base import Method
from specheads.targets import Target
from specheads.training.batches import BatchSource, prepare_batch


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


@torch.no_grad()
def evaluate(method: Method, model: nn.Module, target: Target, source: BatchSource, accelerator,
             measure: dict | None = None) -> dict[str, float]:
    """Held-out metrics: ``Method.evaluate`` (through ``TrainingModule.forward(batch, evaluate=True)``)
    summed over this rank's batches (every ``world``-th, a ragged tail included), summed over
    processes. The unwrapped module is used, so ranks need not run in lockstep; with sharded
    parameters (ZeRO-3, FSDP) the wrapped module is called so it gathers them, and ranks run in
    lockstep (``_lockstep``: the same batches are counted, a rank short of one in the last round
    runs a batch again and discards its sums).
    ``measure``: {prompts, k, tokens} for the measured acceptance of a real chain draft (``_measured``)."""
    from specheads.training.accelerator import sharding

    from specheads.targets import data_parallel_share

    world = accelerator.num_processes
    # Ranks of a tensor-parallel target group run its forward together, so they take the same batches
    # (each counted once per peer: every sum is scaled alike, ratios are unchanged).
    dp_world, dp_rank = data_parallel_share(world, accelerator.process_index)
    unwrapped = accelerator.unwrap_model(model)
    was_training = model.training
    model.eval()
    sharded = sharding(accelerator)
    if sharded or dp_world < world:
        batches = _lockstep(source, dp_world, dp_rank)
    else:
        batches = ((b() if callable(b) else b, True) for i, b in enumerate(source.batches(0))
                   if i % dp_world == dp_rank)
    runner = model if sharded else unwrapped
    sums: dict[str, float] = {}
    for batch, counted in batches:
        batch = prepare_batch(batch, target, method.feature_spec, accelerator.device)
        with accelerator.autocast():
            out = runner(batch, evaluate=True)
        if counted:
            for k, v in out.items():
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
    if not sharded and target.layout.tp_size == 1:  # a split target cannot decode on the main process alone
        metrics.update(_measured(method, unwrapped.model, target, source, accelerator, measure or {}, metrics))
    return metrics


def _lockstep(source: BatchSource, world: int, rank: int):
    """(batch, counted) for this rank with sharded parameters: every rank must call the wrapped forward
    equally often (each call gathers shards collectively), so in round ``i`` rank ``r`` takes batch
    ``i * world + r``; past the last batch it reruns an earlier one, uncounted (a held-out set smaller
    than the number of processes is fine)."""
    loaders = list(source.batches(0))
    for first in range(0, len(loaders), world):
        i = first + rank
        b = loaders[i % len(loaders)]
        yield (b() if callable(b) else b), i < len(loaders)


def _measured(method, model, target, source, accelerator, measure: dict, metrics: dict) -> dict[str, float]:
    """Measured τ of a real chain draft on a few held-out prompts, beside the estimate for that chain
    (main process; the caller skips it under ZeRO-3/FSDP, whose sharded weights cannot decode on one rank)."""
    from specheads.training.acceptance import held_out_prompts, measure_acceptance

    n = measure.get("prompts", 0)
    if not n or not hasattr(method, "drafter") or not accelerator.is_main_process:
        return {}
    image_token = target.config.image_token_id if target.vision_language else None
    prompts = held_out_prompts(source.batches(0), n, image_token=image_token)
    with target.layers_loaded():
        out = measure_acceptance(method, model, target, prompts, measure["k"], measure["tokens"],
                                 measure.get("fans", ()))
    est, _ = estimate_tau(metrics, int(out.get("measured_k", measure["k"])))
    if out and est is not None:
        out["tau_estimate_chain"] = est
        out["tau_gap"] = out["measured_tau"] - est
    return out
