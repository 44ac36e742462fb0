"""Collection and regeneration by both backends on the same rows: the Hugging Face forward here and vLLM.

    python scripts/bench/bench_backends.py --work /tmp/backends --samples 200 --max-length 512 \
        --regen-samples 64 --max-new-tokens 256 --json backends.json
    specheads record backends.json --checkout . --into docs/benchmarks.json

Each measurement is a ``specheads`` command as a user runs it, in its own process (the engine's processes
included), with the target's dtype ``--dtype`` (``auto``: vLLM takes bfloat16 on a CPU with bfloat16 kernels, the
transformers forward what a timed probe finds faster, which a noisy machine can tip either way):

1. collection of one prepared set (``--samples`` chats cut at ``--max-length``) into an EAGLE-3 store, with
   ``engine=hf`` and with ``engine=vllm`` (no time budget, ``captured=false``);
2. regeneration of ``--regen-samples`` chats' answers (greedy, up to ``--max-new-tokens``) with the transformers
   loop (``regenerate=greedy``) and with vLLM, states captured in the same pass (``regenerate=engine``), then the
   collection that reads them.

For each: wall seconds of the command (start-up included), the stage's own tokens/s where it reports one,
and the peak resident memory of the command's whole process tree (sampled every 0.2 s). Prints a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WROTE = re.compile(r"wrote \d+ shards \((\d+) tokens\) in ([\d.]+) s \((\d+) tokens/s\)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="a folder for the prepared data and stores (emptied first)")
    p.add_argument("--samples", type=int, default=200, help="chats prepared for the collection comparison")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--regen-samples", type=int, default=64, help="chats whose answers are regenerated")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--dtype", default="auto", help="target.dtype of every stage (auto: each backend's own choice; "
                   "a timed probe picks the transformers forward's)")
    p.add_argument("--json", help="also write the report here")
    return p.parse_args(argv)


def measured(cmd: list[str], log_path: Path) -> dict:
    """Run ``cmd``; its wall seconds, peak resident memory of its process tree (GB) and its output's text."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    t = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)
        peak = [0]
        done = threading.Event()

        def sample():
            root = psutil.Process(proc.pid)
            while not done.is_set():
                try:
                    rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                    peak[0] = max(peak[0], rss)
                except psutil.Error:
                    pass
                done.wait(0.2)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        code = proc.wait()
        done.set()
        watcher.join()
    wall = time.perf_counter() - t
    text = log_path.read_text()
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}); its log: {log_path}\n{text[-2000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(peak[0] / 2 ** 30, 2), "text": text}


def collect_figures(run: dict) -> dict:
    m = WROTE.findall(run.pop("text"))
    tokens, seconds, rate = (int(m[-1][0]), float(m[-1][1]), int(m[-1][2])) if m else (None, None, None)
    return {**run, "tokens": tokens, "collect_s": seconds, "tokens_per_s": rate,
            "tokens_per_wall_s": round(tokens / run["wall_s"]) if tokens else None}


def answer_tokens(journal: Path) -> int:
    n = 0
    for line in journal.read_text().splitlines():
        n += sum(len(m.get("token_ids") or []) for m in json.loads(line)["messages"] if m["role"] == "assistant")
    return n


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cli = [sys.executable, "-m", "specheads.cli"]
    common = [f"target.name_or_path={args.target}", f"target.dtype={args.dtype}"]
    prepared = work / "prepared"
    measured([*cli, "prepare", *common, f"data.num_samples={args.samples}", f"data.max_length={args.max_length}",
              f"output_dir={prepared}"], work / "prepare.log")
    report = {"kind": "collect_backends", "target": args.target, "dtype": args.dtype, "samples": args.samples,
              "max_length": args.max_length, "collect": {}, "regenerate": {}}
    for engine in ("hf", "vllm"):
        run = measured([*cli, "collect", *common, "method=eagle3", f"prepared_dir={prepared}",
                        f"output_dir={work / ('store_' + engine)}", f"engine={engine}", "captured=false"],
                       work / f"collect_{engine}.log")
        report["collect"][engine] = collect_figures(run)
    regen = [f"data.num_samples={args.regen_samples}", f"data.max_length={args.max_length}",
             f"regenerate.max_new_tokens={args.max_new_tokens}"]
    for name, override in (("hf_static", "regenerate=greedy"), ("vllm_captured", "regenerate=engine")):
        out = work / f"regen_{name}"
        run = measured([*cli, "prepare", *common, override, *regen, f"output_dir={out}"], work / f"regen_{name}.log")
        run.pop("text")
        tokens = answer_tokens(out.with_name(out.name + ".regen.jsonl"))
        report["regenerate"][name] = {**run, "answer_tokens": tokens,
                                      "answer_tokens_per_wall_s": round(tokens / run["wall_s"], 1)}
    run = measured([*cli, "collect", *common, "method=eagle3", f"prepared_dir={work / 'regen_vllm_captured'}",
                    f"output_dir={work / 'store_captured'}"], work / "collect_captured.log")
    report["regenerate"]["collect_from_capture"] = collect_figures(run)
    hf, vl = report["collect"]["hf"], report["collect"]["vllm"]
    if hf["tokens_per_s"] and vl["tokens_per_s"]:
        report["collect"]["vllm_over_hf"] = round(vl["tokens_per_s"] / hf["tokens_per_s"], 2)
    a, b = report["regenerate"]["hf_static"], report["regenerate"]["vllm_captured"]
    report["regenerate"]["vllm_over_hf"] = round(b["answer_tokens_per_wall_s"] / a["answer_tokens_per_wall_s"], 2)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
