"""Benchmark training throughput and peak memory per method on this machine (run by hand).

    python scripts/bench/bench_train.py --methods medusa1 medusa2 eagle1 eagle3 \
        --target smollm2 --prepared runs/default/prepared --steps 8 --max-tokens 2048
    python scripts/bench/bench_train.py --methods medusa1 eagle3 --target tiny \
        --arg eagle3:vocab_data={prepared}                                 # tiny random Llama, synthetic data
    python scripts/bench/bench_train.py --methods medusa1 medusa2 eagle1 eagle3 --target tiny \
        --arg eagle3:vocab_data={prepared} --num-processes 1 2 --max-seconds 30 --threads 1   # 1 -> 2 processes

Each method runs in its own process (so peak RSS is that method's) through the real engine with
online features; the first ``--warmup`` steps are excluded from tokens/s. With ``--num-processes N``
(N > 1) the same run is started as ``accelerate launch --config_file <--launcher-config> --num_processes N``
(default conf/launcher/cpu_ddp.yaml without CUDA, conf/launcher/accelerate.yaml with it): every process
takes every N-th batch of the same size, so tokens/s counts the tokens of all processes and the
scaling column is tokens/s over the 1-process figure. Prints one JSON line per method and process
count and a table: training tokens/s (real, non-padding tokens, all processes) and peak RSS in MiB
of each process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["medusa1"], help="registered method names (engine.METHODS)")
    p.add_argument("--target", default="smollm2", help="'tiny' (random Llama), 'smollm2', or a model folder")
    p.add_argument("--prepared", default=None, help="prepared dataset folder (default: synthetic tokens, written once)")
    p.add_argument("--arg", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="a constructor argument for one method; {prepared} becomes the data folder")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps measured after the warm-up")
    p.add_argument("--warmup", type=int, default=2, help="steps run first and not timed")
    p.add_argument("--max-tokens", type=int, default=2048, help="padded tokens per micro-batch")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's choice)")
    p.add_argument("--num-processes", type=int, nargs="+", default=[1], metavar="N",
                   help="process counts to measure each method at (N > 1: accelerate launch)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="time budget of the timed part (then --steps is only a cap)")
    p.add_argument("--launcher-config", default=None,
                   help="accelerate config for N > 1 (default: conf/launcher/cpu_ddp.yaml, or accelerate.yaml with CUDA)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one method here
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # internal: run folder shared by the processes
    return p.parse_args(argv)


def _data(args):
    from specheads.data.features import TokenDataset
    from specheads.data.prepare import load_prepared
    from specheads.training.batches import DatasetBatches

    rows, _ = load_prepared(args.prepared)
    return DatasetBatches(TokenDataset(rows), max_tokens=args.max_tokens, seed=0)


def write_synthetic(out: Path, vocab: int) -> Path:
    """64 random sequences of 256 tokens (all labels counted) as a prepared folder."""
    import torch

    from specheads.data.prepare import write_prepared

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (64, 256), generator=g).tolist()
    rows = {"id": [str(i) for i in range(64)], "input_ids": ids, "loss_mask": [[1] * 256] * 64,
            "domain": ["synthetic"] * 64}
    write_prepared(rows, {"target": "synthetic", "tokenizer_fingerprint": "none", "max_length": 256}, out)
    return out


def method_kwargs(method: str, pairs: list[str], prepared: str) -> dict:
    """``METHOD:KEY=VALUE`` pairs for ``method`` -> kwargs (values parsed as JSON when they parse)."""
    out = {}
    for pair in pairs:
        name, _, kv = pair.partition(":")
        key, eq, value = kv.partition("=")
        if not eq:
            raise SystemExit(f"--arg {pair!r}: expected METHOD:KEY=VALUE")
        if name == method:
            value = value.replace("{prepared}", prepared)
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError:
                out[key] = value
    return out


def _load_target(name: str):
    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from conftest import make_tiny_target

        return make_tiny_target("llama", vocab=1000, hidden=64, layers=4)
    from specheads.targets import load_target

    return load_target(name)


def run_one(args) -> dict:
    """Train ``args.one`` for warmup + steps (or warmup + ``--max-seconds``); tokens/s over the timed steps
    only. Under ``accelerate launch`` every process runs this; tokens are summed over the processes."""
    import torch

    from specheads.methods import build_method
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train

    if args.threads:
        torch.set_num_threads(args.threads)
    target = _load_target(args.target)
    source = _data(args)
    kwargs = method_kwargs(args.one, args.arg, args.prepared)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp  # one folder for all processes: the timed run resumes the warm-up's checkpoint
        common = dict(output_dir=out, save_every=0, eval_every=0, wandb_mode="disabled", progress=False,
                      keep_checkpoints=1)
        warm = train(build_method(args.one, **kwargs), target, source, TrainConfig(max_steps=args.warmup, **common),
                     OptimConfig())
        budget = None if args.max_seconds is None else (warm["train_s"] + args.max_seconds) / 60
        steps = args.steps if args.max_seconds is None else max(args.steps, 10**6)
        full = train(build_method(args.one, **kwargs), target, source,
                     TrainConfig(max_steps=args.warmup + steps, max_minutes=budget, **common), OptimConfig())
    tokens = full["train_tokens"] - warm["train_tokens"]
    seconds = full["train_s"] - warm["train_s"]
    return {"method": args.one, "target": args.target, "steps": full["steps"] - warm["steps"], "tokens": tokens,
            "tokens_per_s": tokens / seconds, "seconds": seconds, "peak_rss_mib": full["peak_rss_mb"],
            "threads": torch.get_num_threads(), "num_processes": full["num_processes"],
            "rank": int(os.environ.get("RANK", "0"))}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("BENCH " + json.dumps(run_one(args)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.prepared:
            vocab = 1000 if args.target == "tiny" else _vocab_size(args.target)
            args.prepared = str(write_synthetic(Path(tmp) / "prepared", vocab))
        results = [r for m in args.methods for n in args.num_processes if (r := _bench(m, n, args, Path(tmp)))]
    base = {r["method"]: r["tokens_per_s"] for r in results if r["num_processes"] == 1}
    print(f"\n{'method':<10} {'procs':>5} {'tokens/s':>10} {'scaling':>8} {'peak RSS MiB per process':>26}")
    for r in results:
        scale = f"{r['tokens_per_s'] / base[r['method']]:.2f}x" if r["method"] in base else "-"
        rss = " ".join(f"{x:.0f}" for x in r["peak_rss_mib_per_process"])
        print(f"{r['method']:<10} {r['num_processes']:>5} {r['tokens_per_s']:>10.0f} {scale:>8} {rss:>26}")


def _vocab_size(target: str) -> int:
    from transformers import AutoConfig

    from specheads.targets import resolve_target_path

    return AutoConfig.from_pretrained(resolve_target_path(target)).vocab_size


def _launcher_config(args) -> str:
    if args.launcher_config:
        return args.launcher_config
    import torch

    return str(REPO / "conf" / "launcher" / ("accelerate.yaml" if torch.cuda.is_available() else "cpu_ddp.yaml"))


def _bench(m: str, n: int, args, tmp: Path) -> dict | None:
    """Run one method on ``n`` fresh processes; rank 0's JSON result plus every process's peak RSS, or None
    (with the error) on failure."""
    out = tmp / f"run-{m}-{n}"
    one = [__file__, "--one", m, "--target", args.target, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--max-tokens", str(args.max_tokens), "--prepared", args.prepared, "--out", str(out)]
    one += [f"--arg={a}" for a in args.arg]
    one += ["--threads", str(args.threads)] if args.threads else []
    one += ["--max-seconds", str(args.max_seconds)] if args.max_seconds is not None else []
    if n == 1:
        cmd = [sys.executable] + one
    else:
        exe = Path(sys.executable).with_name("accelerate")
        head = [str(exe), "launch"] if exe.exists() else [sys.executable, "-m", "accelerate.commands.launch"]
        cmd = head + ["--config_file", _launcher_config(args), "--num_processes", str(n)] + one
    env = {**os.environ, "WANDB_MODE": "disabled", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode or len(lines) != n:
        print(f"{m} x{n}: failed (exit {proc.returncode}, {len(lines)} of {n} results)\n{proc.stderr[-2000:]}",
              file=sys.stderr)
        return None
    lines.sort(key=lambda r: r["rank"])
    result = dict(lines[0], peak_rss_mib_per_process=[r["peak_rss_mib"] for r in lines])
    if result["num_processes"] != n:
        print(f"{m} x{n}: the engine saw {result['num_processes']} processes", file=sys.stderr)
        return None
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
