"""Cost curves: time and peak memory of each stage against its input size, on this machine.

    python scripts/bench/cost_curves.py prepare --sizes 1000 10000 100000
    python scripts/bench/cost_curves.py collect --sizes 25 50 100          # chats of the embedded ShareGPT, SmolLM2
    python scripts/bench/cost_curves.py train --sizes 100 200 400          # optimizer steps (the main job's settings) on the 100-chat store
    python scripts/bench/cost_curves.py evaluate --sizes 1 2 4             # MT-bench questions per category + as many HumanEval (T=0, batch 1, one pass)
    python scripts/bench/cost_curves.py all --markdown docs/cost_curves.md

Each point runs the stage as a user does (``python -m specheads.cli <verb> ...``) in a fresh process, while a
sampler reads the resident memory of that process and of every process it started (worker processes
included) ten times a second: "peak anon" is the largest sum of their resident anonymous memory (heap; a
forked worker's pages shared with its parent count in both), "main" that of the stage's own process, "peak
PSS" the largest sum of proportional set sizes, which also counts the pages of memory-mapped files read
(prepared Arrow data, feature shards) that the kernel can drop. Inputs beyond the packaged ShareGPT's size repeat its chats with a numbered first user turn, so no
two are duplicates and the token mix stays ShareGPT's. Prints one JSON line per point; --markdown writes the
tables (with the machine described) to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
# the main job's training settings for EAGLE-3 on the CPU (conf/pipeline.yaml), without its time budget
MAIN_JOB_TRAIN = ["optim.lr=1.5e-3", "optim.warmup_steps=10", "train.max_minutes=null", "train.mixed_precision=bf16",
                  "train.eval_every=0", "train.save_every=50", "data.max_tokens=2048", "data.eval_samples=16",
                  "train.measure_prompts=8", "method.draft_vocab_size=4096", "method.ttt_steps=1",
                  "method.init_layer_from_target=true", "method.init_lm_head_from_target=true", "wandb.mode=disabled"]


def anon_rss(pid: int) -> int:
    """Resident anonymous memory of a process (``RssAnon``): its heap, not the pages of files it maps, which
    the kernel can drop (a memory-mapped Arrow file or feature shard read through counts in RSS, not here)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def sample_rss(proc: subprocess.Popen, out: dict) -> None:
    """Largest summed anonymous memory and proportional set size of the process tree, and the anonymous
    memory of the process itself, until it exits."""
    try:
        root = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        return
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            anon = pss = 0
            for p in procs:
                try:
                    anon += anon_rss(p.pid)
                    pss += p.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError, ProcessLookupError):
                    pass
            out["peak"] = max(out.get("peak", 0), anon)
            out["pss"] = max(out.get("pss", 0), pss)
            out["main"] = max(out.get("main", 0), anon_rss(root.pid))
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)


def run_stage(args: list[str], cwd: Path, log: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "specheads.cli", *args], cwd=cwd, stdout=f,
                                stderr=subprocess.STDOUT, env=env)
        mem: dict = {}
        sampler = threading.Thread(target=sample_rss, args=(proc, mem), daemon=True)
        sampler.start()
        rc = proc.wait()
        sampler.join()
    seconds = time.perf_counter() - t0
    if rc:
        raise SystemExit(f"{' '.join(args)} failed (exit {rc}); see {log}")
    return {"seconds": round(seconds, 1), "peak_anon_mb": round(mem.get("peak", 0) / 2**20),
            "main_anon_mb": round(mem.get("main", 0) / 2**20), "peak_pss_mb": round(mem.get("pss", 0) / 2**20)}


def varied_chats(n: int, path: Path) -> Path:
    """n ShareGPT chats as JSONL; past the package's end they repeat with a numbered first user turn."""
    from specheads.data.sources import iter_conversations

    if path.exists():
        return path
    written, cycle = 0, 0
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        while written < n:
            for conv in iter_conversations("sharegpt"):
                msgs = [dict(m) for m in conv.messages]
                if cycle:
                    first = next(m for m in msgs if m["role"] == "user")
                    first["content"] = f"(variant {cycle}) {first['content']}"
                f.write(json.dumps({"id": f"{conv.id}-v{cycle}", "messages": msgs}) + "\n")
                written += 1
                if written >= n:
                    break
            cycle += 1
    tmp.replace(path)
    return path


def bench_prepare(sizes, work: Path, num_proc: int | None, max_length: int) -> list[dict]:
    chats = varied_chats(max(sizes), work / f"chats-{max(sizes)}.jsonl")
    points = []
    for n in sizes:
        out = work / f"prepared-{n}"
        args = ["prepare", "data=jsonl", f"data.path={chats}", f"data.num_samples={n}", f"data.max_length={max_length}",
                f"output_dir={out}", "overwrite=true"] + ([f"data.num_proc={num_proc}"] if num_proc else [])
        point = run_stage(args, work, work / f"prepare-{n}.log")
        meta = json.loads((out / "specheads_meta.json").read_text())
        point.update(stage="prepare", size=n, unit="chats", samples=meta["num_samples"], tokens=meta["num_tokens"],
                     num_proc=meta.get("num_proc"), per_s=round(n / point["seconds"], 1))
        points.append(point)
        print(json.dumps(point), flush=True)
    return points


def bench_collect(sizes, work: Path) -> list[dict]:
    points = []
    for n in sizes:
        prepared = work / f"small-{n}"
        run_stage(["prepare", f"data.num_samples={n}", "data.max_length=512", f"output_dir={prepared}"], work,
                  work / f"small-{n}.log")
        store = work / f"store-{n}"
        point = run_stage(["collect", "method=eagle3", f"prepared_dir={prepared}", f"output_dir={store}"], work,
                          work / f"collect-{n}.log")
        manifest = json.loads((store / "manifest.json").read_text())
        point.update(stage="collect", size=n, unit="chats", tokens=manifest["num_tokens"],
                     store_mb=round(manifest["bytes_on_disk"] / 2**20),
                     per_s=round(manifest["num_tokens"] / point["seconds"]))
        points.append(point)
        print(json.dumps(point), flush=True)
    return points


def bench_train(sizes, work: Path, chats: int) -> list[dict]:
    prepared, store = work / f"small-{chats}", work / f"store-{chats}"
    if not (store / "manifest.json").exists():
        bench_collect([chats], work)
    points = []
    for steps in sizes:
        out = work / f"train-{steps}"
        point = run_stage(["train", "method=eagle3", f"prepared_dir={prepared}", f"features_dir={store}",
                           f"output_dir={out}", f"train.max_steps={steps}", *MAIN_JOB_TRAIN],
                          work, work / f"train-{steps}.log")
        point.update(stage="train", size=steps, unit="steps", per_s=round(steps / point["seconds"], 2))
        points.append(point)
        print(json.dumps(point), flush=True)
    return points


def bench_evaluate(sizes, work: Path, steps: int) -> list[dict]:
    head = work / f"train-{steps}" / "head"
    if not head.exists():
        bench_train([steps], work, 50)
    points = []
    for n in sizes:
        out = work / f"eval-{n}"
        point = run_stage(["evaluate", f"head_dir={head}", f"output_dir={out}", f"eval.mtbench_per_category={n}",
                           f"eval.humaneval={n}", "eval.mtbench_turns=[1]", "eval.repeats=1", "temperatures=[0.0]",
                           "batch_sizes=[1]"], work, work / f"evaluate-{n}.log")
        point.update(stage="evaluate", size=n, unit="prompts per domain", per_s=None)
        points.append(point)
        print(json.dumps(point), flush=True)
    return points


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
            f"Python {platform.python_version()}")


def markdown(points: list[dict]) -> str:
    lines = [f"Measured by `scripts/bench/cost_curves.py` on {machine()}, {time.strftime('%Y-%m-%d')}.", ""]
    for stage in ("prepare", "collect", "train", "evaluate"):
        rows = [p for p in points if p["stage"] == stage]
        if not rows:
            continue
        lines += [f"### {stage}", "", f"| {rows[0]['unit']} | seconds | per second | peak anon MB (all processes) "
                  "| main anon MB | peak PSS MB | notes |", "|---|---|---|---|---|---|---|"]
        for p in rows:
            notes = ", ".join(f"{k} {p[k]}" for k in ("samples", "tokens", "num_proc", "store_mb") if k in p)
            lines.append(f"| {p['size']} | {p['seconds']} | {p['per_s'] if p['per_s'] is not None else ''} | "
                         f"{p['peak_anon_mb']} | {p['main_anon_mb']} | {p['peak_pss_mb']} | {notes} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["prepare", "collect", "train", "evaluate", "all"])
    ap.add_argument("--sizes", type=int, nargs="+")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "cost_curves")
    ap.add_argument("--num-proc", type=int, default=None)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--json", type=Path, help="append the points to this JSON lines file")
    ap.add_argument("--markdown", type=Path, help="write the tables to this file")
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    points = []
    if a.stage in ("prepare", "all"):
        points += bench_prepare(a.sizes if a.stage == "prepare" and a.sizes else [1000, 10000, 100000], a.work,
                                a.num_proc, a.max_length)
    if a.stage in ("collect", "all"):
        points += bench_collect(a.sizes if a.stage == "collect" and a.sizes else [25, 50, 100], a.work)
    if a.stage in ("train", "all"):
        points += bench_train(a.sizes if a.stage == "train" and a.sizes else [100, 200, 400], a.work, 100)
    if a.stage in ("evaluate", "all"):
        points += bench_evaluate(a.sizes if a.stage == "evaluate" and a.sizes else [1, 2, 4], a.work, 100)
    if a.json:
        with a.json.open("a") as f:
            f.writelines(json.dumps(p) + "\n" for p in points)
    if a.markdown:
        a.markdown.write_text(markdown(points))
    print(markdown(points))


if __name__ == "__main__":
    main()
