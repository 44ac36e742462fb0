"""Pick a head's draft shape for *this* machine: its measured verify cost curve and the head's
acceptance measured on training-side held-out prompts (never on the evaluation prompts: training leaves
the evaluator's chat slice out of its held-out rows, the prepared set holds no duplicate of a scored
prompt, and the evaluator refuses a head whose ``heldout_split`` record is missing or whose held-out
rows share a chat with a scored prompt: ``check_heldout_split``).

Candidates are chains and fans (the ``w`` best first drafts of one draft forward, verified together:
on a CPU, where verifying a few more tokens is cheap but not free, a fan of 2 beat a chain of 1:
τ 1.45 vs 1.33, 1.19× vs 1.15× in one run on the quickstart's head).

A chain of ``K`` drafts costs, per step, one target forward over ``K + 1`` tokens (``v(K+1)`` plain
forwards, measured: ``verify_cost_curve``) plus ``K`` draft forwards (``c`` plain forwards each,
measured by the evaluator with the head itself), and emits ``τ(K) = 1 + Σ_{d≤K} P(L ≥ d)`` tokens, where ``P(L ≥ d)`` is
the share of steps whose first ``d`` drafts were all accepted (the trainer's ``measured_reach{d}``,
exact for every chain cut at ``d ≤`` the measured length). A fan of width ``w`` costs ``v(w+1) + c``
and emits its measured τ (the trainer's ``measured_fan{w}_tau``). The choice maximises
``τ / (v + forwards·c)`` (``acceptance_math``). On a GPU ``v`` is nearly flat and long chains win;
on a CPU ``v`` climbs (SmolLM2 float32 on 2 cores: v(2) 1.12, v(4) 1.49, v(24) 2.35) and short ones do.
"""

from __future__ import annotations

import logging
import re
import statistics
from typing import Sequence

import torch

from specheads.acceptance_math import chain_tau, speedup_from_tau
from specheads.errors import UserError
from specheads.heads import head_source
from specheads.training.run_log import read_train_summary

log = logging.getLogger(__name__)


def measured_reach(head_dir: str | None) -> list[float]:
    """``P(L ≥ d)`` for d = 1.. from the head's ``train_summary.json`` (empty if none)."""
    ev = (read_train_summary(head_dir) or {}).get("eval") or {}
    out: list[float] = []
    while f"measured_reach{len(out) + 1}" in ev:
        out.append(float(ev[f"measured_reach{len(out) + 1}"]))
    return out


@torch.no_grad()
def verify_costs(runner, prompt: Sequence[int], ns: Sequence[int], reps: int = 7) -> tuple[dict[int, float], float]:
    """Median seconds of one target forward over a chain of ``n`` new tokens after ``prompt``, per n, in the kernels
    the model runs now, and of the one-token forward plain decoding makes (any exact-forward row floor lifted,
    ``exact.row_floor_lifted``). The evaluator measures it in its fast pass (``evaluation.passes``: the kernels its
    speed-ups are timed in, no floor), so v(1) is about 1; a model left on a padding floor (16 rows in float32 on
    one AVX-512 CPU) pays it in every v(n) while its plain unit does not, and the curve says so.

    The ``n`` values and the plain forward are interleaved within each repetition so drift on a shared
    machine hits all alike.
    """
    from specheads.decoding.exact import row_floor_lifted

    runner.prefill([list(prompt)])
    times: dict[int, list[float]] = {n: [] for n in ns}
    plain: list[float] = []
    for rep in range(reps + 1):
        for n in ns:
            dt = runner.timed_chain(list(prompt[-n:]) if len(prompt) >= n else [prompt[-1]] * n)
            if rep:  # the first round warms up
                times[n].append(dt)
        with row_floor_lifted(runner.model):
            dt = runner.timed_chain([prompt[-1]])
        if rep:
            plain.append(dt)
    return {n: statistics.median(v) for n, v in times.items()}, statistics.median(plain)


def verify_cost_curve(runner, prompt: Sequence[int], ns: Sequence[int], reps: int = 7) -> dict[int, float]:
    """``verify_costs``' curve alone (seconds per verify forward of n tokens)."""
    return verify_costs(runner, prompt, ns, reps)[0]


def monotone_curve(curve: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing curve (pool adjacent violators, least squares, equal weights).

    A forward over more tokens never costs less; a measured curve that dips (v(2) 1.38, v(3) 1.27 in
    one evaluation on this shared 2-core machine) is noise, and choosing by it would trade a wider
    fan for a narrower one on a blip. Pooling averages the violating neighbours instead.
    """
    blocks: list[list[float]] = []  # [sum, count] per pooled block, in order of n
    for n in sorted(curve):
        blocks.append([curve[n], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(sorted(curve), values))


def heldout_split(head_dir: str | None) -> dict | None:
    """How the head's training split its rows (``train_summary.json``'s ``heldout_split``, written by
    ``recipes/train.py``), None for a head trained before it was recorded."""
    return (read_train_summary(head_dir) or {}).get("heldout_split")


def check_heldout_split(name: str, head_dir: str | None, scored_chats: set[str]) -> dict:
    """The head's ``heldout_split``, with ``heldout_chats_scored`` (0), when its acceptance figures may be
    read before scoring: recorded, its held-out rows leaving the evaluator's chat slice out, and none of
    its held-out chats among ``scored_chats`` (the chat ids of the prompts being scored); else a UserError."""
    from specheads.data.render import chat_id

    split = heldout_split(head_dir)
    if not split or not split.get("heldout_excludes_evaluation"):
        raise UserError(f"{name}: head_shape=auto reads the head's acceptance measured on its held-out rows, and "
                        f"the train_summary.json of {head_dir} does not record a held-out split that leaves out the "
                        "evaluator's chat prompts (trained by an older version); retrain the head, or set "
                        "head_shape=tree")
    shared = sorted({chat_id(x) for x in split.get("heldout_ids") or ()} & scored_chats)
    if shared:
        raise UserError(f"{name}: the head's held-out rows include chat(s) this evaluation scores ({', '.join(shared[:3])}"
                        f"{'...' if len(shared) > 3 else ''}): its measured acceptance cannot choose the shape; "
                        "evaluate the chat slice of the prepared set the head was trained on, or set head_shape=tree")
    return {**{k: v for k, v in split.items() if k != "heldout_ids"}, "heldout_chats_scored": 0}


def measured_fans(head_dir: str | None) -> dict[int, float]:
    """τ of a fan of ``w`` first drafts per width ``w``, from the head's ``train_summary.json``."""
    ev = (read_train_summary(head_dir) or {}).get("eval") or {}
    found = ((re.fullmatch(r"measured_fan(\d+)_tau", key), v) for key, v in ev.items())
    return dict(sorted((int(m.group(1)), float(v)) for m, v in found if m))


def choose_shape(reach: Sequence[float], curve: dict[int, float], c: float,
                 fans: dict[int, float] | None = None, plain_s: float | None = None) -> dict:
    """The draft shape with the best predicted speed-up, and the prediction for every candidate.

    Candidates: chains of ``K`` drafts (``K`` draft forwards, ``K + 1`` tokens verified, τ from
    ``reach``) and fans of width ``w`` (one draft forward, its ``w`` best tokens verified together as
    children of the root, ``w + 1`` tokens, τ as measured: ``fans``). reach: ``P(L ≥ d)`` for
    d = 1..K_max; curve: seconds per verify forward of n tokens (n = 1.. at least the largest
    candidate), made non-decreasing (``monotone_curve``) before it is read, the measured one kept in
    ``verify_cost_measured``; plain_s: seconds of plain decoding's one-token forward, the unit of every cost
    and of the speed-ups predicted (None: the curve's one-token forward); c: one draft forward ÷ that unit
    (``plain_s``, else the curve's measured one-token forward). Returns ``{"label", "kind", "k" (chain
    length or fan width), "predictions": [{label, kind, k, tau, verify_cost, draft_forwards,
    speedup}], ...}``; with nothing measured, ``label`` and ``k`` are None.
    """
    measured, curve = curve, monotone_curve(curve)
    base = plain_s or curve[1]
    if not plain_s:
        c = c * measured[1] / base  # in units of the fitted one-token forward, as every v(n) below
    cands = [("chain", k, chain_tau(list(reach[:k]), "joint"), k + 1, k) for k in range(1, len(reach) + 1)]
    cands += [("fan", w, tau, w + 1, 1) for w, tau in sorted((fans or {}).items()) if w >= 2]
    preds = []
    for kind, k, tau, n, forwards in cands:
        if n not in curve:
            continue
        v = curve[n] / base
        preds.append({"label": f"{kind}{k}", "kind": kind, "k": k, "tau": tau, "verify_cost": v,
                      "draft_forwards": forwards, "speedup": speedup_from_tau(tau, forwards * c, v)})
    best = max(preds, key=lambda p: p["speedup"]) if preds else None
    return {"label": best["label"] if best else None, "kind": best["kind"] if best else None,
            "k": best["k"] if best else None, "predictions": preds, "c": c,
            "verify_cost_curve": {str(n): t / base for n, t in sorted(curve.items())}, "plain_forward_s": base,
            "plain_unit": "plain" if plain_s else "verify",
            "verify_cost_measured": {str(n): t / base for n, t in sorted(measured.items())},
            "reach": list(reach), "fans": {str(w): t for w, t in sorted((fans or {}).items())}}


def train_tau(head_dir: str | None) -> float | None:
    """τ estimated at training time (``train_summary.json`` next to or above the head), if any, scored
    against the target's greedy tokens (EAGLE always was; Medusa heads trained before their summary
    says ``tau_vs_target_greedy`` scored the data tokens instead, so they get None)."""
    if head_dir and head_source(head_dir) != "specheads":  # trained elsewhere: no train_summary.json of ours
        return None
    summary = read_train_summary(head_dir)
    if summary is None:
        return None
    if str(summary.get("method", "")).startswith("medusa") and not (summary.get("eval") or {}).get("tau_vs_target_greedy"):
        log.warning("%s: its training-time τ was scored against the data tokens (trained before the "
                    "target-greedy basis); not reported. Retrain to get it.", head_dir)
        return None
    return summary.get("tau_estimate")
