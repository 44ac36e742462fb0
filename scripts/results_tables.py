"""Render the measured figures of README.md and docs/*.md from docs/benchmarks.json.

    python scripts/results_tables.py            # rewrite the tables between their marker comments
    python scripts/results_tables.py --check    # exit 1 (naming the file) where a table differs

docs/benchmarks.json is the one record of measured runs (newest first), written by ``specheads record FILE``
(specheads/record.py): every entry names its commit, date and machine. Entries from before the record command
whose commit was never noted sit apart, under ``unrecorded``, rendered as docs/benchmarks.md's "Unrecorded
history" and, labelled as such, as docs/dflash.md's DFlash-against-EAGLE-3 table (its entry's ``id``). Each
block sits between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in its file; everything outside the markers
is left alone, so the figures are written once, in the JSON.
tests/test_docs.py checks that the files match this script and that prose outside the blocks states a measured
figure, a prompt count or a dtype only beside the record that holds it (its commit, or an unrecorded entry's id).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from specheads.record import PEERS

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "docs" / "benchmarks.json"
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
EXPORT = REPO / "docs" / "export.md"
SERVING = REPO / "docs" / "serving.md"
METHODS = REPO / "docs" / "methods.md"
COLLECT = REPO / "docs" / "collect.md"
DFLASH = REPO / "docs" / "dflash.md"
TRAIN = REPO / "docs" / "train.md"
# the unrecorded entry docs/dflash.md's head-to-head table is rendered from
DFLASH_RECORD = "dflash-eagle3-2026-12-02"
# method key -> what a reader calls it (the order of the README's results table)
METHOD_NAMES = {
    "eagle3+lookup+table": "EAGLE-3 + prompt-lookup branch + n-gram table (main job's default)",
    "eagle3+lookup": "EAGLE-3 + prompt-lookup branch",
    "eagle3": "EAGLE-3 head alone",
    "eagle3-vllm": "EAGLE-3, vLLM's chain profile",
    "ngram": "n-gram prompt lookup (no training)",
    "dflash": "DFlash head alone",
    "dflash+lookup": "DFlash + prompt-lookup branch",
}
# the heads compared head to head (docs/methods.md), in the order of its rows
HEADS = ("eagle3", "peagle", "dflash", "dspark", "domino")
BASELINES = ("ngram", "suffix")  # drafters with no training: one row each, from the first run that has it
STAGES = ("prepare", "collect", "train", "evaluate", "export")


def load(path: Path = DATA) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _f(x, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _x(x) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _commit(run: dict) -> str:
    if not run.get("commit"):
        return "not recorded"
    return f"`{run['commit'][:7]}`" + (" (dirty tree)" if run.get("dirty") else "")


def unrecorded(data: dict) -> dict:
    """The entries whose commit was never noted: ``{"runs": [...], "test_runs": [...]}``."""
    return data.get("unrecorded") or {"runs": [], "test_runs": []}


def _compared(data: dict) -> set[str]:
    """The feature stores that heads of more than one kind were trained on (a head-to-head, docs/methods.md)."""
    heads: dict[str, set] = {}
    for r in data["runs"]:
        if r.get("store"):
            heads.setdefault(r["store"], set()).add(r.get("head"))
    return {store for store, h in heads.items() if len(h) > 1}


# a run under these variables ran its CPU as another one (docs/development.md "Any CPU"): not the README's command
FORCED_CPU = ("ATEN_CPU_CAPABILITY=", "ONEDNN_MAX_CPU_ISA=", "SPECHEADS_CPU_BF16=")


def latest_main_job(data: dict) -> dict:
    """The newest fresh-clone run of the main job (EAGLE-3, its own store: not one head of a head-to-head, no stage
    override, collected by the transformers forward, the CPU not held to another instruction set: set up and run as
    the README gives it, without the engine's venv) with a recorded commit and per-method figures."""
    compared = _compared(data)
    return next(r for r in data["runs"] if r["kind"] == "main_job" and r.get("fresh_clone") and r.get("commit")
                and r.get("methods") and r.get("head", "eagle3") == "eagle3" and r.get("store") not in compared
                and not r.get("settings") and r.get("collect_engine", "hf") == "hf"
                and not any(v in (r.get("run") or "") for v in FORCED_CPU))


def _family(method: str) -> str:
    """``eagle3+lookup`` -> ``eagle3``, ``eagle3-vllm`` -> ``eagle3``."""
    return re.split(r"[+-]", method)[0]


def results_rows(data: dict) -> list[tuple[dict, dict]]:
    """The README results table's rows as (method figures, run): the newest main-job clone's methods, then the
    methods it did not run from the newest run that has them (a head-to-head comparison)."""
    main = latest_main_job(data)
    rows = [(m, main) for m in main["methods"]]
    seen = {m["method"] for m in main["methods"]}
    families = {_family(m) for m in seen}  # a comparison run's EAGLE-3 rows are another head: left out
    for run in data["runs"]:
        if run.get("settings"):  # a run given stage overrides (docs/methods.md shows training variants)
            continue
        new = [m for m in run.get("methods", []) if m["method"] not in seen and m["method"] in METHOD_NAMES
               and _family(m["method"]) not in families]
        rows += [(m, run) for m in new]
        seen |= {m["method"] for m in new}
    return rows


def results_table(data: dict) -> str:
    """README: one row per method (``results_rows``), each row naming its date, commit and where it is described."""
    rows = results_rows(data)
    lines = ["| method | shape | τ | α | CPU speed-up T=0 | T=1 | served by vLLM | measured |",
             "|---|---|---|---|---|---|---|---|"]
    for m, run in rows:
        where = run.get("source", "docs/benchmarks.md")
        lines.append(f"| {METHOD_NAMES[m['method']]} | {m.get('shape') or '–'} | {_f(m.get('tau'))} | "
                     f"{_f(m.get('alpha'))} | {_x(m.get('speedup'))} | {_x(m.get('t1_speedup'))} | "
                     f"{served_cell(run, m['method'])} | {run['date']}, commit {_commit(run)}, "
                     f"[{Path(where).stem}]({where}) |")
    return "\n".join(lines)


def results_set(data: dict) -> str:
    """README: what each run of the results table evaluated, as its record says: the evaluation set (``eval_set``:
    the prompts scored, new tokens, batch) and the target's dtype (``target_dtype``), one line per run."""
    runs: list[dict] = []
    for _, run in results_rows(data):
        if not any(run is r for r in runs):
            runs.append(run)
    lines = []
    for run in runs:
        families = list(dict.fromkeys(FAMILY_NAMES.get(_family(m["method"]), "n-gram") for m, r in results_rows(data)
                                      if r is run))
        which = " and ".join([", ".join(families[:-1]), families[-1]] if len(families) > 1 else families)
        dtype = f"target in {run['target_dtype']}" if run.get("target_dtype") else "target dtype not recorded"
        lines.append(f"- the {which} rows, commit {_commit(run)} ({run['date']}): "
                     f"{run.get('eval_set') or 'evaluation set not recorded'}; {dtype}")
    return "\n".join(lines)


def served_cell(run: dict, method: str) -> str:
    """The engine's figures for the method it served in the run's serve stage (``served``: the same head and
    chain), as τ, its speed-up on that engine and the outputs identical to its plain decoding."""
    s = run.get("served")
    if not s or s.get("method") != method:
        return "–"
    chain = f", chain {s['k']}" if s.get("k") else ""
    return f"τ {_f(s['tau'])}, {_x(s.get('speedup'))}, identical {s['identical']} ({s['engine']}{chain})"


def _stage_times(run: dict) -> str:
    st = run.get("stages_s") or {}
    return ", ".join(f"{s} {st[s]:.0f} s" for s in STAGES if s in st)


def machine_range(data: dict) -> list[dict]:
    """The newest fresh-clone main-job run of each CPU kind (``cpu``: its name and instruction set), newest first."""
    seen, out = set(), []
    for r in data["runs"]:
        if r["kind"] == "main_job" and r.get("fresh_clone") and r.get("cpu") and r["cpu"] not in seen:
            seen.add(r["cpu"])
            out.append(r)
    return out


def quickstart_times(data: dict) -> str:
    """README: what the two Quickstart commands took on the newest measured clone, and on each CPU kind."""
    main = latest_main_job(data)
    test = data["test_runs"][0]
    setup = f"set-up {main['setup_s']} s, then " if main.get("setup_s") else ""
    text = (f"Measured on a fresh clone of commit {_commit(main)} ({main['date']}, {main['machine']}): {setup}"
            f"**{main['total_min']} minutes** for the run ({_stage_times(main)})"
            + (f"; with vLLM's venv set up, its serve stage added {main['serve_s']} s" if main.get("serve_s") else "")
            + ". "
            f"The tests: {test['passed']} passed, {test['skipped']} skipped in {test['tests_min']} min "
            + (f"({test['total_min']} min with set-up; " if test.get("total_min") is not None else "(")
            + f"commit {_commit(test)}, {test['date']}, {test['machine']}).")
    kinds = machine_range(data)
    if len(kinds) > 1:
        text += " The machines measured, newest run of each: " + "; ".join(
            f"{r['cpu']}: {r['total_min']} min ({_commit(r)})" for r in kinds) + "."
    return text


def run_summary(data: dict) -> str:
    """README: the summary lines the run prints at the end (report.md), for the newest main-job clone, with
    the cells that run recorded; a cell it did not record is shown as ``n/r``."""
    main = latest_main_job(data)
    nr = "n/r"
    lines = ["| method | α T=0.0 | τ T=0.0 | speed-up (CPU) T=0.0 | speed-up (CPU) T=1.0 | lossless |",
             "|---|---|---|---|---|---|"]
    for m in main["methods"]:
        cells = [m.get("name", m["method"])]
        cells += [nr if m.get(k) is None else f"{m[k]:.2f}" for k in ("alpha", "tau", "speedup", "t1_speedup")]
        cells.append(main.get("lossless", nr))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_domains(data: dict) -> str:
    """README: the per-domain τ table the newest main-job clone printed (``per_domain``: its T, column names and
    rows of domain + one τ per column), as the report prints it."""
    main = latest_main_job(data)
    pd = main.get("per_domain")
    if not pd:
        return "(the per-domain rows of this run were not recorded)"
    lines = [f"τ per domain at T={pd['T']}:", "", "| domain | " + " | ".join(pd["columns"]) + " |",
             "|---|" + "---|" * len(pd["columns"])]
    lines += ["| " + " | ".join([row[0]] + [_f(x) for x in row[1:]]) + " |" for row in pd["rows"]]
    return "\n".join(lines)


def _best(run: dict, prefix: str) -> dict | None:
    """The run's best-scoring drafter whose method starts with ``prefix`` and has a speed-up."""
    ms = [m for m in run.get("methods", []) if m["method"].startswith(prefix) and m.get("speedup") is not None]
    return max(ms, key=lambda m: m["speedup"]) if ms else None


def _cell(m: dict | None, with_alpha: bool = False) -> str:
    if m is None:
        return "–"
    parts = [f"τ {_f(m['tau'])}"] if m.get("tau") is not None else []
    if with_alpha and m.get("alpha") is not None:
        parts.append(f"α {_f(m['alpha'])}")
    parts.append(_x(m.get("speedup")))
    shape = f" ({m['shape']})" if m.get("shape") else ""
    return ", ".join(parts) + shape


def history_table(data: dict, runs: list[dict] | None = None) -> str:
    """docs/benchmarks.md: every recorded main-job run (or ``runs``), newest first."""
    lines = ["| date | commit | fresh clone | machine | what ran | set-up + run | stages | training (EAGLE-3) | "
             "EAGLE-3 with lookup branch | EAGLE-3 head alone | n-gram | vLLM chain | served by vLLM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"] if runs is None else runs:
        if r["kind"] != "main_job":
            continue
        tr = (r.get("train") or {}).get("eagle3") or {}
        train = ", ".join(p for p in (
            f"{tr['steps']} steps" if "steps" in tr else "",
            f"{tr['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in tr else "",
            f"held-out step-0 top-1 {tr['heldout_step0_top1']:.3f}" if "heldout_step0_top1" in tr else "",
            f"peak anonymous memory {tr['peak_anon_mb']} MB" if "peak_anon_mb" in tr else "") if p) or "–"
        total = (f"{r['setup_s']} s + " if r.get("setup_s") else "") + f"{r['total_min']} min"
        by = {m["method"]: m for m in r.get("methods", [])}
        best = _best(r, "eagle3+")  # the head with the lookup branch (and table); none before the branch existed
        lines.append(" | ".join([
            f"| {r['date']}", _commit(r), "yes" if r.get("fresh_clone") else "no", r["machine"], r.get("what") or "–", total,
            _stage_times(r) or "–", train,
            f"{best['method']}: {_cell(best, True)}" if best else "–",
            _cell(by.get("eagle3"), best is None),
            _cell(by.get("ngram")), _cell(by.get("eagle3-vllm")), served_cell(r, "eagle3-vllm")]) + " |")
    return "\n".join(lines)


def followups_list(data: dict, runs: list[dict] | None = None) -> str:
    """docs/benchmarks.md: the extra decodes of a run's head (other prompts, more passes), and run notes."""
    lines = []
    for r in data["runs"] if runs is None else runs:
        if r["kind"] != "main_job":
            continue
        items = list(r.get("followups", [])) + ([f"note: {r['note']}"] if r.get("note") else [])
        for item in items:
            lines.append(f"- {r['date']}, commit {_commit(r)}: {item}")
    return "\n".join(lines)


def tests_table(data: dict, runs: list[dict] | None = None) -> str:
    lines = ["| date | commit | machine | command | passed | skipped | tests | with set-up |", "|---|---|---|---|---|---|---|---|"]
    for t in data["test_runs"] if runs is None else runs:
        total = f"{t['total_min']} min" if t.get("total_min") is not None else "–"
        lines.append(f"| {t['date']} | {_commit(t)} | {t['machine']} | `{t.get('run', 'pytest')}` | {t['passed']} | "
                     f"{t['skipped']} | {t['tests_min']} min | {total} |")
    return "\n".join(lines)


def unrecorded_history(data: dict) -> str:
    """docs/benchmarks.md: the runs and test runs whose commit was never noted, apart from the record."""
    old = unrecorded(data)
    notes = followups_list(data, old["runs"])
    return "\n".join([history_table(data, old["runs"]), "", tests_table(data, old["test_runs"])]
                     + (["", notes] if notes else []))


def latest_served(data: dict) -> dict | None:
    """The newest recorded engine measurement: a ``serve_runs`` entry or a main-job run's serve stage."""
    found = [(s["date"], 1, s) for s in data.get("serve_runs", []) if not s.get("refused")]
    found += [(r["date"], 0, {**r["served"], "date": r["date"], "commit": r["commit"], "dirty": r.get("dirty"),
                             "machine": r["machine"]})
              for r in data["runs"] if r.get("served") and not r["served"].get("refused")]
    return max(found, key=lambda x: (x[0], x[1]))[2] if found else None


def served_line(data: dict) -> str:
    """README and docs/serving.md: the engine's τ beside the evaluator's for the same chain, its speed-up and
    greedy identity, from the newest recorded measurement."""
    s = latest_served(data)
    if s is None:
        return "No engine measurement is recorded yet (`specheads record serve_report.json`)."
    beside = f" against the evaluator's {_f(s['tau_evaluator'])} for the same chain" if s.get("tau_evaluator") else ""
    rate = (f"; {_f(s['tokens_per_s'], 1)} against {_f(s['plain_tokens_per_s'], 1)} tokens/s plain ({_x(s['speedup'])})"
            if s.get("speedup") is not None else "")
    same = f"; output identical to plain decoding on {s['identical']} prompts" if s.get("identical") else ""
    return (f"Latest recorded: {s['engine']}, a chain of {s['k']}, τ {_f(s['tau'])}{beside}{rate}{same} "
            f"({s['date']}, commit {_commit(s)}, {s['machine']}).")


def export_check(data: dict) -> str:
    """docs/export.md: the newest recorded run of scripts/check_engine_loaders.py, one line per check."""
    checks = data.get("export_checks") or []
    if not checks:
        return ("No run of `scripts/check_engine_loaders.py` is recorded yet: run it, save its output and "
                "`specheads record` that file.")
    c = checks[0]
    lines = [f"Latest recorded run ({c['date']}, commit {_commit(c)}, {c['machine']}): {c['ok']} passed, "
             f"{c['skipped']} skipped, {c['failed']} failed.", "", "| engine | head | layout | check | result |",
             "|---|---|---|---|---|"]
    for r in c["checks"]:
        mark = "skipped" if r["ok"] is None else "ok" if r["ok"] else "**FAILED**"
        lines.append(f"| {r.get('engine', '')} | {r.get('head', '')} | {r.get('layout', '')} | {r['check']} | "
                     f"{mark}: {r.get('detail', '')} |")
    return "\n".join(lines)


def _variant(run: dict) -> tuple[str, ...]:
    """The training overrides a run was given on the command line (``settings.train``): () for the defaults."""
    return tuple((run.get("settings") or {}).get("train") or ())


def head_to_head_runs(data: dict) -> list[dict]:
    """The newest record of each head in ``HEADS`` (and of each training variant of it, ``_variant``) trained on
    the newest feature store (``store``) that two or more heads share, in ``HEADS`` order, defaults first; [] when
    no store has two."""
    by_store: dict[str, dict[tuple, dict]] = {}
    for run in data["runs"]:  # newest first: the first record of a head on a store is its newest
        if run.get("kind") == "main_job" and run.get("store") and run.get("head") in HEADS and run.get("methods"):
            by_store.setdefault(run["store"], {}).setdefault((run["head"], _variant(run)), run)
    for run in data["runs"]:
        found = by_store.get(run.get("store") or "", {})
        if len({head for head, _ in found}) >= 2:
            return [found[k] for k in sorted(found, key=lambda k: (HEADS.index(k[0]), k[1]))]
    return []


def _mb(x) -> str:
    return "–" if x is None else f"{x:,.0f}"


def head_to_head(data: dict) -> str:
    """docs/methods.md: the heads trained on one store with one budget, each row the head alone (as the evaluator's
    own shape and, where recorded, another verification of it) and the baselines with no training (n-gram, suffix
    decoding); then τ per domain."""
    runs = head_to_head_runs(data)
    if not runs:
        return "(no two heads recorded on one feature store yet)"
    r0 = runs[0]
    heads = len({r["head"] for r in runs})
    variants = f" ({len(runs) - heads} of them also trained with another loss)" if len(runs) > heads else ""
    lines = [f"{heads} heads{variants} on one feature store (`{r0['store']}`: {r0.get('collect_tokens_per_s', '–')} "
             f"tokens/s collected), each trained for the main job's budget and evaluated on the same prompts "
             f"({r0.get('eval_set', '–')}); {r0['machine']}. τ, α and speed-up at T=0 over every prompt; GPU speed-up "
             "predicted from τ and the draft's size (docs/evaluate.md); training throughput and peak resident memory "
             "of the training process (the target and feature store included).", "",
             "| drafter | shape | τ | α | CPU speed-up | GPU speed-up (pred.) | train steps | train tokens/s | "
             "train peak MB | lossless | measured |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    columns, baselines = [], {}
    for run in runs:
        train = (run.get("train") or {}).get(run["head"], {})
        for m in run["methods"]:
            if m["method"] in BASELINES:
                baselines.setdefault(m["method"], (m, run))
                continue
            if "+" in m["method"] or m["method"].endswith("-vllm"):
                continue
            label = m["name"] + "".join(f" ({o})" for o in _variant(run))
            columns.append((label, m["name"], run))
            lines.append(f"| {label} | {m.get('shape') or '–'} | {_f(m.get('tau'))} | {_f(m.get('alpha'))} | "
                         f"{_x(m.get('speedup'))} | {_x(m.get('gpu_speedup_pred'))} | {train.get('steps', '–')} | "
                         f"{_mb(train.get('tokens_per_s'))} | {_mb(train.get('peak_rss_mb'))} | "
                         f"{run.get('lossless', '–')} | {run['date']}, {_commit(run)} |")
    for m, run in (baselines[b] for b in BASELINES if b in baselines):
        lines.append(f"| {m['name']} (no training) | {m.get('shape') or '–'} | {_f(m.get('tau'))} | "
                     f"{_f(m.get('alpha'))} | {_x(m.get('speedup'))} | {_x(m.get('gpu_speedup_pred'))} | – | – | – | "
                     f"{run.get('lossless', '–')} | {run['date']}, {_commit(run)} |")
    domains: dict[str, dict[str, float]] = {}
    for label, name, run in columns:
        pd = run.get("per_domain") or {}
        if name in pd.get("columns", []):
            i = pd["columns"].index(name) + 1
            for row in pd["rows"]:
                domains.setdefault(row[0], {})[label] = row[i]
    names = [label for label, _, _ in columns]
    lines += ["", f"τ per domain at T={runs[0].get('per_domain', {}).get('T', 0.0)}:", "",
              "| domain | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += ["| " + " | ".join([d] + [_f(v.get(n)) for n in names]) + " |" for d, v in domains.items()]
    return "\n".join(lines)


def backends(data: dict) -> str:
    """docs/collect.md: the newest ``bench_backends.py`` record, both backends on the same rows."""
    runs = data.get("backend_runs") or []
    if not runs:
        return "_No record yet: `python scripts/bench/bench_backends.py --json b.json`, then `specheads record b.json`._"
    r = runs[0]
    c, g = r["collect"], r["regenerate"]
    rows = ["| stage, backend | wall s (start-up included) | tokens | tokens/s of the stage | peak memory GB |",
            "|---|---|---|---|---|"]
    for name, key in (("collection, transformers forward (`engine=hf`)", "hf"), ("collection, vLLM (`engine=vllm`)", "vllm")):
        x = c[key]
        rows.append(f"| {name} | {_f(x['wall_s'], 1)} | {x['tokens']} | {x['tokens_per_s']} | {_f(x['peak_rss_gb'])} |")
    for name, key in (("regeneration, transformers loop (`regenerate=greedy`)", "hf_static"),
                      ("regeneration + capture, vLLM (`regenerate=engine`)", "vllm_captured")):
        x = g[key]
        rows.append(f"| {name} | {_f(x['wall_s'], 1)} | {x['answer_tokens']} answer | "
                    f"{_f(x['answer_tokens_per_wall_s'], 1)} (per wall s) | {_f(x['peak_rss_gb'])} |")
    x = g["collect_from_capture"]
    rows.append(f"| collection read from the capture | {_f(x['wall_s'], 1)} | {x['tokens']} | {x['tokens_per_s']} | "
                f"{_f(x['peak_rss_gb'])} |")
    return "\n".join(rows + ["", f"{r['samples']} chats cut at {r['max_length']} tokens for collection, the target "
                              f"{r['target']} at dtype {r.get('dtype', 'auto')}; `{r.get('run', 'scripts/bench/bench_backends.py')}` at "
                              f"commit {_commit(r)} on {r['date']}, {r['machine']}."])


def train_benches(data: dict) -> str:
    """docs/benchmarks.md: the newest ``bench_train.py --json`` record per device and target."""
    runs = _newest_per(data.get("train_benches") or [])
    if not runs:
        return ("_No record yet: `python scripts/bench/bench_train.py --target shape:llama-3.2-1b --methods eagle3 "
                "--json t.json`, then `specheads record t.json`._")
    lines = ["| device | target | method | procs | tokens/s | TFLOP/s | of peak | peak GPU MiB | commit, date |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for x in r["rows"]:
            share = f"{100 * x['share_of_peak']:.0f} %" if x.get("share_of_peak") else "-"
            lines.append(f"| {r['machine']} | {r['target']} | {x['method']} ({x.get('mixed_precision', '-')}) | "
                         f"{x.get('num_processes', 1)} | {x['tokens_per_s']:.0f} | {_f(x.get('tflops'), 1)} | {share} | "
                         f"{_f(x.get('peak_gpu_mib'), 0)} | {_commit(r)}, {r['date']} |")
    return "\n".join(lines)


def _growth(rows: list[dict], key: str, low: int, high: int) -> str:
    """How many times ``key`` grew from ``low`` to ``high`` tokens among ``rows`` (one method, steps, variant)."""
    by_t = {x["tokens"]: x[key] for x in rows}
    if low not in by_t or high not in by_t or not by_t[low]:
        return "–"
    return f"{by_t[high] / by_t[low]:.1f}x"


def long_row_benches(data: dict) -> str:
    """docs/train.md: one row's training step per method, training-time-test steps and row length, each method's
    rows from its newest ``ttt_memory.py --json`` record per machine and target (a record of other methods does
    not hide them), and the growth from 8k to 32k tokens."""
    kept: list[tuple[dict, dict[tuple, list[dict]]]] = []
    seen = set()
    for r in data.get("long_row_benches") or []:  # newest first
        groups: dict[tuple, list[dict]] = {}
        for x in r["rows"]:
            groups.setdefault((x.get("method", "eagle3"), x["steps"], x["variant"]), []).append(x)
        methods = {m for m, _, _ in groups} - {m for (mach, t, m) in seen if (mach, t) == (r["machine"], r["target"])}
        seen |= {(r["machine"], r["target"], m) for m in methods}
        groups = {k: v for k, v in groups.items() if k[0] in methods}
        if groups:
            kept.append((r, groups))
    if not kept:
        return ("_No record yet: `python scripts/bench/ttt_memory.py --variants fused --json r.json`, then "
                "`specheads record r.json`._")
    lines = []
    for r, groups in kept:
        lines += [f"{r['target']}, one row, batch 1, {r.get('dtype', 'float32')}, {r.get('threads', '?')} threads, "
                  f"`{r.get('run', 'scripts/bench/ttt_memory.py')}` at commit {_commit(r)} on {r['date']}, "
                  f"{r['machine']}:", "",
                  "| method | TTT steps | path | tokens | MiB above set-up | process peak MiB | seconds | "
                  "CPU seconds |", "|---|---|---|---|---|---|---|---|"]
        for (method, steps, variant), rows in groups.items():
            for x in sorted(rows, key=lambda x: x["tokens"]):
                lines.append(f"| {FAMILY_NAMES.get(method, method)} | {steps} | {variant} | {x['tokens']} | "
                             f"{x['peak_above_set_up_mib']} | {x['set_up_mib'] + x['peak_above_set_up_mib']} | "
                             f"{x['seconds']:.1f} | {x['cpu_seconds']:.1f} |")
        lines += ["", "From 8,192 to 32,768 tokens: " + "; ".join(
            f"{FAMILY_NAMES.get(m, m)} TTT {st} ({v}) memory {_growth(rows, 'peak_above_set_up_mib', 8192, 32768)}, "
            f"CPU time {_growth(rows, 'cpu_seconds', 8192, 32768)}"
            for (m, st, v), rows in groups.items()) + ".", ""]
    return "\n".join(lines).rstrip()


def eval_benches(data: dict) -> str:
    """docs/benchmarks.md: the newest ``bench_evaluate.py --json`` record per device and target."""
    runs = _newest_per(data.get("eval_benches") or [])
    if not runs:
        return ("_No record yet: `python scripts/bench/bench_evaluate.py --json e.json`, then "
                "`specheads record e.json`._")
    lines = []
    for r in runs:
        temp = f"sampled at T = {r['temperature']}" if r.get("temperature") else "greedy"
        lines += [f"{r['target']} ({r['target_dtype']}) on {r['machine']}, {r['prompt_len']} tokens of context and "
                  f"{r['new_tokens']} new per row, {temp}; commit {_commit(r)}, {r['date']}:", "",
                  "| B | tree nodes | verification | tokens/s | ms/step | draft | target forward | verify | rest | "
                  "forward TFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['batch']} | {x['nodes'] or '- (plain)'} | {x['backend']} | {x['tokens_per_s']:.0f} | "
                  f"{x['ms_per_step']:.2f} | {x['draft_ms']:.2f} | {x['forward_ms']:.2f} | {x['verify_ms']:.2f} | "
                  f"{x['rest_ms']:.2f} | {_f(x.get('forward_tflops'), 1)} |" for x in r["rows"]]
        lines.append("")
    return "\n".join(lines).rstrip()


# a trainer comparison's heading
FAMILY_NAMES = {"eagle3": "EAGLE-3", "peagle": "P-EAGLE", "dflash": "DFlash", "dspark": "DSpark"}


def trainer_comparisons(data: dict, peer: str) -> str:
    """docs/benchmarks.md: the newest ``compare_<peer>.py --json`` record per drafter family, machine, kind of budget
    (epochs or minutes) and recipe (each trainer's extra flags: e.g. speculators' default recipe, or its head in our
    architecture): training figures of both trainers per setting, then α / τ per domain of both heads."""
    seen, runs = set(), []
    for r in data.get("trainer_comparisons") or []:
        if r.get("peer", "speculators") != peer:
            continue
        st = r.get("settings") or {}
        key = (r.get("method", "eagle3"), r.get("machine"), tuple(sorted(r["budget"])),
               tuple(st.get("our_args") or ()), tuple(st.get("their_args") or ()))
        if key not in seen:
            seen.add(key)
            runs.append(r)
    if not runs:
        return (f"_No record yet: `python scripts/peers/compare_{peer}.py ... --epochs 1 --evaluate --json c.json`, "
                "then `specheads record c.json`._")
    return "\n\n".join(_trainer_comparison(r, peer) for r in runs)


def _trainer_comparison(r: dict, peer: str) -> str:
    b, st, store = r["budget"], r["settings"], r.get("store") or {}
    rows = (f"the same {store['num_train']} training rows ({store['train_tokens']} tokens)" if store.get("num_train")
            else "the same training rows")
    budget = (f"{b['epochs']} epoch{'s' if b['epochs'] != 1 else ''} over {rows} for each trainer" if "epochs" in b
              else f"{b['minutes']:g} minutes of training each on {rows}")
    v = r.get("versions") or {}
    extra = "".join(f"; {who} also given {' '.join(f'`{a}`' for a in st[key])}"
                    for who, key in (("ours", "our_args"), (peer, "their_args")) if st.get(key))
    family = FAMILY_NAMES.get(r.get("method", "eagle3"), r.get("method"))
    matched = "".join(f", {label} {st[key]}" for key, label in (("num_depths", "depths per forward"),
                                                                  ("block_size", "block size"),
                                                                  ("anchors", "blocks per row (ours)"),
                                                                  ("mask_token_id", "mask token")) if key in st)
    vocab = ("the target's whole vocabulary" if r.get("method") in ("dflash", "dspark")
             else f"draft vocabulary {st['draft_vocab_size']}")
    lines = [f"**{family}**: {r['date']}, commit {_commit(r)}, {r['machine']}; target {r['target']}; {budget}; "
             f"{vocab}{matched}, {st['max_tokens']} tokens per batch, learning rate {st['lr']:g}, "
             f"{st['threads']} thread{'s' if st['threads'] != 1 else ''}{extra}; {peer} {v.get(peer, '?')}, "
             f"torch {v.get('torch', '?')}"
             + (f". {r['what']}" if r.get("what") else "") + (f" (`{r['run']}`)" if r.get("run") else "") + ":", "",
             "| setting | trainer | steps | tokens | tokens/s (after step 5) | tokens/s (all) | ours/theirs | "
             "peak RSS MiB | peak anon MiB | held-out loss | held-out step-0 top-1 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(x["setting"], x["trainer"]): x for x in r["runs"]}
    for x in r["runs"]:
        other = by.get((x["setting"], "theirs")) if x["trainer"] == "ours" else None
        ratio = (f"{x['steady_tokens_per_s'] / other['steady_tokens_per_s']:.2f}×"
                 if other and x.get("steady_tokens_per_s") and other.get("steady_tokens_per_s") else "–")
        h = x.get("heldout") or {}
        top1 = h.get("top1_step0", h.get("full_acc_step0"))
        name = "ours (specheads)" if x["trainer"] == "ours" else f"theirs ({peer})"
        lines.append(f"| {x['setting']} | {name} | {x['steps']} | {x['tokens']} | {_mb(x.get('steady_tokens_per_s'))} | "
                     f"{_mb(x.get('tokens_per_s'))} | {ratio} | {_mb(x.get('peak_rss_mib'))} | "
                     f"{_mb(x.get('peak_anon_mib'))} | {_f(h.get('loss'), 3)} | {_f(top1, 3)} |")
    evaluated = [x for x in r["runs"] if x.get("eval")]
    if evaluated:
        e = evaluated[0]["eval"]
        cols = [(x, m) for x in evaluated for m in x["eval"]["methods"]]
        cols.sort(key=lambda c: (c[1]["shape"] or "", c[1]["name"], c[0]["setting"], c[0]["trainer"]))
        domains = list(dict.fromkeys(d for _, m in cols for d in m["domains"] if d != "all")) + ["all"]
        lossless = "exact" if all(m.get("lossless") for _, m in cols) else "MISMATCH"
        dtypes = sorted({x["eval"].get("target_dtype") or "–" for x in evaluated})
        dtype = dtypes[0] if len(dtypes) == 1 else f"{' / '.join(dtypes)} (differs between heads)"
        lines += ["", f"Acceptance by the evaluator, T=0, {e['prompts']} prompts × {e['max_new_tokens']} new tokens, "
                  f"target {dtype}, batch 1; lossless {lossless}; α / τ:", "",
                  "| domain | " + " | ".join(f"{x['trainer']} {x['setting']}, {_row_label(x, m)}" for x, m in cols)
                  + " |",
                  "|---|" + "---|" * len(cols)]
        for d in domains:
            cells = [m["domains"].get(d) or {} for _, m in cols]
            lines.append(f"| {d} | " + " | ".join(f"{_f(c.get('alpha'))} / {_f(c.get('tau'))}" for c in cells) + " |")
    served = [x for x in r["runs"] if x.get("serve")]
    if served:
        s = served[0]["serve"]
        domains = list(dict.fromkeys(d for x in served for d in x["serve"]["domains"] if d != "all")) + ["all"]
        k = (r.get("serving") or {}).get("num_speculative_tokens", 3)
        lines += ["", f"Served by vLLM {s.get('engine')} (CPU build, `specheads serve-eval`: ours exported to vLLM's "
                  f"layout, theirs as {peer} wrote it), greedy chain of {k}, {s['prompts']} prompts (those the "
                  "evaluation scored); τ by the engine's own counters / τ the evaluator measured for the same chain; "
                  "greedy output identical to plain decoding in:", "",
                  "| domain | " + " | ".join(f"{x['trainer']} {x['setting']}" for x in served) + " |",
                  "|---|" + "---|" * len(served)]
        for d in domains:
            cells = [x["serve"]["domains"].get(d) or {} for x in served]
            lines.append(f"| {d} | " + " | ".join(f"{_f(c.get('tau'))} / {_f(c.get('tau_evaluator'))}" for c in cells)
                         + " |")
        lines.append("| identical | " + " | ".join(
            f"{(x['serve']['domains'].get('all') or {}).get('identical')} of "
            f"{(x['serve']['domains'].get('all') or {}).get('compared')}" for x in served) + " |")
    return "\n".join(lines)


def _row_label(run: dict, method: dict) -> str:
    """An evaluator row's column label in a trainer comparison: its shape, or its name where another row of the
    same head has that shape (DSpark's chain and its scheduled chain)."""
    shapes = [m.get("shape") for m in run["eval"]["methods"]]
    return method["shape"] if shapes.count(method.get("shape")) == 1 else method["name"]


def _newest_per(runs: list[dict]) -> list[dict]:
    """The newest entry of each (machine, target, temperature), newest first (entries are stored newest first)."""
    seen, out = set(), []
    for r in runs:
        key = (r.get("machine"), r.get("target"), r.get("temperature"))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _shape_words(shape: str | None) -> str:
    """A shape as docs/dflash.md's table says it: ``chain7`` -> ``chain of 7``, ``tree`` -> ``tree of per-slot
    candidates``, ``fan`` -> ``fan chosen``."""
    if shape and re.fullmatch(r"chain\d+", shape):
        return f"chain of {shape[5:]}"
    return {"tree": "tree of per-slot candidates", "fan": "fan chosen"}.get(shape or "", shape or "–")


def dflash_vs_eagle3(data: dict) -> str:
    """docs/dflash.md: DFlash against EAGLE-3 on one store and budget, from the unrecorded entry ``DFLASH_RECORD``
    (measured by hand before runs were recorded with their commit), labelled as unrecorded history."""
    r = next((x for x in unrecorded(data).get("runs", []) if x.get("id") == DFLASH_RECORD), None)
    if r is None:
        return f"_No entry `{DFLASH_RECORD}` under `unrecorded` in docs/benchmarks.json._"
    heads = ("eagle3", "dflash")
    train = {h: (r.get("train") or {}).get(h) or {} for h in heads}
    alone = {h: [m for m in r["methods"] if m["method"] == h] for h in heads}
    branch = {h: [m for m in r["methods"] if m["method"] == f"{h}+lookup"] for h in heads}

    def each(h, key, label=None, rows=None):
        """The figure of each row of head ``h``, each with its shape where the head has more than one (in words
        where ``label``)."""
        ms = [m for m in (alone[h] if rows is None else rows[h]) if m.get(key) is not None]
        def shape(m):
            return _shape_words(m.get("shape")) if label else re.sub(r"\d+$", "", m.get("shape") or "")
        named = len(ms) > 1 or bool(label)
        return ", ".join(_f(m[key]) + (f" ({shape(m)})" if named else "") for m in ms) or "–"

    def positions(h):
        out = []
        for m in alone[h]:
            if m.get("alpha_by_position"):
                n = int(m["shape"][5:]) if re.fullmatch(r"chain\d+", m.get("shape") or "") else 0
                later = "; later positions never reached" if len(m["alpha_by_position"]) < n else ""
                note = f" ({re.sub(r'[0-9]+$', '', m['shape'])}{later})" if len(alone[h]) > 1 or later else ""
                out.append(", ".join(_f(a) for a in m["alpha_by_position"]) + note)
        return "; ".join(out) or "–"

    def top1(h):
        t = train[h]
        if t.get("heldout_step1_top1") is None:
            return _f(t.get("heldout_step0_top1"), 3)
        return f"{_f(t.get('heldout_step0_top1'), 3)} (slot 1), {_f(t['heldout_step1_top1'], 3)} (slot 2)"

    rows = [(f"training steps in {r.get('budget_min', '–')} min", lambda h: str(train[h].get("steps", "–"))),
            ("training tokens/s", lambda h: str(train[h].get("tokens_per_s", "–"))),
            ("peak anonymous memory (MiB)", lambda h: str(train[h].get("peak_anon_mib", "–"))),
            ("held-out first-draft agreement", top1),
            ("training-time τ (held-out, chain)", lambda h: _f(train[h].get("heldout_tau"))),
            (f"measured τ, {r.get('measure_prompts', '–')} held-out prompts, chain 3",
             lambda h: _f(train[h].get("measured_tau_chain3"))),
            ("τ at T=0, the head alone", lambda h: each(h, "tau", label=True)),
            ("α at T=0, the head alone", lambda h: each(h, "alpha")),
            ("α per draft position, T=0", positions),
            ("τ at T=0 with the n-gram lookup branch", lambda h: each(h, "tau", rows=branch)),
            ("CPU speed-up at T=0, head alone / with branch",
             lambda h: f"{each(h, 'speedup')} / {each(h, 'speedup', rows=branch)}"),
            ("τ at T=1, head alone", lambda h: each(h, "t1_tau")),
            ("lossless", lambda h: r.get("lossless", "–"))]
    lines = [f"*Unrecorded history (record `{r['id']}`, {r['date']}, {r['machine']}): measured by hand before figures "
             "were recorded with their commit; not re-measured.*", "",
             "| | " + " | ".join(FAMILY_NAMES[h] for h in heads) + " |", "|---|" + "---|" * len(heads)]
    lines += [f"| {name} | " + " | ".join(cell(h) for h in heads) + " |" for name, cell in rows]
    return "\n".join(lines)


def blocks(data: dict) -> dict[Path, dict[str, str]]:
    """{file: {marker name: the text between its markers}}."""
    return {README: {"results-set": results_set(data), "results": results_table(data),
                     "quickstart-times": quickstart_times(data), "run-summary": run_summary(data),
                     "run-domains": run_domains(data), "served": served_line(data)},
            BENCHMARKS: {"history": history_table(data), "history-notes": followups_list(data),
                         "test-runs": tests_table(data), "unrecorded-history": unrecorded_history(data),
                         "train-benches": train_benches(data), "eval-benches": eval_benches(data),
                         **{f"compare-{peer}": trainer_comparisons(data, peer) for peer in PEERS}},
            EXPORT: {"export-check": export_check(data)},
            SERVING: {"served": served_line(data)},
            METHODS: {"head-to-head": head_to_head(data)},
            TRAIN: {"long-rows": long_row_benches(data)},
            COLLECT: {"backends": backends(data)},
            DFLASH: {"dflash-vs-eagle3": dflash_vs_eagle3(data)}}


def render(text: str, name: str, content: str, path: Path | str = "") -> str:
    """``text`` with the part between ``<!-- name:begin -->`` and ``<!-- name:end -->`` replaced by ``content``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
    if len(pattern.findall(text)) != 1:
        raise SystemExit(f"{path}: needs exactly one {begin} ... {end} pair, each marker on its own line")
    return pattern.sub(lambda _: f"{begin}\n{content}\n{end}", text)


def rendered(data: dict) -> dict[Path, tuple[str, str]]:
    """{file: (its text now, its text with every table rendered)}."""
    out = {}
    for path, parts in blocks(data).items():
        old = new = path.read_text(encoding="utf-8")
        for name, content in parts.items():
            new = render(new, name, content, path)
        out[path] = (old, new)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check; exit 1 where a file's tables are out of date")
    args = ap.parse_args(argv)
    stale = []
    for path, (old, new) in rendered(load()).items():
        if old != new:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    for path in stale:
        print(f"{path.relative_to(REPO)}: {'out of date' if args.check else 'rewritten'}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
