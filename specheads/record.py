"""One measured run, appended to ``docs/benchmarks.json`` with where and on what it was measured.

``specheads record <file>`` reads one of these outputs, recognised by their contents, not their names:

* a main-job ``run_summary.json`` (``specheads run``) -> an entry of ``runs``;
* a ``serve_report.json`` (``specheads serve-eval``) -> an entry of ``serve_runs``;
* a log of the test suite (``.ci/run`` or ``pytest``), its closing line ``N passed, M skipped ... in X s`` ->
  an entry of ``test_runs``;
* the output of the engines' loader check (``scripts/check_engine_loaders.py``: one ``ok|skip|FAIL`` line per
  check and ``N ok/skipped, M failed``; or the same rows as JSON) -> an entry of ``export_checks``;
* the report of ``scripts/bench/bench_backends.py`` (collection and regeneration by the Hugging Face forward and by
  vLLM on the same rows) -> an entry of ``backend_runs``;
* the ``--json`` report of ``scripts/bench/bench_train.py`` (training tokens/s, memory and share of the device's
  peak per method) -> an entry of ``train_benches``, of ``scripts/bench/ttt_memory.py`` (one long row's training
  step, memory above set-up and time, per method, row length and training-time-test steps) -> an entry of
  ``long_row_benches``, of ``scripts/bench/bench_evaluate.py`` (a decoding step's
  time split by phase per batch size, tree size and verification backend) -> an entry of ``eval_benches``;
* the ``--json`` report of ``scripts/peers/compare_speculators.py``, ``compare_modelopt.py`` or
  ``compare_specforge.py`` (our trainer and another toolkit's for one drafter family, its ``peer``, on one store:
  tokens/s, memory, held-out figures and, with ``--evaluate``, α and τ per domain of both heads) -> an entry of
  ``trainer_comparisons``
  (``trainer_compare_entry``: the figures, not the commands or log paths).

Every entry carries ``commit`` (``git rev-parse HEAD`` of the checkout it was measured in), ``dirty`` (whether
that tree had uncommitted changes to tracked files), ``date`` and ``machine`` (``hardware.cpu_description``
where the input does not name its own). Entries go in newest first; the file is replaced atomically (a temp
file beside it, then a rename), so a crash leaves the old file whole. ``scripts/results_tables.py`` renders
the docs' figures from it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specheads.errors import ConfigError, InputNotFoundError, UserError
from specheads.run_summary import MAIN_JOB, serve_record


class RecordError(UserError):
    """A file given to ``specheads record`` is unreadable, corrupt or not one of the outputs it records."""


KINDS = {"main_job": "runs", "serve": "serve_runs", "test_suite": "test_runs", "export_check": "export_checks",
         "collect_backends": "backend_runs", "train_bench": "train_benches", "eval_bench": "eval_benches",
         "long_row_bench": "long_row_benches",
         "trainer_compare": "trainer_comparisons"}
PEERS = ("speculators", "modelopt", "specforge")  # the toolkits whose trainers a trainer_compare report runs
WHAT_IT_READS = ("a run_summary.json (specheads run), a serve_report.json (specheads serve-eval), a pytest log "
                 "(its closing 'N passed ... in X s' line), the output of scripts/check_engine_loaders.py or the "
                 "report of scripts/bench/bench_backends.py, bench_train.py, ttt_memory.py, bench_evaluate.py or "
                 "scripts/peers/compare_<peer>.py "
                 "(speculators, modelopt, specforge)")
PYTEST_LINE = re.compile(r"^=*\s*((?:\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)"
                         r"(?:, )?)+) in ([\d.]+)s\b", re.M)
CHECK_LINE = re.compile(r"^(ok|skip|FAIL)\s{1,4}(.{18}) (.{8}) (.{14}) (.+?): (.*)$")
CHECK_TOTAL = re.compile(r"^(\d+) ok/skipped, (\d+) failed$", re.M)


@dataclass
class Checkout:
    """Where the measured code came from: the commit and whether the tree differed from it."""

    commit: str
    dirty: bool


def checkout_state(repo: str | Path) -> Checkout:
    """``git rev-parse HEAD`` of ``repo`` and whether a tracked file differs from it (untracked outputs such as
    ``runs/`` do not count)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                                  text=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError) as e:
            raise RecordError(f"{repo} is not a git checkout (git {' '.join(args)} failed): the record needs the "
                              "commit that was measured; give --checkout DIR") from e
    return Checkout(commit=git("rev-parse", "HEAD"), dirty=bool(git("status", "--porcelain", "--untracked-files=no")))


def read_input(path: str | Path) -> tuple[str, object]:
    """(kind, parsed contents) of a file ``specheads record`` accepts; a ``RecordError`` naming the file otherwise."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputNotFoundError(f"{path}: no such file ({WHAT_IT_READS} expected)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: cannot be read as text ({e})") from None
    # a log may open with "[" too (CI's "[setup] ..." lines): JSON by its name, or by a "{" / "[" opening that is
    # not a log's, i.e. when no pytest line says otherwise
    if path.suffix == ".json" or (text.lstrip()[:1] in ("{", "[") and not PYTEST_LINE.search(text)):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise RecordError(f"{path}: corrupt JSON ({e}); expected {WHAT_IT_READS}") from None
        kind = _json_kind(data)
        if kind is None:
            raise RecordError(f"{path}: a JSON file, but not one specheads record reads; expected {WHAT_IT_READS}")
        return kind, data
    if CHECK_TOTAL.search(text):
        return "export_check", text
    if PYTEST_LINE.search(text):
        return "test_suite", text
    raise RecordError(f"{path}: neither a pytest log (no 'N passed ... in X s' line) nor a loader check's output; "
                      f"expected {WHAT_IT_READS}")


def _json_kind(data) -> str | None:
    if isinstance(data, dict) and "stages_s" in data and "total_min" in data:
        return "main_job"
    if isinstance(data, dict) and "engine" in data and ("domains" in data or "refused" in data):
        return "serve"
    if isinstance(data, dict) and data.get("kind") == "collect_backends" and {"collect", "regenerate"} <= set(data):
        return "collect_backends"
    if (isinstance(data, dict) and data.get("kind") in ("train_bench", "eval_bench", "long_row_bench")
            and isinstance(data.get("rows"), list)):
        return data["kind"]
    if (isinstance(data, dict) and data.get("kind") in ("trainer_compare", "speculators_compare")
            and isinstance(data.get("runs"), list)):
        return "trainer_compare"
    rows = data.get("checks") if isinstance(data, dict) else data
    if isinstance(rows, list) and rows and all(isinstance(r, dict) and {"check", "ok"} <= set(r) for r in rows):
        return "export_check"
    return None


def method_key(name: str) -> str:
    """The results table's method key of an evaluation row's name: ``eagle3-auto`` -> ``eagle3``,
    ``eagle3-auto+ngram4+x1`` -> ``eagle3+lookup+table``, ``eagle3-vllm`` -> ``eagle3-vllm``, ``ngram-chain4`` -> ``ngram``,
    ``dspark-sched0.5`` -> ``dspark-sched``."""
    head = re.split(r"[-+]", name)[0]
    if head == "ngram":
        return "ngram"
    if name.startswith(f"{head}-sched"):  # DSpark verifying as its confidence head schedules
        return f"{head}-sched"
    if name.endswith("-vllm"):
        return f"{head}-vllm"
    if "+ngram" in name:
        return f"{head}+lookup+table" if re.search(r"\+x[\d.]+", name) else f"{head}+lookup"
    return head


def main_job_entry(summary: dict) -> dict:
    """A ``runs`` entry from ``run_summary.json`` (``specheads.run_summary.summarize``)."""
    head = summary.get("head", "eagle3")
    stages = summary.get("stages_s") or {}
    out: dict = {"kind": "main_job", "head": head, "machine": summary.get("machine"), "total_min": summary["total_min"],
                 "stages_s": {k: round(v) for k, v in stages.items() if k in MAIN_JOB}}
    if stages.get("serve") is not None:
        out["serve_s"] = round(stages["serve"])
    collect = summary.get("collect") or {}
    if collect.get("tokens_per_s_with_startup"):
        out["collect_tokens_per_s"] = collect["tokens_per_s_with_startup"]
    train = summary.get("train") or {}
    if train:
        out["train"] = {head: {k: (round(train[k]) if k.startswith("peak") else train[k])
                               for k in ("steps", "tokens_per_s", "heldout_step0_top1", "peak_rss_mb", "peak_anon_mb")
                               if train.get(k) is not None}}
    if collect.get("store_id"):
        out["store"] = collect["store_id"]
    if collect.get("engine"):  # who ran collection's forwards: hf, vllm, or captured (read from regeneration's capture)
        out["collect_engine"] = collect["engine"]
    if summary.get("settings"):
        out["settings"] = summary["settings"]
    ev = summary.get("evaluate") or {}
    if ev.get("lossless"):
        out["lossless"] = ev["lossless"]
    if ev.get("prompts"):
        out["eval_set"] = f"{ev['prompts']} prompts, {ev.get('max_new_tokens')} new tokens, batch 1"
    if ev.get("target_dtype"):  # the dtype the evaluation ran the target at (the README's results state it)
        out["target_dtype"] = str(ev["target_dtype"]).removeprefix("torch.")
    if summary.get("methods"):
        out["methods"] = [{"method": method_key(m["name"]), **m} for m in summary["methods"]]
    if summary.get("per_domain"):
        out["per_domain"] = summary["per_domain"]
    served = summary.get("serve")
    if served and not served.get("refused"):
        out["served"] = _served(served, f"{head}-vllm")
    elif served:
        out["served"] = {"engine": served["engine"], "refused": served["refused"]}
    return out


def _served(s: dict, method: str) -> dict:
    """``run_summary.serve_record`` in the results file's names (``served`` of a run, or a ``serve_runs`` entry)."""
    return {"engine": s["engine"], "method": method, "k": s["num_speculative_tokens"], "prompts": s["prompts"],
            "tau": s["tau"], "tau_evaluator": s.get("tau_evaluator"), "flagged": s.get("flagged"),
            "reach": s.get("reach"), "tokens_per_s": s.get("tokens_per_s"),
            "plain_tokens_per_s": s.get("plain_tokens_per_s"), "speedup": s.get("speedup"),
            "identical": s.get("greedy_identical")}


def serve_entry(report: dict) -> dict:
    """A ``serve_runs`` entry from ``serve_report.json``: the engine's figures over all prompts."""
    try:
        s = serve_record(report)
    except (KeyError, TypeError) as e:
        raise RecordError(f"serve_report.json lacks {e}: not a finished serve-eval report") from None
    if s.get("refused"):
        return {"kind": "serve", "engine": s["engine"], "refused": s["refused"], "machine": report.get("machine")}
    return {"kind": "serve", **_served(s, "eagle3-vllm"), "machine": report.get("machine")}


def test_suite_entry(log: str, wall_s: float | None) -> dict:
    """A ``test_runs`` entry from a pytest log's last closing line (and the whole command's wall time)."""
    *_, last = PYTEST_LINE.finditer(log)
    counts = {word.rstrip("s") if word.startswith(("error", "warning")) else word: int(n)
              for n, word in re.findall(r"(\d+) (\w+)", last.group(1))}
    out = {"kind": "test_suite", "passed": counts.get("passed", 0), "skipped": counts.get("skipped", 0),
           "failed": counts.get("failed", 0) + counts.get("error", 0),
           "tests_min": round(float(last.group(2)) / 60, 1)}
    if wall_s is not None:
        out["total_min"] = round(wall_s / 60, 1)
    return out


def export_check_entry(contents) -> dict:
    """An ``export_checks`` entry from the loader check's rows (its printed lines, or JSON rows with ``check``
    and ``ok``: true, false, or null for skipped)."""
    if isinstance(contents, str):
        rows = [{"ok": {"ok": True, "skip": None, "FAIL": False}[m[1]], "engine": m[2].strip(), "head": m[3].strip(),
                 "layout": m[4].strip(), "check": m[5].strip(), "detail": m[6].strip()}
                for m in map(CHECK_LINE.match, contents.splitlines()) if m]
    else:
        rows = contents["checks"] if isinstance(contents, dict) else contents
    return {"kind": "export_check", "checks": rows, "ok": sum(r["ok"] is True for r in rows),
            "skipped": sum(r["ok"] is None for r in rows), "failed": sum(r["ok"] is False for r in rows)}


def _round(x, nd: int):
    return None if x is None else round(float(x), nd)


def trainer_compare_entry(report: dict) -> dict:
    """A ``trainer_comparisons`` entry from a ``compare_<peer>.py --json`` report: the peer toolkit (``peer``; a
    report without one is compare_speculators.py's, kind ``speculators_compare``), the drafter family both trainers
    trained (``method``; EAGLE-3 where the report names none), the budget and settings, the
    store's training rows, and per run (setting x trainer) its training figures, held-out figures, the
    evaluator's α / τ per domain for each shape and, where served, the engine's τ per domain (rounded: 4 places
    for α and τ, whole tokens/s and MiB)."""
    peer = report.get("peer", "speculators")
    if peer not in PEERS:
        raise RecordError(f"a trainer comparison against {peer!r}: the peers recorded are {', '.join(PEERS)}")
    try:
        runs = [_compare_run(r) for r in report["runs"]]
        return {"kind": "trainer_compare", "peer": peer, "method": report.get("method", "eagle3"),
                "machine": report.get("machine"), "target": report["target"],
                "versions": report.get("versions"), "budget": report["budget"], "settings": report["settings"],
                "store": report.get("store"), "evaluation": report.get("evaluation"),
                "serving": report.get("serving"), "runs": runs}
    except (KeyError, TypeError) as e:
        raise RecordError(f"compare_{peer} report lacks {e}: not a finished --json report") from None


def _compare_run(r: dict) -> dict:
    out = {"setting": r["setting"], "trainer": r["trainer"], "rc": r["rc"], "steps": r["steps"], "tokens": r["tokens"],
           "train_s": _round(r.get("train_s"), 1), "tokens_per_s": _round(r.get("tokens_per_s"), 0),
           "steady_tokens_per_s": _round(r.get("steady_tokens_per_s"), 0),
           "peak_rss_mib": _round(r.get("peak_rss_mib"), 0), "peak_anon_mib": _round(r.get("peak_anon_mib"), 0),
           "first_loss": _round(r.get("first_loss"), 4), "last_loss": _round(r.get("last_loss"), 4)}
    if r.get("heldout"):
        out["heldout"] = {k: _round(v, 4) for k, v in r["heldout"].items()}
    ev = r.get("eval")
    if ev:
        out["eval"] = {"prompts": ev.get("prompts"), "max_new_tokens": ev.get("max_new_tokens"),
                       "target_dtype": ev.get("target_dtype"),
                       "methods": [{"name": m["name"], "shape": m.get("shape"), "lossless": m.get("lossless"),
                                    "domains": {d: {"alpha": _round(v.get("alpha"), 4), "tau": _round(v.get("tau"), 4),
                                                    "prompts": v.get("prompts")} for d, v in m["domains"].items()}}
                                   for m in ev["methods"]]}
    sv = r.get("serve")
    if sv:
        out["serve"] = {"prompts": sv.get("prompts"), "engine": sv.get("engine"), "head_source": sv.get("head_source"),
                        "domains": {d: {"tau": _round(v.get("tau"), 4), "tau_evaluator": _round(v.get("tau_evaluator"), 4),
                                        "identical": v.get("identical"), "compared": v.get("compared"),
                                        "speedup": _round(v.get("speedup"), 3)} for d, v in sv["domains"].items()}}
    return out


def make_entry(path: str | Path, checkout: Checkout, *, wall_s: float | None = None, machine: str | None = None,
               date: str | None = None, run: str | None = None, what: str | None = None,
               fresh_clone: bool | None = None) -> tuple[str, dict]:
    """(the list it belongs in, the entry) for ``path``, stamped with ``checkout``, the date and the machine."""
    if date is not None:
        try:
            dt.date.fromisoformat(date)
        except ValueError:
            raise ConfigError(f"--date {date}: give a calendar date as YYYY-MM-DD (default: today)") from None
    if wall_s is not None and not wall_s > 0:
        raise ConfigError(f"--wall-s {wall_s}: give the command's wall time in seconds, > 0")
    kind, contents = read_input(path)
    build = {"main_job": main_job_entry, "serve": serve_entry, "export_check": export_check_entry,
             "collect_backends": dict, "train_bench": dict, "eval_bench": dict,
             "long_row_bench": dict, "trainer_compare": trainer_compare_entry}
    entry = test_suite_entry(contents, wall_s) if kind == "test_suite" else build[kind](contents)
    if machine or not entry.get("machine"):
        from specheads.hardware import cpu_description

        entry["machine"] = machine or cpu_description()
    stamp = {"date": date or dt.date.today().isoformat(), "commit": checkout.commit, "dirty": checkout.dirty}
    extra = {k: v for k, v in (("run", run), ("what", what), ("fresh_clone", fresh_clone)) if v is not None}
    return KINDS[kind], {"kind": entry.pop("kind"), **stamp, **entry, **extra}  # --run/--what over the input's


def load_results(path: str | Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputNotFoundError(f"{path}: no results file to append to (docs/benchmarks.json of a checkout)") from None
    except (OSError, ValueError) as e:
        raise RecordError(f"{path}: corrupt results file ({e}); restore it with git checkout") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise RecordError(f"{path}: not a results file (no 'runs' list)")
    return data


def write_results(path: str | Path, data: dict) -> None:
    """Replace ``path`` atomically: a temp file in the same folder, flushed, then renamed over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def record(path: str | Path, results: str | Path, checkout: Checkout, *, new_ok: bool = False, **stamp) -> dict:
    """Append ``path``'s entry to the results file (newest first) and return it; with ``new_ok``, a results file
    that does not exist yet starts empty (a user's own file, named by ``--into``)."""
    data = {"runs": []} if new_ok and not Path(results).exists() else load_results(results)
    key, entry = make_entry(path, checkout, **stamp)
    data.setdefault(key, []).insert(0, entry)
    write_results(results, data)
    return entry
