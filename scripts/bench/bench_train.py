"""Benchmark training throughput and peak memory per method on this machine (run by hand).

    python scripts/bench/bench_train.py --methods medusa1 medusa2 eagle1 eagle3 \
        --target smollm2 --prepared runs/default/prepared --steps 8 --max-tokens 2048
    python scripts/bench/bench_train.py --methods medusa1 eagle3 --target tiny \
        --arg eagle3:vocab_data={prepared}                                 # tiny random Llama, synthetic data
    python scripts/bench/bench_train.py --methods medusa1 medusa2 eagle1 eagle3 --target tiny \
        --arg eagle3:vocab_data={prepared} --num-processes 1 2 --max-seconds 30 --threads 1   # 1 -> 2 processes

    python scripts/bench/bench_train.py --methods eagle3 --target shape:llama-3.2-1b --max-tokens 8192 \
        --arg eagle3:vocab_data={prepared}      # a GPU: Llama-3.2-1B's shape with random weights, made on the GPU

By default a run does what the CLI does on this machine: the target on a GPU when there is one (``--device
auto``), in the CLI's precision (``--dtype auto``: bfloat16 on a GPU, the timed probe's choice on a CPU) and with its
mixed precision (``--mixed-precision auto``). ``--target shape:NAME`` builds a real model's shape with random weights
on the device (``specheads.targets.shapes``; no download). Besides tokens/s it reports the peak GPU memory and the
achieved TFLOP/s, counted as 2 * (the target's matrix FLOPs per token, ``forward_flops_per_token``) + 6 * (the
head's trainable parameters) * (its unrolled steps) per training token, and their share of the GPU's peak in the
precision trained (``hardware.peak_tflops``).
Each method runs in its own process (so peak RSS is that method's) through the real engine with
online features; the first ``--warmup`` steps are excluded from tokens/s. With ``--num-processes N``
(N > 1) the same run is started as ``accelerate launch --config_file <--launcher-config> --num_processes N``
(default conf/launcher/cpu_ddp.yaml without CUDA, conf/launcher/accelerate.yaml with it): every process
takes every N-th batch of the same size, so tokens/s counts the tokens of all processes and the
scaling column is tokens/s over the 1-process figure. Prints one JSON line per method and process
count and a table: training tokens/s (real, non-padding tokens, all processes) and peak RSS in MiB
of each process. Exit status 1 when a method's run failed (its error printed; the JSON report names it in
``failed``).
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
    p.add_argument("--target", default="smollm2",
                   help="'tiny' (random Llama), 'smollm2', a model folder, or shape:NAME (random weights of a real shape)")
    p.add_argument("--device", default="auto", help="where the target runs: auto (a GPU when present), cpu, cuda")
    p.add_argument("--dtype", default="auto", help="the target's dtype: auto (as the CLI), float32, bfloat16")
    p.add_argument("--mixed-precision", default="auto", help="train.mixed_precision: auto (as the CLI), no, bf16")
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
    p.add_argument("--json", default=None, help="write the results here (for specheads record: a train_bench entry)")
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


def load_bench_target(name: str, device: str = "auto", dtype: str = "auto"):
    from specheads.hardware import DTYPES, resolve_device

    if name == "tiny":
        sys.path.insert(0, str(REPO))
        from tests.conftest import make_tiny_target

        return make_tiny_target("llama", vocab=1000, hidden=64, layers=4)
    from specheads.targets import load_target
    from specheads.targets.shapes import is_shape, shape_target

    if is_shape(name):
        device = resolve_device(device)
        on_gpu = device.startswith("cuda")
        return shape_target(name, device, DTYPES["bfloat16" if dtype == "auto" and on_gpu else
                                                 "float32" if dtype == "auto" else dtype])
    return load_target(name, dtype=dtype, device=device)


def flops_per_token(target, method, trainable: int) -> float:
    """Training FLOPs per token: the target's forward (matrices) and the head's forward and backward, once per
    unrolled step (EAGLE's ``ttt_steps``, P-EAGLE's depths; one for every other head). A method that trains the
    target itself (Medusa-2, ``online_only``) also runs the target's backward (its activations' gradients: two
    forwards' worth; the adapters' weight gradients are among ``trainable``) and, with its KL term, the original
    target's forward: 3 or 4 target forwards a token."""
    from specheads.targets.shapes import forward_flops_per_token

    steps = getattr(method, "ttt_steps", None) or getattr(method, "num_depths", None) or 1
    if hasattr(method, "bind"):  # the feature spec of a head fed from the target's chosen layers needs its count
        method.bind(target)
    forwards = 1
    if method.feature_spec.online_only:
        forwards = 3 + (getattr(method, "target_loss", None) == "kl")
    return forwards * forward_flops_per_token(target.config) + 6.0 * trainable * steps


def run_one(args) -> dict:
    """Train ``args.one`` for warmup + steps (or warmup + ``--max-seconds``); tokens/s over the timed steps
    only. Under ``accelerate launch`` every process runs this; tokens are summed over the processes."""
    import torch

    from specheads.methods import build_method
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train

    from specheads.hardware import peak_tflops

    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_bench_target(args.target, args.device, args.dtype)
    source = _data(args)
    kwargs = method_kwargs(args.one, args.arg, args.prepared)
    cuda = target.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    precision = args.mixed_precision
    if precision == "auto":  # as `specheads train` resolves it (recipes/train.training_precision)
        from specheads.hardware import choose_mixed_precision, decoder_layer_shapes

        precision = choose_mixed_precision("auto", None if cuda else decoder_layer_shapes(target.config),
                                           probe=not cuda and int(os.environ.get("WORLD_SIZE", "1")) == 1).value
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp  # one folder for all processes: the timed run resumes the warm-up's checkpoint
        common = dict(output_dir=out, save_every=0, eval_every=0, wandb_mode="disabled", progress=False,
                      keep_checkpoints=1, mixed_precision=precision)
        warm = train(build_method(args.one, **kwargs), target, source, TrainConfig(max_steps=args.warmup, **common),
                     OptimConfig())
        budget = None if args.max_seconds is None else (warm["train_s"] + args.max_seconds) / 60
        steps = args.steps if args.max_seconds is None else max(args.steps, 10**6)
        full = train(build_method(args.one, **kwargs), target, source,
                     TrainConfig(max_steps=args.warmup + steps, max_minutes=budget, **common), OptimConfig())
    tokens = full["train_tokens"] - warm["train_tokens"]
    seconds = full["train_s"] - warm["train_s"]
    tflops = flops_per_token(target, build_method(args.one, **kwargs), full.get("trainable_params") or 0) \
        * tokens / seconds / 1e12
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_tflops(device, "bfloat16" if precision == "bf16" or target.dtype == torch.bfloat16 else "float32")
    return {"method": args.one, "target": args.target, "device": device, "target_dtype": str(target.dtype),
            "mixed_precision": precision, "steps": full["steps"] - warm["steps"], "tokens": tokens,
            "tokens_per_s": tokens / seconds, "seconds": seconds, "peak_rss_mib": full["peak_rss_mb"],
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
            "trainable_params": full.get("trainable_params"), "tflops": tflops,
            "share_of_peak": tflops / peak if peak else None,
            "threads": torch.get_num_threads(), "num_processes": full["num_processes"],
            "rank": int(os.environ.get("RANK", "0"))}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("BENCH " + json.dumps(run_one(args)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.prepared:
            vocab = 1000 if args.target == "tiny" else _vocab_size(args.target)  # shape:NAME: its config's
            args.prepared = str(write_synthetic(Path(tmp) / "prepared", vocab))
        results = [r for m in args.methods for n in args.num_processes if (r := _bench(m, n, args, Path(tmp)))]
    if args.json:
        write_report(args.json, args, results)
    failed = [f"{m} x{n}" for m in args.methods for n in args.num_processes
              if not any(r["method"] == m and r["num_processes"] == n for r in results)]
    base = {r["method"]: r["tokens_per_s"] for r in results if r["num_processes"] == 1}
    print(f"\n{'method':<10} {'procs':>5} {'tokens/s':>10} {'scaling':>8} {'TFLOP/s':>8} {'of peak':>8} "
          f"{'GPU MiB':>8} {'peak RSS MiB per process':>26}")
    for r in results:
        scale = f"{r['tokens_per_s'] / base[r['method']]:.2f}x" if r["method"] in base else "-"
        rss = " ".join(f"{x:.0f}" for x in r["peak_rss_mib_per_process"])
        share = f"{100 * r['share_of_peak']:.1f}%" if r.get("share_of_peak") else "-"
        gpu = f"{r['peak_gpu_mib']:.0f}" if r.get("peak_gpu_mib") else "-"
        print(f"{r['method']:<10} {r['num_processes']:>5} {r['tokens_per_s']:>10.0f} {scale:>8} {r['tflops']:>8.2f} "
              f"{share:>8} {gpu:>8} {rss:>26}")
    if failed:
        print(f"FAILED: {', '.join(failed)} (their errors above)")
        sys.exit(1)


def write_report(path: str, args, results: list[dict]) -> None:
    """The run's results as ``specheads record`` reads them (a ``train_bench`` entry of docs/benchmarks.json)."""
    import time

    from specheads.hardware import cpu_description

    device = results[0]["device"] if results else args.device
    report = {"kind": "train_bench", "target": args.target, "machine": cpu_description() if device == "cpu" else device,
              "max_tokens": args.max_tokens, "steps": args.steps, "methods": args.methods,
              "failed": [m for m in args.methods if not any(r["method"] == m for r in results)],
              "rows": results, "date": time.strftime("%Y-%m-%d")}
    Path(path).write_text(json.dumps(report, indent=1) + "\n")
    print(f"report in {path}")


def _vocab_size(target: str) -> int:
    from transformers import AutoConfig

    from specheads.targets import resolve_target_path
    from specheads.targets.shapes import is_shape, shape_config

    if is_shape(target):
        return shape_config(target).vocab_size
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
    one = [__file__, "--one", m, "--target", args.target, "--device", args.device, "--dtype", args.dtype,
           "--mixed-precision", args.mixed_precision, "--steps", str(args.steps), "--warmup", str(args.warmup),
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
