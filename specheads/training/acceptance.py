"""Measured acceptance during training: the head drafts for real on the target, beside the estimate.

At each held-out evaluation the engine can decode a few held-out prompts with the head being trained,
through the evaluator's engine (``specheads.decoding``: KV-cached target, one verification forward
per step, greedy verification), as a top-1 chain of ``k`` drafts. The measured τ (tokens per target
forward, bonus included) is logged beside the τ that the held-out accuracies of the first ``k``
drafts imply (``specheads.acceptance_math.estimate_tau`` with ``k``), and the gap between them, so
users learn how far the cheap estimate can be trusted.

A method supports this by providing ``drafter(model, shape) -> Drafter``; the target verifies
(for Medusa-2, the target being adapted: its LoRA weights are live in ``target.model``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from specheads.decoding.cpu_linears import can_pack, pack_cpu_linears, packed_count, unpack_cpu_linears
from specheads.decoding.drafters import TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.runner import TargetRunner
from specheads.targets import Target, eos_token_ids


def held_out_prompts(batches: Iterable, n: int, max_prompt_tokens: int = 384) -> list[list[int]]:
    """Up to ``n`` prompts: each held-out row up to its first assistant (loss-masked) token, the
    assistant header included, cut to its last ``max_prompt_tokens`` tokens."""
    out: list[list[int]] = []
    for batch in batches:
        batch = batch() if callable(batch) else batch
        for ids, mask, att in zip(batch["input_ids"], batch["loss_mask"], batch["attention_mask"]):
            first = ((mask > 0) & (att > 0)).nonzero()
            if len(first) and int(first[0]) >= 2:
                out.append(ids[: int(first[0])].tolist()[-max_prompt_tokens:])
            if len(out) >= n:
                return out
    return out


@torch.no_grad()
def measure_acceptance(method, model, target: Target, prompts: list[list[int]], k: int = 3,
                       max_new_tokens: int = 32, fans: Sequence[int] = ()) -> dict[str, float]:
    """Greedy chain-of-``k`` speculative decoding of ``prompts`` (batch 1 each) with the head.

    Returns ``measured_tau`` (tokens per target forward), ``measured_alpha`` (accepted ÷ tested
    drafts), ``measured_reach{d}`` for d = 1..k (the share of steps whose first d drafts were all
    accepted: what the evaluator's shape choice reads), ``measured_prompts`` and ``measured_k``;
    empty when there is nothing to decode. For each width ``w`` in ``fans`` the prompts are decoded
    again with a fan (the ``w`` best drafts of one draft forward, all children of the root, verified
    together as a tree) and ``measured_fan{w}_tau`` records its τ; a drafter that cannot draft trees
    (Medusa's static trees) measures chains only.

    A CPU target's linear layers are prepacked for oneDNN while it decodes here and unpacked after
    (``specheads.decoding.cpu_linears``): only τ is measured, and unpacked few-row forwards are slow
    (a fan of 3 verifies 4 tokens: 1.48 one-token forwards unpacked, 1.07 packed, on 2 AMD EPYC cores).
    """
    if not prompts or not hasattr(method, "drafter"):
        return {}
    was_training = model.training
    model.eval()
    packed = pack_cpu_linears(target.model) if can_pack(target.model) and not packed_count(target.model) else 0
    try:
        drafter = method.drafter(model, TreeShape("chain", k=k))
        runner = TargetRunner(target.model)
        eos = eos_token_ids(target)

        def decode(d):  # one greedy decode per prompt, batch 1: the stats of each
            return [speculative_generate(runner, d, [p], max_new_tokens, 0.0, "greedy", eos).stats[0] for p in prompts]

        emitted = steps = tested = accepted = 0
        by_depth = [0] * k
        for s in decode(drafter):
            emitted, steps = emitted + s.emitted, steps + s.steps
            tested, accepted = tested + sum(s.tested), accepted + sum(s.accepted)
            for d, a in enumerate(s.accepted[:k]):
                by_depth[d] += a
        fan_tau = {}
        for w in fans:
            try:
                fan = method.drafter(model, TreeShape.fan(w))
            except ValueError:
                break
            if getattr(getattr(fan, "shape", None), "kind", None) != "dynamic":
                break  # the method drafts another shape instead (Medusa: chains and static trees)
            results = decode(fan)
            fan_steps = sum(r.steps for r in results)
            if fan_steps:
                fan_tau[w] = sum(r.emitted for r in results) / fan_steps
    finally:
        model.train(was_training)
        if packed:
            unpack_cpu_linears(target.model)
    if not steps:
        return {}
    out = {"measured_tau": emitted / steps, "measured_alpha": accepted / tested if tested else 0.0,
           "measured_prompts": float(len(prompts)), "measured_k": float(getattr(drafter, "shape", TreeShape("chain", k=k)).k)}
    out.update({f"measured_reach{d + 1}": a / steps for d, a in enumerate(by_depth[: int(out["measured_k"])])})
    out.update({f"measured_fan{w}_tau": t for w, t in fan_tau.items()})
    return out

