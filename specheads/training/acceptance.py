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


def held_out_prompts(batches: Iterable, n: int, max_prompt_tokens: int = 384,
                     image_token: int | None = None) -> list[list[int]]:
    """Up to ``n`` prompts: each held-out row up to its first assistant (loss-masked) token, the
    assistant header included, cut to its last ``max_prompt_tokens`` tokens. A row whose prompt holds
    ``image_token`` (a vision-language target's) is left out: the measured decode feeds token ids, no pixels."""
    out: list[list[int]] = []
    for batch in batches:
        batch = batch() if callable(batch) else batch
        for ids, mask, att in zip(batch["input_ids"], batch["loss_mask"], batch["attention_mask"]):
            first = ((mask > 0) & (att > 0)).nonzero()
            if len(first) and image_token is not None and bool((ids[: int(first[0])] == image_token).any()):
                continue
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
    empty when there is nothing to decode. For each width ``w`` in ``fans``, ``measured_fan{w}_tau``
    records the τ of decoding the prompts with a fan (the ``w`` best drafts of one draft forward, all
    children of the root, verified together as a tree); a drafter that cannot draft trees (Medusa's
    static trees) measures chains only. Fans are replayed, not decoded again (``_fan_taus``).

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

        # one greedy decode per prompt, batch 1
        results = [speculative_generate(runner, drafter, [p], max_new_tokens, 0.0, "greedy", eos) for p in prompts]
        emitted = steps = tested = accepted = 0
        by_depth = [0] * k
        for s in (r.stats[0] for r in results):
            emitted, steps = emitted + s.emitted, steps + s.steps
            tested, accepted = tested + sum(s.tested), accepted + sum(s.accepted)
            for d, a in enumerate(s.accepted[:k]):
                by_depth[d] += a
        fan_tau = {}
        if fans:
            try:
                fan = method.drafter(model, TreeShape.fan(max(fans)))
            except ValueError:
                fan = None
            if getattr(getattr(fan, "shape", None), "kind", None) == "dynamic":  # Medusa drafts other shapes
                fan_tau = _fan_taus(runner, fan, prompts, [r.tokens[0] for r in results], sorted(fans))
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


def _fan_taus(runner: TargetRunner, drafter, prompts: list[list[int]], outputs: list[list[int]],
              widths: list[int]) -> dict[int, float]:
    """τ of greedy decoding with a fan of each width, replayed on the greedy outputs already decoded.

    Greedy speculative decoding emits the target's greedy output whatever the drafter, and a fan's
    step depends only on the committed prefix: with ``o`` tokens emitted, it drafts the ``w`` best
    first tokens from the prefix and emits two tokens if output token ``o`` is among them (one if that
    was the last), else one. So one target forward over each prompt + output gives the features the
    decode would have committed, the drafter (the widest fan) proposes once per output position
    through its own incremental path, and each width's steps are counted from the ranks: the τ a
    decode with that fan measures, without a decode per width (equal up to float rounding of the
    features, which one forward computes instead of the decode's verify forwards).
    """
    steps = {w: 0 for w in widths}
    emitted = 0
    runner.aux_layers = tuple(drafter.aux_layers)
    for prompt, out in zip(prompts, outputs):
        full = list(prompt) + list(out)
        if len(out) < 1 or len(full) < 3:
            continue
        feats = runner.prefill([full])  # features of positions 0 .. len(full) - 2
        drafter.start([list(prompt)], feats)
        hit_rank = []
        for o, tok in enumerate(out):
            tree = drafter.propose([full[: len(prompt) + o]], [True], 0.0, None)[0]
            ranks = tree.tokens.tolist()
            hit_rank.append(ranks.index(tok) if tok in ranks else len(ranks))
            p = len(prompt) + o - 1  # the pending token's position, committed with ``tok`` after it
            drafter.observe(0, [tok], _row_at(feats.hidden_last, p), _row_at(feats.hidden_aux, p))
        n = len(out)
        emitted += n
        for w in widths:
            o = 0
            while o < n:
                steps[w] += 1
                o += min(2, n - o) if hit_rank[o] < w else 1
    return {w: emitted / s for w, s in steps.items() if s}


def _row_at(t: torch.Tensor | None, pos: int) -> torch.Tensor | None:
    return None if t is None else t[0, pos: pos + 1]

