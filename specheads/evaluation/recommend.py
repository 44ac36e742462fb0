"""Predict the speed-up of each chain length from measured α and cost, and recommend one per domain.

For a chain of K drafts with per-position acceptance α_i (measured; the last measured value is
reused beyond), expected tokens per step = 1 + Σ_{j<=K} Π_{i<=j} α_i (with a constant α this is
Leviathan et al.'s (1 - α^(K+1)) / (1 - α)). Cost per step, in target forwards:

- GPU (memory-bound model, see ``metrics``): 1 + c_GPU · K;
- CPU (measured): v + c · K, with c the measured draft/target forward time ratio and v the
  measured cost of one verification forward relative to a plain decoding forward.

Leviathan's closed form (1 - α^(K+1)) / ((1 - α)(c K + 1)) with the overall α is shown beside.
Steps where the drafter proposed nothing (n-gram without a match) scale the gain: τ = 1 + coverage · (τ_K - 1).
"""

from __future__ import annotations

from specheads.evaluation.metrics import expected_tokens, leviathan_speedup


def predict_chain(alpha_by_position: list[float | None], alpha: float | None, c_cpu: float, v_cpu: float,
                  c_gpu: float, ks, coverage: float = 1.0) -> list[dict]:
    """Predicted τ and speed-ups for each K in ``ks``. coverage: fraction of steps that had a draft
    at all (an n-gram drafter proposes nothing when the context has no match)."""
    rows = []
    for k in ks:
        tau = 1.0 + coverage * (expected_tokens(alpha_by_position, k) - 1.0)
        rows.append({"k": k, "tau_pred": tau, "speedup_gpu_pred": tau / (1 + c_gpu * k),
                     "speedup_cpu_pred": tau / (v_cpu + c_cpu * k),
                     "leviathan_gpu": leviathan_speedup(alpha, c_gpu, k) if alpha is not None else None})
    return rows


def recommend(report: dict, ks=(1, 2, 3, 4, 5, 6, 8)) -> dict:
    """Per method, temperature and domain: predictions for each K and the best K (GPU and CPU),
    next to the measured τ and speed-up of the configuration that was run."""
    plain = report["plain"]
    out = {}
    for m in report["methods"]:
        per_t = {}
        for T, doms in m["by_temperature"].items():
            per_d = {}
            for d, row in doms.items():
                v = _verify_cost(row, plain.get(d, {}))
                c = row.get("cost_ratio_c") or 0.0
                cov = row["tested"][0] / row["target_forwards"] if row.get("tested") and row["target_forwards"] else 1.0
                preds = predict_chain(row["alpha_by_position"], row["alpha"], c, v, m["c_gpu"], ks, cov)
                best_gpu = max(preds, key=lambda r: r["speedup_gpu_pred"])
                best_cpu = max(preds, key=lambda r: r["speedup_cpu_pred"])
                per_d[d] = {"predictions": preds, "best_k_gpu": best_gpu["k"], "best_k_cpu": best_cpu["k"],
                            "best_speedup_gpu_pred": best_gpu["speedup_gpu_pred"],
                            "best_speedup_cpu_pred": best_cpu["speedup_cpu_pred"],
                            "measured_tau": row["tau"], "measured_speedup": row.get("speedup"),
                            "c_cpu": c, "verify_cost_cpu": v, "draft_coverage": cov}
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
