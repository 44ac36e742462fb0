"""The target's verify cost curve on this machine: one forward over n new tokens ÷ one token.

What `specheads evaluate head_shape=auto` measures before choosing a chain length, for any n:
    .venv/bin/python scripts/bench/bench_verify_cost.py [--target smollm2] [--dtype float32] [--context 300] [--reps 12]
                                                  [--linears auto|packed|plain]
Prints the one-token forward time and v(n) for n = 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64.
"""

from __future__ import annotations

import argparse

from specheads.decoding.cpu_linears import CPU_LINEAR_MODES, choose_cpu_linears
from specheads.decoding.runner import TargetRunner
from specheads.evaluation.shape_choice import verify_cost_curve
from specheads.targets import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=300, help="committed tokens before the verified ones")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--linears", default="auto", choices=CPU_LINEAR_MODES,
                    help="CPU linear layers as the evaluator's cpu_linears setting (auto: the faster layout)")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
    args = ap.parse_args()
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    linears = choose_cpu_linears(target.model, args.linears)
    prompt = [100 + i % 1000 for i in range(args.context)]
    curve = verify_cost_curve(TargetRunner(target.model), prompt, sorted(set(args.ns) | {1}), args.reps)
    print(f"{target.name} {args.dtype} on {args.device}, context {args.context}: one-token forward "
          f"{1000 * curve[1]:.1f} ms, linear layers {linears['linears']}")
    print("  ".join(f"v({n}) {t / curve[1]:.2f}" for n, t in sorted(curve.items())))


if __name__ == "__main__":
    main()
