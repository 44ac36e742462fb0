"""How long a checkpoint of large Medusa-1 heads stalls training: written synchronously vs in the background.

    python scripts/bench/bench_checkpoint.py                          # one head at Llama 3's shape: ~3 GiB of state
    python scripts/bench/bench_checkpoint.py --heads 5 --device cuda  # five heads, Medusa-1's default, ~15 GiB of state

Medusa-1 heads (``MedusaHeads``, float32, output layers trained, as ``method=medusa1``; hidden ``--hidden``, vocabulary
``--vocab``, random weights, nothing downloaded) train under Accelerate with AdamW and a registered scheduler, on
``--tokens`` random features per step. After a few steps (Adam's state allocated, the step time measured) the run
saves ``--saves`` checkpoints through ``specheads.training.checkpoint.Checkpointer``, the engine's writer, once per
mode in its own process: ``never`` (``train.async_checkpoint=never``: training waits for the whole write) and
``always`` (training waits only while the state is copied to CPU memory; it trains on while a thread writes).

Per save: ``stall_s``, how long ``save`` blocked the training loop; ``write_s``, from the save's start until the
checkpoint was published (renamed, pruned); the training steps finished meanwhile and their mean time beside the
steps' before (the writer shares the CPU cores and the memory bandwidth). ``state_gib`` is what a checkpoint holds
(weights + Adam's two moments), ``peak_rss_gib`` the process's peak (the background copy adds ``state_gib`` while a
write is in flight). Checkpoints go to ``--dir`` (a temporary folder by default, removed at the end). Prints one
JSON line per mode and a table.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODES = ("never", "always")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048, help="hidden size H (Llama-3.2-1B's)")
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size V (Llama 3's)")
    p.add_argument("--heads", type=int, default=1, help="Medusa heads K, each with its own H x V output layer "
                                                        "(5: Medusa-1's default, ~15 GiB of state)")
    p.add_argument("--tokens", type=int, default=64, help="random features per training step")
    p.add_argument("--steps", type=int, default=3, help="timed training steps before the first save")
    p.add_argument("--saves", type=int, default=2, help="checkpoints per mode (a GPU's first also pins its buffers)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder, removed after)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one mode here
    return p.parse_args(argv)


def _gib(nbytes: float) -> float:
    return round(nbytes / 2**30, 2)


def _build(args):
    import torch
    from accelerate import Accelerator

    from specheads.methods.medusa import head_losses
    from specheads.models.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    acc = Accelerator(cpu=args.device == "cpu")
    heads = MedusaHeads(MedusaConfig(hidden_size=args.hidden, vocab_size=args.vocab, num_heads=args.heads))
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    heads, opt = acc.prepare(heads, opt)
    acc.register_for_checkpointing(sched)
    T = args.tokens + args.heads + 1  # head k sees T - k - 2 >= tokens labels
    hidden = torch.randn(1, T, args.hidden, device=acc.device)
    ids = torch.randint(0, args.vocab, (1, T), device=acc.device)
    ok = torch.ones(1, T, dtype=torch.bool, device=acc.device)

    def step() -> float:
        start = time.perf_counter()
        loss = head_losses(heads, hidden, ids, ok, 0.8)[0]
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if acc.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    state = sum(p.numel() * p.element_size() * 3 for p in heads.parameters())  # weights + exp_avg + exp_avg_sq
    return acc, step, state


def run_one(args, root: Path) -> dict:
    from specheads.training.checkpoint import Checkpointer

    acc, step, state = _build(args)
    step()  # Adam's state allocated
    before = [step() for _ in range(args.steps)]
    saver = Checkpointer(acc, root, keep=1, mode=args.one)
    saves, n = [], 1 + args.steps
    for _ in range(args.saves):
        start = time.perf_counter()
        saver.save(n, {})
        stall = time.perf_counter() - start
        done = {}
        if saver._thread is not None:  # a watcher notes when the writer ends, to the millisecond
            writer = saver._thread
            watcher = threading.Thread(target=lambda: (writer.join(), done.setdefault("t", time.perf_counter())))
            watcher.start()
        during = []
        while saver._thread is not None and saver._thread.is_alive():
            during.append(step())
            n += 1
        saver.wait()
        write = done.get("t", start + stall) - start
        saves.append({"stall_s": round(stall, 3), "write_s": round(write, 3), "steps_during_write": len(during),
                      "step_s_during_write": round(sum(during) / len(during), 3) if during else None})
        step()
        n += 1
    return {"mode": args.one, "device": args.device, "hidden": args.hidden, "vocab": args.vocab, "heads": args.heads,
            "tokens": args.tokens, "state_gib": _gib(state), "step_s": round(sum(before) / len(before), 3),
            "saves": saves, "peak_rss_gib": _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("BENCH " + json.dumps(run_one(args, Path(args.dir))), flush=True)
        return
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_checkpoint_"))
    results = []
    try:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--one", mode, "--dir", str(base / mode), "--hidden", str(args.hidden),
                   "--vocab", str(args.vocab), "--heads", str(args.heads), "--tokens", str(args.tokens),
                   "--steps", str(args.steps), "--saves", str(args.saves), "--device", args.device]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
            shutil.rmtree(base / mode, ignore_errors=True)  # free the disk before the next mode
            if proc.returncode or not lines:
                print(f"{mode}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            print(json.dumps(lines[0]), flush=True)
            results.append(lines[0])
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n{'async':<7} {'save':>4} {'state GiB':>9} {'stall s':>8} {'write s':>8} {'steps meanwhile':>15} "
          f"{'step s (before / meanwhile)':>28} {'peak RSS GiB':>12}")
    for r in results:
        for i, s in enumerate(r["saves"], 1):
            meanwhile = f"{r['step_s']:.3f} / {s['step_s_during_write']:.3f}" if s["step_s_during_write"] else \
                f"{r['step_s']:.3f} / -"
            print(f"{r['mode']:<7} {i:>4} {r['state_gib']:>9} {s['stall_s']:>8.2f} {s['write_s']:>8.2f} "
                  f"{s['steps_during_write']:>15} {meanwhile:>28} {r['peak_rss_gib']:>12}")


if __name__ == "__main__":
    main()
