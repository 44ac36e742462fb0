"""What a main-job run did on this machine: each stage's seconds and the choices it made (precision, the
collection budget, training's steps), read back from what the stages wrote, for the run's last lines and
``<run_dir>/run_summary.json`` (the record ``docs/benchmarks.json`` entries are made from)."""

from __future__ import annotations

import datetime
import hashlib
import json
from pathlib import Path

from specheads.acceptance_math import first_draft_accuracy
from specheads.data.store import atomic_write_json
from specheads.hardware import cpu_description

SUMMARY_FILE = "run_summary.json"
STAGES = ("prepare", "collect", "train", "evaluate", "export", "serve")
MAIN_JOB = STAGES[:5]  # the main job's time; serve (the export in vLLM, when its venv exists) is counted apart


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_seconds(run_dir: Path, head: str) -> dict[str, float]:
    """Seconds of each stage's last finished run (its marker in ``<run_dir>/.done``)."""
    out = {}
    for stage in STAGES:
        for key in (f"{stage}.{head}", stage):
            marker = _json(run_dir / ".done" / f"{key}.json")
            if marker and marker.get("seconds") is not None:
                out[stage] = marker["seconds"]
                break
    return out


def summarize(run_dir: str | Path, head: str, offline: bool, settings: dict | None = None) -> dict:
    """The run's record: machine, stage seconds and total, per stage what it chose and measured, and ``settings``:
    the stage overrides given on the command line (``{stage: [override, ...]}``, the non-empty ones), which tell
    two runs of one head apart (e.g. ``train: [method.loss=dpace]``)."""
    run = Path(run_dir)
    seconds = stage_seconds(run, head)
    out: dict = {"machine": cpu_description(), "date": datetime.date.today().isoformat(), "head": head, "stages_s": seconds,
                 "total_min": round(sum(v for k, v in seconds.items() if k in MAIN_JOB) / 60, 1)}
    given = {stage: [str(o) for o in ov] for stage, ov in (settings or {}).items() if ov}
    if given:
        out["settings"] = given
    manifest = _json(run / "features" / "manifest.json") if offline else None
    if manifest:
        source = manifest.get("source") or {}
        budget = source.get("budget")
        if budget and budget.get("cut"):  # the rows a cut kept are the store's; the summary keeps the counts
            budget = {**budget, "cut": {k: v for k, v in budget["cut"].items() if k != "kept_rows"}}
        out["collect"] = {"samples": manifest.get("num_samples"), "tokens": manifest.get("num_tokens"),
                          "target_dtype": source.get("target_dtype"), "budget": budget,
                          "prepared_samples": source.get("num_samples"), "engine": source.get("engine")}
        # the store's identity: heads trained on one store (one run_dir, several heads) compare head to head
        out["collect"]["store_id"] = hashlib.sha256((run / "features" / "manifest.json").read_bytes()).hexdigest()[:12]
        if seconds.get("collect") and manifest.get("num_tokens"):
            out["collect"]["tokens_per_s_with_startup"] = round(manifest["num_tokens"] / seconds["collect"])
    train = _json(run / "train" / head / "train_summary.json")
    if train:
        ev = train.get("eval") or {}
        out["train"] = {"steps": train.get("steps"), "tokens_per_s": train.get("tokens_per_s"),
                        "precision": train.get("precision"), "heldout_step0_top1": first_draft_accuracy(ev),
                        "peak_rss_mb": train.get("peak_rss_mb"), "peak_anon_mb": train.get("peak_anon_mb")}
    report = _json(run / "eval" / head / "report.json")
    if report:
        lossless = [m.get("lossless", {}).get("exact") for m in report.get("methods", []) if m.get("lossless")]
        out["evaluate"] = {"prompts": report.get("num_prompts"), "max_new_tokens": report.get("max_new_tokens"),
                           "target_dtype": report.get("target_dtype"), "dtype_choice": report.get("target_dtype_choice"),
                           "lossless": "exact" if lossless and all(lossless) else ("MISMATCH" if lossless else None)}
        out.update(method_figures(report))
    served = _json(run / "serve" / head / "serve_report.json")
    tried = seconds.get("serve") is not None or (run / ".done" / f"serve.{head}.started.json").is_file()
    if served and tried:  # this run's serve stage finished, or failed (an engine's refusal is recorded)
        out["serve"] = serve_record(served)
    return out


def method_figures(report: dict) -> dict:
    """Each evaluated row's shape, α, τ and speed-up over all prompts at the report's first temperature (and the
    speed-up at T=1 where it ran), and τ per domain: what ``specheads record`` puts in the results file."""
    temps = [str(t) for t in report.get("temperatures", [])]
    if not temps or not report.get("methods"):
        return {}
    first, t1 = temps[0], next((t for t in temps if float(t) == 1.0), None)
    rows = []
    for m in report["methods"]:
        by = m.get("by_temperature") or {}
        every = (by.get(first) or {}).get("all") or {}
        row = {"name": m["name"], "shape": m.get("shape"), "tau": _r(every.get("tau")), "alpha": _r(every.get("alpha")),
               "speedup": _r(every.get("speedup")), "gpu_speedup_pred": _r(every.get("gpu_speedup_pred"))}
        if t1 and t1 != first:
            row["t1_speedup"] = _r(((by.get(t1) or {}).get("all") or {}).get("speedup"))
        rows.append(row)
    names = [m["name"] for m in report["methods"] if first in (m.get("by_temperature") or {})]
    domains = list(next((m["by_temperature"][first] for m in report["methods"] if first in m.get("by_temperature", {})), {}))
    table = [[d] + [_r(((m["by_temperature"].get(first) or {}).get(d) or {}).get("tau")) for m in report["methods"]
                    if m["name"] in names] for d in domains]
    return {"methods": rows, "per_domain": {"T": float(first), "columns": names, "rows": table}}


def _r(x, nd: int = 2):
    return None if x is None else round(float(x), nd)


def serve_record(report: dict) -> dict:
    """The engine's figures over all prompts (``serve_report.json``), beside the evaluator's τ for the same chain."""
    engine = f"{report['engine'].get('name', 'vLLM')} {report['engine'].get('version', '')}".strip()
    if report.get("refused"):
        return {"engine": engine, "refused": report["refused"]}
    every = report["domains"]["all"]
    spec, plain = every["spec"], every.get("plain") or {}
    beside = ((report.get("evaluator") or {}).get("domains") or {}).get("all") or {}
    return {"engine": engine, "prompts": report["num_prompts"], "num_speculative_tokens": report["num_speculative_tokens"],
            "tau": spec["tau"], "tau_evaluator": beside.get("tau_evaluator"), "flagged": beside.get("tau_flagged"),
            "reach": spec["reach"], "tokens_per_s": spec["tokens_per_s"], "plain_tokens_per_s": plain.get("tokens_per_s"),
            "speedup": every.get("speedup"),
            "greedy_identical": f"{every['identical']}/{every['compared']}" if "identical" in every else None}


def write_summary(run_dir: str | Path, head: str, offline: bool,
                  settings: dict | None = None) -> tuple[dict, list[str]]:
    """Write ``run_summary.json`` into the run folder; returns it and its lines for the console."""
    record = summarize(run_dir, head, offline, settings)
    atomic_write_json(Path(run_dir) / SUMMARY_FILE, record)
    return record, summary_lines(record)


def summary_lines(record: dict) -> list[str]:
    s = record["stages_s"]
    L = [f"Ran on {record['machine']}: {record['total_min']} min "
         f"({', '.join(f'{k} {v:.0f} s' for k, v in s.items())})"]
    c = record.get("collect")
    if c:
        dtype = (c.get("target_dtype") or {}).get("value") if isinstance(c.get("target_dtype"), dict) else c.get("target_dtype")
        b = c.get("budget")
        part = (f"{c['samples']} of {b['prepared_rows']} prepared chats in its {b['max_minutes']:g}-minute budget "
                f"at ~{b['tokens_per_s']:.0f} tokens/s" if b else f"{c['samples']} chats")
        if b and b.get("cut"):
            part += f", cut at {b['cut']['overrun']:g}x the budget (the machine ran slower than its probe)"
        L.append(f"  collect: target {dtype}, {part} ({c['tokens']} tokens)")
    t = record.get("train")
    if t:
        p = t.get("precision") or {}
        rate = f" at {t['tokens_per_s']:.0f} tokens/s" if t.get("tokens_per_s") else ""
        L.append(f"  train: {t['steps']} steps{rate}, mixed precision {p.get('mixed_precision')}, "
                 f"target {str(p.get('target_dtype', '')).removeprefix('torch.')}")
    e = record.get("evaluate")
    if e:
        L.append(f"  evaluate: {e['prompts']} prompts x {e['max_new_tokens']} tokens, target "
                 f"{str(e['target_dtype']).removeprefix('torch.')}, lossless {e['lossless']}")
    v = record.get("serve")
    if v and v.get("refused"):
        L.append(f"  serve: {v['engine']} refused the head: {v['refused']}")
    elif v:
        beside = f" (evaluator {v['tau_evaluator']:.2f})" if v.get("tau_evaluator") is not None else ""
        rate = (f", {v['tokens_per_s']:.1f} tokens/s against plain {v['plain_tokens_per_s']:.1f} ({v['speedup']:.2f}x)"
                if v.get("speedup") else "")
        same = f", greedy identical {v['greedy_identical']}" if v.get("greedy_identical") else ""
        L.append(f"  serve: {v['engine']}, {v['prompts']} prompts, chain of {v['num_speculative_tokens']}: "
                 f"τ {v['tau']:.2f}{beside}{rate}{same}")
    return L
