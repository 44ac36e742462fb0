"""Peak memory and time of Medusa-1's head loss, forward and backward: whole logits vs ``linear_cross_entropy``.

    python scripts/bench/bench_linear_ce.py                  # Llama 3's shape: hidden 2048, vocab 128256, 4096 tokens
    python scripts/bench/bench_linear_ce.py --device cuda --heads 5 --mixed-precision bf16

``whole`` is the loss as ``head_losses`` computed it before: each head's (N, V) float32 logits, then
``F.cross_entropy``; ``chunked`` is ``specheads.methods.medusa.head_losses`` itself (``linear_cross_entropy``).
Heads are random ``MedusaHeads`` (float32, output layers trained, as ``method=medusa1``) on random features of one
sequence of ``--tokens`` + heads + 1 tokens, every label counted. Each variant runs in its own process: on a CPU its
peak is the process's peak RSS (``ru_maxrss``) above its RSS once the heads and inputs exist; on a GPU
``max_memory_allocated`` above what was allocated then, measured on a second step. Both include the output layers'
weight gradients (V x H float32 per head), which every variant allocates. Prints one JSON line per variant and a
table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

VARIANTS = ("whole", "chunked")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048, help="hidden size H (Llama-3.2-1B's)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size V (Llama 3's)")
    p.add_argument("--tokens", type=int, default=4096, help="labels per head N")
    p.add_argument("--heads", type=int, default=1, help="Medusa heads K (the whole variant holds K (N, V) logits)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--mixed-precision", default="no", choices=("no", "bf16"), help="bf16: under torch.autocast")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one variant here
    return p.parse_args(argv)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def whole_head_losses(heads, hidden, input_ids, labels_ok, decay):
    """``head_losses`` as it was: each head's whole (N, V) float32 logits, then ``F.cross_entropy``."""
    import torch.nn.functional as F

    T, total = input_ids.shape[1], 0.0
    for k in range(heads.num_heads):
        s = k + 2
        ok = labels_ok[:, s:]
        h, y = hidden[:, : T - s][ok], input_ids[:, s:][ok]
        logits = heads.head_logits(h, k).float()
        loss = F.cross_entropy(logits, y, reduction="sum") / max(1, y.numel())
        logits.detach().argmax(-1)  # the accuracy's argmax, as head_losses takes it
        total = total + decay ** k * loss
    return total


def run_one(args) -> dict:
    import contextlib

    import torch

    from specheads.methods.medusa import head_losses
    from specheads.models.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    dev = torch.device(args.device)
    config = MedusaConfig(hidden_size=args.hidden, vocab_size=args.vocab, num_heads=args.heads)
    heads = MedusaHeads(config).to(dev)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(0, 0.02)
    T = args.tokens + args.heads + 1  # head k gets T - k - 2 >= tokens labels
    hidden = torch.randn(1, T, args.hidden, device=dev)
    ids = torch.randint(0, args.vocab, (1, T), device=dev)
    ok = torch.ones(1, T, dtype=torch.bool, device=dev)
    loss_fn = whole_head_losses if args.one == "whole" else (lambda *a: head_losses(*a)[0])
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.mixed_precision == "bf16"
                else contextlib.nullcontext())

    def step() -> tuple[float, float]:
        heads.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = loss_fn(heads, hidden, ids, ok, 0.8)
        loss.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach()), time.perf_counter() - start

    if dev.type == "cuda":
        step()  # warm-up: kernels and the allocator's first blocks
        heads.zero_grad(set_to_none=True)
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
        loss, seconds = step()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        base = _rss_mib()
        loss, seconds = step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": args.one, "device": args.device, "mixed_precision": args.mixed_precision,
            "hidden": args.hidden, "vocab": args.vocab, "tokens": args.tokens, "heads": args.heads,
            "loss": loss, "seconds": round(seconds, 3), "set_up_mib": round(base), "peak_mib": round(peak),
            "peak_above_set_up_mib": round(peak - base),
            "one_logits_tensor_mib": round(args.tokens * args.vocab * 4 / 2**20)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("BENCH " + json.dumps(run_one(args)), flush=True)
        return
    results = []
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--one", variant, "--hidden", str(args.hidden), "--vocab", str(args.vocab),
               "--tokens", str(args.tokens), "--heads", str(args.heads), "--device", args.device,
               "--mixed-precision", args.mixed_precision]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
        if proc.returncode or not lines:
            print(f"{variant}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        print(json.dumps(lines[0]), flush=True)
        results.append(lines[0])
    print(f"\n{'variant':<8} {'loss':>10} {'seconds':>8} {'peak MiB':>9} {'above set-up MiB':>17}")
    for r in results:
        print(f"{r['variant']:<8} {r['loss']:>10.4f} {r['seconds']:>8.2f} {r['peak_mib']:>9} "
              f"{r['peak_above_set_up_mib']:>17}")


if __name__ == "__main__":
    main()
