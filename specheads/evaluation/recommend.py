"""Predict the speed-up of shorter drafts from what a run measured, and recommend one per row kind.

Each evaluated configuration drafted up to a depth ``D`` (a chain of ``K = D`` tokens, or a tree of
depth ``D``). A step accepts at most one draft per depth, so the run measures, for every ``d ≤ D``,
``P(L ≥ d) = accepted_d / steps`` (steps with no draft at all included), and the same drafts cut at
depth ``d`` would have given ``τ(d) = 1 + Σ_{j≤d} P(L ≥ j)`` (``acceptance_math.chain_tau``, joint
basis): exact for chains (a top-1 chain's first ``d`` drafts do not depend on ``K``), and for trees
the tree cut at depth ``d`` (whose token budget, the draft tokens verified per step, is read from
the run). Nothing is predicted beyond ``D``: deeper drafts were never tested.

Cost per step, in plain decoding forwards (``acceptance_math.speedup_from_tau``):

- GPU (memory-bound model, see ``metrics``): 1 + c_GPU · F(d);
- CPU (measured): v + c · F(d), with c the measured draft/target forward time ratio and v the
  measured cost of this configuration's verification forward relative to a plain decoding forward
  at the same temperature (for a cut tree an upper bound: it verifies fewer tokens).

F(d) = draft forwards per step at depth d: the measured F scaled by d / D (one forward per level),
except Medusa, whose heads draft every depth in one forward. Chains are recommended a length,
trees a depth (with its token budget); each row also shows the prediction at the configuration
that ran beside what was measured there. For chains Leviathan's closed form with the overall α is
shown beside.
"""

from __future__ import annotations

from specheads.acceptance_math import chain_tau, leviathan_speedup, speedup_from_tau
from specheads.families import find


def row_kind(shape: str) -> str:
    """``chain`` for ``chain{K}`` shapes, else ``tree`` (dynamic or static)."""
    return "chain" if shape.startswith("chain") else "tree"


def predict(row: dict, kind: str, depth: int, c_cpu: float, v_cpu: float, c_gpu: float, one_forward: bool,
            ds) -> list[dict]:
    """Predicted τ and speed-ups at each depth / chain length in ``ds`` (only those ≤ ``depth``)."""
    steps = row.get("target_forwards") or 0
    if not steps or depth < 1:
        return []
    acc = list(row.get("accepted") or []) + [0] * depth
    reach = [a / steps for a in acc[:depth]]
    nodes = list(row.get("nodes_by_depth") or [])
    forwards = row.get("draft_forwards_per_step") or 0.0
    out = []
    for d in sorted({d for d in ds if 1 <= d <= depth} | {depth}):
        tau = chain_tau(reach[:d], "joint")
        f = forwards if one_forward else forwards * d / depth
        p = {"k": d, "tau_pred": tau, "draft_forwards_per_step": f,
             "speedup_gpu_pred": speedup_from_tau(tau, c_gpu * f),
             "speedup_cpu_pred": speedup_from_tau(tau, c_cpu * f, v_cpu)}
        if kind == "tree":
            p["tokens_per_step"] = sum(nodes[:d]) / steps
        elif row.get("alpha") is not None:
            p["leviathan_gpu"] = leviathan_speedup(row["alpha"], c_gpu, d)
        out.append(p)
    return out


def recommend(report: dict, ks=(1, 2, 3, 4, 5, 6, 8)) -> dict:
    """Per method, temperature and domain: predictions for each chain length (chains, from ``ks``)
    or depth (trees, every depth) up to the measured one, the best of them (GPU and CPU), and the
    prediction at the configuration that ran next to its measured τ and speed-up."""
    out = {}
    for m in report["methods"]:
        kind = row_kind(m.get("shape", ""))
        fam = find(m.get("drafter"))  # None: a baseline drafter
        one_forward = fam is not None and fam.one_forward
        per_t = {}
        for T, doms in m["by_temperature"].items():
            plain = (report.get("plain_by_temperature") or {}).get(T) or report["plain"]
            per_d = {}
            for d, row in doms.items():
                depth = len(row.get("nodes_by_depth") or row.get("tested") or [])  # the deepest draft made
                v = _verify_cost(row, plain.get(d, {}))
                c = row.get("cost_ratio_c") or 0.0
                preds = predict(row, kind, depth, c, v, m["c_gpu"], one_forward,
                                ks if kind == "chain" else range(1, depth + 1))
                if not preds:
                    continue
                best_gpu = max(preds, key=lambda r: r["speedup_gpu_pred"])
                best_cpu = max(preds, key=lambda r: r["speedup_cpu_pred"])
                ran = preds[-1]  # the measured depth is always the last prediction
                per_d[d] = {"kind": kind, "measured_depth": depth, "predictions": preds,
                            "best_k_gpu": best_gpu["k"], "best_k_cpu": best_cpu["k"],
                            "best_speedup_gpu_pred": best_gpu["speedup_gpu_pred"],
                            "best_speedup_cpu_pred": best_cpu["speedup_cpu_pred"],
                            "predicted_tau": ran["tau_pred"], "measured_tau": row["tau"],
                            "predicted_speedup_cpu": ran["speedup_cpu_pred"],
                            "measured_speedup": row.get("speedup"),
                            "measured_speedup_range": row.get("speedup_range"),
                            "c_cpu": c, "verify_cost_cpu": v}
            per_t[T] = per_d
        out[m["name"]] = per_t
    return out


def _verify_cost(row: dict, plain_row: dict) -> float:
    """Time of one verification forward ÷ time of one plain decoding forward (measured, CPU)."""
    if not row.get("target_forwards") or not plain_row.get("target_forwards"):
        return 1.0
    base = _target_time_per_forward(plain_row)
    return _target_time_per_forward(row) / base if base > 0 else 1.0


def _target_time_per_forward(row: dict) -> float:
    return row["target_time_s"] / row["target_forwards"]
