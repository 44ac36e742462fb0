"""Peak memory of a collection (``data.features.collect_hidden_states``) with short rows against long ones.

    python scripts/bench/collect_memory.py                                  # 2k vs 32k-token rows, 64k tokens each
    python scripts/bench/collect_memory.py --rows 2048 16384 32768 --hidden 512 --total 131072

A tiny random Qwen3-style target (``--hidden`` wide, ``--layers`` layers, a 65,536-token context, SDPA attention,
float32) and rows of ``--rows`` tokens each, as many as make ``--total`` tokens, collected for EAGLE-3 (three fused
layers and the last state) into a bfloat16 store with the stage's default shard and batch sizes. Each run is its
own process: its peak RSS (``VmHWM``, reset once the target and the rows exist) above its RSS then, and the wall
time. Prints one JSON line per run and a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[2048, 32768], help="tokens per row")
    p.add_argument("--total", type=int, default=65536, help="tokens collected per run")
    p.add_argument("--hidden", type=int, default=64, help="the target's hidden size")
    p.add_argument("--layers", type=int, default=4, help="the target's decoder layers")
    p.add_argument("--batch-tokens", type=int, default=8192, help="collect.batch_tokens")
    p.add_argument("--shard-bytes", type=int, default=512 * 2**20, help="collect.shard_bytes")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: this row length
    return p.parse_args(argv)


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(args: argparse.Namespace, row: int) -> dict:
    import datasets
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specheads.data.features import CollectOptions, collect_hidden_states, spec_for_method
    from specheads.targets import Target

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                  num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=args.hidden // 4, max_position_embeddings=65536)
    config._attn_implementation = "sdpa"
    target = Target(AutoModelForCausalLM.from_config(config).eval().requires_grad_(False), None, name="tiny-qwen3")
    n = max(1, args.total // row)
    g = torch.Generator().manual_seed(1)
    data = datasets.Dataset.from_dict({
        "id": [f"r{i}" for i in range(n)],
        "input_ids": [torch.randint(0, 512, (row,), generator=g).tolist() for _ in range(n)],
        "loss_mask": [[0] * (row // 4) + [1] * (row - row // 4) for _ in range(n)]})
    spec = spec_for_method("eagle3", args.layers)
    opts = CollectOptions(dtype="bfloat16", shard_bytes=args.shard_bytes, batch_tokens=args.batch_tokens,
                          progress=False, estimate_time=False)
    with tempfile.TemporaryDirectory() as out:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the RSS now
        start = _kib("VmRSS")
        t0 = time.perf_counter()
        summary = collect_hidden_states(target, data, spec, Path(out) / "store", opts)
        seconds = time.perf_counter() - t0
    return {"row_tokens": row, "rows": n, "tokens": summary["tokens"], "hidden": args.hidden,
            "shards": summary["shards_written"], "peak_above_start_mib": round((_kib("VmHWM") - start) / 1024, 1),
            "start_mib": round(start / 1024, 1), "seconds": round(seconds, 1)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args, args.one)))
        return
    results = []
    for row in args.rows:
        cmd = [sys.executable, __file__, "--one", str(row), "--total", str(args.total), "--hidden", str(args.hidden),
               "--layers", str(args.layers), "--batch-tokens", str(args.batch_tokens),
               "--shard-bytes", str(args.shard_bytes)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print("| row tokens | rows | hidden | peak above start | start | time |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['row_tokens']} | {r['rows']} | {r['hidden']} | {r['peak_above_start_mib']} MiB | "
              f"{r['start_mib']} MiB | {r['seconds']} s |")


if __name__ == "__main__":
    main()
