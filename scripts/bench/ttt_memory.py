"""Peak memory and time of one EAGLE-3 training-time-test step on a CPU: the fused unrolled attention vs the dense.

    python scripts/bench/ttt_memory.py                              # T = 1k..8k, 3 and 7 steps, both paths
    python scripts/bench/ttt_memory.py --tokens 16384 32768 --variants fused
    python scripts/bench/ttt_memory.py --mixed-precision bf16 --loss unroll

One row of ``--tokens`` tokens, forward and backward, through an EAGLE-3 head of SmolLM2-135M's shapes (hidden 576,
9 query and 3 key/value heads of 64, vocabulary 49152, a draft vocabulary of ``--draft-vocab``) with random weights,
on random features and target distributions. ``--loss ttt``: training's loss, ``methods.ttt.ttt_loss`` (the unroll
of ``methods.ttt.unroll``, every step's soft cross-entropy over the draft vocabulary: its labels gathered from the
target's rows a chunk at a time and its gradients made in the forward pass, ``losses.linear_soft_cross_entropy``,
where it once kept a (T, V) copy of the target rows per step); ``--loss unroll``: the unroll alone, each step's output against a random
(T, H) weight, which leaves the attention's share. ``fused`` is the default path (``models.ttt_attention``: no
T x T tensor); ``dense`` is ``layers.dense_unrolled_attention`` (one attention under a (T, steps * T) mask), forced
by patching ``ttt_attention.supported``. Each run is its own process: its peak RSS (``VmHWM``, reset once the head,
inputs and target distributions exist) above its RSS then, and the step's wall and CPU time (user + system: on a
shared machine the wall time counts the other processes too). The dense path is skipped above
``--dense-max-tokens`` (its mask alone is T * steps * T * 4 bytes). Prints one JSON line per run and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("fused", "dense")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="row lengths T")
    p.add_argument("--steps", type=int, nargs="+", default=[3, 7], help="training-time-test steps")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (EAGLE-3's default)")
    p.add_argument("--loss", default="ttt", choices=("ttt", "unroll"), help="training's loss or the unroll alone")
    p.add_argument("--mixed-precision", default="no", choices=("no", "bf16"), help="bf16: under torch.autocast")
    p.add_argument("--dense-max-tokens", type=int, default=8192, help="skip the dense path above this T")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one run here
    return p.parse_args(argv)


def _status_mib(field: str) -> float:
    """``VmRSS`` / ``VmHWM`` of this process in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _cpu_seconds() -> float:
    """User + system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux: ``5`` to ``/proc/self/clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _head(draft_vocab: int):
    """A random EAGLE-3 head of SmolLM2-135M's shapes and the target (three layers: only its embedding is read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specheads.models.eagle3 import Eagle3Config, Eagle3Model
    from specheads.targets.model import Target
    from specheads.targets.shapes import shape_config

    config = shape_config("smollm2-135m")
    config.num_hidden_layers = 3
    target = Target(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False),
                    None, name="shape:smollm2-135m")
    model = Eagle3Model(Eagle3Config.from_target(target, draft_vocab, aux_layers=[0, 1, 2])).attach(target)
    ids = torch.arange(draft_vocab)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.set_draft_vocab(ids - torch.arange(draft_vocab), t2d)
    return model, target


def _batch(model, T: int, steps: int):
    """(features (1, T, 3H), batch, TargetRows): random ids, features and target distributions, every row trained."""
    import torch

    from specheads.methods.ttt import TargetRows

    V, H = model.config.vocab_size, model.config.hidden_size
    ids = torch.randint(0, V, (1, T))
    batch = {"input_ids": ids, "loss_mask": torch.ones(1, T), "attention_mask": torch.ones(1, T)}
    need = torch.zeros(1, T, dtype=torch.bool)
    need[:, : T - 1] = True
    n = int(need.sum())
    probs = torch.softmax(torch.randn(n, model.config.draft_vocab_size), -1)
    argmax = torch.zeros(1, T, dtype=torch.long)
    argmax[need] = probs.argmax(-1)  # draft id = target id in this head's vocabulary
    row_of = torch.full((1, T), -1, dtype=torch.long)
    row_of[need] = torch.arange(n)
    rows = TargetRows(probs=probs, argmax=argmax, row_of=row_of, in_vocab=model.t2d[argmax] & need)
    return torch.randn(1, T, 3 * H), batch, rows


def run_one(args) -> dict:
    import contextlib

    import torch

    from specheads.methods.ttt import ttt_loss, unroll
    from specheads.models import ttt_attention

    variant, T, steps = args.one.split(":")
    T, steps = int(T), int(steps)
    if variant == "dense":
        ttt_attention.supported = lambda *a: False
    torch.manual_seed(0)
    model, _ = _head(args.draft_vocab)
    feats, batch, rows = _batch(model, T, steps)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.mixed_precision == "bf16"
                else contextlib.nullcontext())
    weight = torch.randn(1, T, model.config.hidden_size) / T
    base = _status_mib("VmRSS")
    _reset_peak()
    start, cpu = time.perf_counter(), _cpu_seconds()
    with autocast:
        if args.loss == "ttt":
            loss, _ = ttt_loss(model, model.fuse(feats), batch, rows, steps)
        else:
            outs = unroll(model, model.fuse(feats), batch["input_ids"], steps)
            loss = sum((weight * h.float()).sum() for _, h in outs)
    loss.backward()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    peak = _status_mib("VmHWM")
    return {"variant": variant, "tokens": T, "steps": steps, "loss_kind": args.loss,
            "mixed_precision": args.mixed_precision, "threads": torch.get_num_threads(),
            "loss": float(loss.detach()), "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
            "set_up_mib": round(base), "peak_above_set_up_mib": round(peak - base),
            "dense_mask_mib": round(T * steps * T * 4 / 2**20)}


def _measure(args, variant: str, T: int, steps: int) -> dict | None:
    cmd = [sys.executable, __file__, "--one", f"{variant}:{T}:{steps}", "--draft-vocab", str(args.draft_vocab),
           "--mixed-precision", args.mixed_precision, "--loss", args.loss]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{variant} T={T} steps={steps}: stopped after {args.timeout:.0f} s", file=sys.stderr)
        return None
    lines = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode or not lines:
        print(f"{variant} T={T} steps={steps}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}",
              file=sys.stderr)
        return None
    return lines[0]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("BENCH " + json.dumps(run_one(args)), flush=True)
        return
    results = []
    for steps in args.steps:
        for T in args.tokens:
            for variant in args.variants:
                if variant == "dense" and T > args.dense_max_tokens:
                    continue
                r = _measure(args, variant, T, steps)
                if r:
                    print(json.dumps(r), flush=True)
                    results.append(r)
    print(f"\n{'steps':>5} {'T':>6} {'variant':<7} {'seconds':>8} {'CPU s':>8} {'peak MiB above set-up':>22} "
          f"{'loss':>11}")
    for r in results:
        print(f"{r['steps']:>5} {r['tokens']:>6} {r['variant']:<7} {r['seconds']:>8.2f} {r['cpu_seconds']:>8.2f} "
              f"{r['peak_above_set_up_mib']:>22} {r['loss']:>11.4f}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
