"""Peak memory and time of one training step of one long row on a CPU, per method: the mask-free attention vs the dense.

    python scripts/bench/ttt_memory.py                              # EAGLE-3, T = 1k..8k, 3 and 7 steps, both paths
    python scripts/bench/ttt_memory.py --tokens 16384 32768 --variants fused
    python scripts/bench/ttt_memory.py --mixed-precision bf16 --loss unroll
    python scripts/bench/ttt_memory.py --method dflash peagle --tokens 1024 4096 --steps 4
    python scripts/bench/ttt_memory.py --method eagle3 dflash peagle --variants fused --json r.json

One row of ``--tokens`` tokens, forward and backward, through a head of SmolLM2-135M's shapes (hidden 576, 9 query
and 3 key/value heads of 64, vocabulary 49152) with random weights, on random features and target distributions:

* ``eagle3``: an EAGLE-3 head (draft vocabulary ``--draft-vocab``), ``--steps`` training-time-test steps.
  ``--loss ttt``: training's loss, ``methods.ttt.ttt_loss`` (the unroll of ``methods.ttt.unroll``, every step's soft
  cross-entropy over the draft vocabulary: its labels gathered from the target's rows a chunk at a time and its
  gradients made in the forward pass, ``losses.linear_soft_cross_entropy``, where it once kept a (T, V) copy of the
  target rows per step); ``--loss unroll``: the unroll alone, each step's output against a random (T, H) weight,
  which leaves the attention's share.
* ``dflash``: a one-layer DFlash head, ``methods.dflash.DFlashMethod.loss`` with ``--anchors`` blocks of
  ``--block-size`` per row (512 of 16 in the public recipes; fewer when the row has fewer positions) and the data's
  tokens as labels (the cross-entropy through the target's LM head). Its ``steps`` field is 1.
* ``peagle``: a one-layer P-EAGLE head, ``methods.peagle.PEagleMethod.loss`` with ``--steps`` read as its depths K
  (the packed row holds about T (1 + 0.7 + 0.49 + ...) entries).

``fused`` is the default path (``models.ttt_attention`` for EAGLE-3's unroll, ``models.ranged_attention`` for the
DFlash blocks and P-EAGLE's depths: no T x T tensor); ``dense`` is the masked attention they replaced (EAGLE-3: one
attention under a (T, steps * T) mask; DFlash: (blocks, T + blocks); P-EAGLE: (Q, Q) over the packed row), forced by
patching ``ttt_attention.supported``. Each run is its own process: its peak RSS (``VmHWM``, reset once the head,
inputs and target distributions exist) above its RSS then, and the step's wall and CPU time (user + system: on a
shared machine the wall time counts the other processes too). The dense path is skipped above
``--dense-max-tokens``. Prints one JSON line per run and a table; ``--json`` also writes the report that
``specheads record`` reads (kind ``long_row_bench``).
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
METHODS = ("eagle3", "dflash", "peagle")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", nargs="+", default=["eagle3"], choices=METHODS, help="the heads to train")
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="row lengths T")
    p.add_argument("--steps", type=int, nargs="+", default=[3, 7],
                   help="training-time-test steps (eagle3), depths K (peagle); dflash runs once")
    p.add_argument("--anchors", type=int, default=512, help="dflash: blocks per row")
    p.add_argument("--block-size", type=int, default=16, help="dflash: slots per block")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (EAGLE-3's default)")
    p.add_argument("--loss", default="ttt", choices=("ttt", "unroll"), help="training's loss or the unroll alone")
    p.add_argument("--mixed-precision", default="no", choices=("no", "bf16"), help="bf16: under torch.autocast")
    p.add_argument("--dense-max-tokens", type=int, default=8192, help="skip the dense path above this T")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is stopped")
    p.add_argument("--json", default=None, help="also write the report here (for specheads record)")
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


def _target():
    """A random target of SmolLM2-135M's shapes (three layers: only its embedding, norm and LM head are read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specheads.targets.model import Target
    from specheads.targets.shapes import shape_config

    config = shape_config("smollm2-135m")
    config.num_hidden_layers = 3
    return Target(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False),
                  None, name="shape:smollm2-135m")


def _head(method: str, target, args, steps: int):
    """A random head of ``method`` for ``target`` (draft vocabulary: its first ``--draft-vocab`` ids)."""
    import torch

    from specheads.models.dflash import DFlashConfig, DFlashModel
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model
    from specheads.models.peagle import PEagleConfig, PEagleModel

    if method == "dflash":
        return DFlashModel(DFlashConfig.from_target(target, 1, args.block_size, [0, 1, 2])).attach(target)
    dv = args.draft_vocab
    if method == "peagle":
        model = PEagleModel(PEagleConfig.from_target(target, dv, [0, 1, 2], num_depths=steps)).attach(target)
        torch.nn.init.normal_(model.mask_hidden, std=0.02)
    else:
        model = Eagle3Model(Eagle3Config.from_target(target, dv, aux_layers=[0, 1, 2])).attach(target)
    ids = torch.arange(dv)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.set_draft_vocab(ids - torch.arange(dv), t2d)
    return model


def _batch(model, target, T: int):
    """(features (1, T, 3H), batch with them and the last layer's states, TargetRows): random ids, features and
    target distributions, every row trained."""
    import torch

    from specheads.methods.ttt import TargetRows

    V, H = target.vocab_size, target.hidden_size
    ids = torch.randint(0, V, (1, T))
    feats = torch.randn(1, T, 3 * H)
    batch = {"input_ids": ids, "loss_mask": torch.ones(1, T), "attention_mask": torch.ones(1, T),
             "hidden_aux": feats, "hidden_last": torch.randn(1, T, H)}
    if not hasattr(model, "t2d"):
        return feats, batch, None
    need = torch.zeros(1, T, dtype=torch.bool)
    need[:, : T - 1] = True
    n = int(need.sum())
    probs = torch.softmax(torch.randn(n, model.config.draft_vocab_size), -1)
    argmax = torch.zeros(1, T, dtype=torch.long)
    argmax[need] = probs.argmax(-1)  # draft id = target id in this head's vocabulary
    row_of = torch.full((1, T), -1, dtype=torch.long)
    row_of[need] = torch.arange(n)
    rows = TargetRows(probs=probs, argmax=argmax, row_of=row_of, in_vocab=model.t2d[argmax] & need)
    return feats, batch, rows


def _step_loss(method: str, model, target, feats, batch, rows, steps: int, args, weight):
    """The loss of one training step (its backward is timed with it)."""
    from specheads.methods.dflash import DFlashMethod
    from specheads.methods.peagle import PEagleMethod
    from specheads.methods.ttt import ttt_loss, unroll

    if method == "dflash":
        train = DFlashMethod(num_layers=1, block_size=args.block_size, anchors=args.anchors, labels="data")
        return train.loss(model, batch, target).loss
    if method == "peagle":
        return PEagleMethod(num_depths=steps, draft_vocab_size=args.draft_vocab).loss(model, batch, target).loss
    if args.loss == "ttt":
        return ttt_loss(model, model.fuse(feats), batch, rows, steps)[0]
    outs = unroll(model, model.fuse(feats), batch["input_ids"], steps)
    return sum((weight * h.float()).sum() for _, h in outs)


def run_one(args) -> dict:
    import contextlib

    import torch

    from specheads.models import ttt_attention

    method, variant, T, steps = args.one.split(":")
    T, steps = int(T), int(steps)
    if variant == "dense":
        ttt_attention.supported = lambda *a: False
    torch.manual_seed(0)
    target = _target()
    model = _head(method, target, args, steps)
    feats, batch, rows = _batch(model, target, T)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.mixed_precision == "bf16"
                else contextlib.nullcontext())
    weight = torch.randn(1, T, model.config.hidden_size) / T
    base = _status_mib("VmRSS")
    _reset_peak()
    start, cpu = time.perf_counter(), _cpu_seconds()
    with autocast:
        loss = _step_loss(method, model, target, feats, batch, rows, steps, args, weight)
    loss.backward()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    peak = _status_mib("VmHWM")
    row = {"method": method, "variant": variant, "tokens": T, "steps": steps,
           "loss_kind": args.loss if method == "eagle3" else "train", "mixed_precision": args.mixed_precision,
           "threads": torch.get_num_threads(), "loss": float(loss.detach()), "seconds": round(seconds, 2),
           "cpu_seconds": round(cpu, 2), "set_up_mib": round(base), "peak_above_set_up_mib": round(peak - base)}
    if method == "eagle3":
        row["dense_mask_mib"] = round(T * steps * T * 4 / 2**20)
    elif method == "dflash":
        row["anchors"], row["block_size"] = min(args.anchors, T - 2), args.block_size
    return row


def _measure(args, method: str, variant: str, T: int, steps: int) -> dict | None:
    cmd = [sys.executable, __file__, "--one", f"{method}:{variant}:{T}:{steps}", "--draft-vocab", str(args.draft_vocab),
           "--mixed-precision", args.mixed_precision, "--loss", args.loss, "--anchors", str(args.anchors),
           "--block-size", str(args.block_size)]
    name = f"{method} {variant} T={T} steps={steps}"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: stopped after {args.timeout:.0f} s", file=sys.stderr)
        return None
    lines = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode or not lines:
        print(f"{name}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return lines[0]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("BENCH " + json.dumps(run_one(args)), flush=True)
        return
    results = []
    for method in args.method:
        for steps in [1] if method == "dflash" else args.steps:
            for T in args.tokens:
                for variant in args.variants:
                    if variant == "dense" and T > args.dense_max_tokens:
                        continue
                    r = _measure(args, method, variant, T, steps)
                    if r:
                        print(json.dumps(r), flush=True)
                        results.append(r)
    print(f"\n{'method':<7} {'steps':>5} {'T':>6} {'variant':<7} {'seconds':>8} {'CPU s':>8} "
          f"{'peak MiB above set-up':>22} {'loss':>11}")
    for r in results:
        print(f"{r['method']:<7} {r['steps']:>5} {r['tokens']:>6} {r['variant']:<7} {r['seconds']:>8.2f} "
              f"{r['cpu_seconds']:>8.2f} {r['peak_above_set_up_mib']:>22} {r['loss']:>11.4f}")
    if args.json:
        report = {"kind": "long_row_bench", "target": "shape:smollm2-135m",
                  "dtype": "float32" if args.mixed_precision == "no" else "bf16 autocast",
                  "threads": results[0]["threads"] if results else None,
                  "run": "scripts/bench/ttt_memory.py " + " ".join(sys.argv[1:]), "rows": results}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
