"""Benchmark training throughput and peak memory per method on this machine (run by hand).

    python scripts/bench_train.py --methods medusa1 medusa2 eagle1 eagle3 \
        --target smollm2 --prepared runs/default/prepared --steps 8 --max-tokens 2048
    python scripts/bench_train.py --methods medusa1 eagle3 --target tiny \
        --arg eagle3:vocab_data={prepared}                                 # tiny random Llama, synthetic data

Each method runs in its own process (so peak RSS is that method's) through the real engine with
online features; the first ``--warmup`` steps are excluded from tokens/s. Prints one JSON line per
method and a table: training tokens/s (real, non-padding tokens) and peak RSS in MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one method here
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
    """Train ``args.one`` for warmup + steps; tokens/s over the timed steps only."""
    import torch

    from specheads.methods import build_method
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train

    if args.threads:
        torch.set_num_threads(args.threads)
    target = _load_target(args.target)
    source = _data(args)
    kwargs = method_kwargs(args.one, args.arg, args.prepared)
    with tempfile.TemporaryDirectory() as out:
        common = dict(output_dir=out, save_every=0, eval_every=0, wandb_mode="disabled", progress=False,
                      keep_checkpoints=1)
        warm = train(build_method(args.one, **kwargs), target, source, TrainConfig(max_steps=args.warmup, **common),
                     OptimConfig())
        full = train(build_method(args.one, **kwargs), target, source, TrainConfig(max_steps=args.warmup + args.steps, **common),
                     OptimConfig())
    tokens = full["train_tokens"] - warm["train_tokens"]
    seconds = full["train_s"] - warm["train_s"]
    return {"method": args.one, "target": args.target, "steps": args.steps, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "peak_rss_mib": full["peak_rss_mb"], "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("BENCH " + json.dumps(run_one(args)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.prepared:
            vocab = 1000 if args.target == "tiny" else _vocab_size(args.target)
            args.prepared = str(write_synthetic(Path(tmp) / "prepared", vocab))
        results = [r for m in args.methods if (r := _bench(m, args))]
    print(f"\n{'method':<10} {'tokens/s':>10} {'peak RSS MiB':>13}")
    for r in results:
        print(f"{r['method']:<10} {r['tokens_per_s']:>10.0f} {r['peak_rss_mib']:>13.0f}")


def _vocab_size(target: str) -> int:
    from transformers import AutoConfig

    from specheads.targets import resolve_target_path

    return AutoConfig.from_pretrained(resolve_target_path(target)).vocab_size


def _bench(m: str, args) -> dict | None:
    """Run one method in a fresh process; its JSON result, or None (with the error) on failure."""
    cmd = [sys.executable, __file__, "--one", m, "--target", args.target, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--max-tokens", str(args.max_tokens)]
    cmd += ["--prepared", args.prepared] + [f"--arg={a}" for a in args.arg]
    cmd += ["--threads", str(args.threads)] if args.threads else []
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode or not line:
        print(f"{m}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    result = json.loads(line[-1][6:])
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
