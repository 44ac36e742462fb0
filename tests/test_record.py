"""specheads record: a run_summary.json, serve_report.json, pytest log or loader-check output becomes one entry
of docs/benchmarks.json, stamped with the checkout's commit (and dirtiness), date and machine; bad inputs are
one-line user errors and leave the file as it was."""

from __future__ import annotations

import json
import subprocess

import pytest

from specheads.cli import main
from specheads.record import Checkout, RecordError, checkout_state, method_key, record

CHECKOUT = Checkout(commit="0123456789abcdef0123456789abcdef01234567", dirty=False)
SUMMARY = {"machine": "CPU X (2 cores, avx2, bf16 kernels no)", "date": "2026-12-04", "head": "eagle3",
           "stages_s": {"prepare": 9.4, "collect": 300.0, "train": 460.0, "evaluate": 380.0, "export": 5.0, "serve": 170.0},
           "total_min": 19.2, "collect": {"tokens_per_s_with_startup": 246, "store_id": "0123456789ab"},
           "train": {"steps": 590, "tokens_per_s": 2723.0, "heldout_step0_top1": 0.32, "peak_rss_mb": 2100.4},
           "evaluate": {"prompts": 9, "max_new_tokens": 32, "lossless": "exact"},
           "methods": [{"name": "eagle3-auto", "shape": "chain1", "tau": 1.25, "alpha": 0.27, "speedup": 0.86},
                       {"name": "eagle3-auto+ngram4+x1", "shape": "fan2", "tau": 1.6, "alpha": 0.44, "speedup": 1.01}],
           "serve": {"engine": "vLLM 0.32.0", "prompts": 9, "num_speculative_tokens": 3, "tau": 1.31,
                     "tau_evaluator": 1.31, "flagged": False, "reach": [0.28, 0.04, 0.0], "tokens_per_s": 18.1,
                     "plain_tokens_per_s": 22.2, "speedup": 0.81, "greedy_identical": "9/9"}}
SERVE = {"engine": {"name": "vLLM", "version": "0.32.0"}, "num_prompts": 12, "num_speculative_tokens": 3,
         "domains": {"all": {"spec": {"tau": 1.35, "reach": [0.3, 0.05, 0.0], "tokens_per_s": 18.6},
                             "plain": {"tokens_per_s": 21.0}, "speedup": 0.89, "identical": 12, "compared": 12}}}
LOG = "collected 1207 items\n....\n===== 1190 passed, 17 skipped, 3 warnings in 918.30s (0:15:18) =====\n"
CHECK = ("ok    vllm 0.32.0        Medusa   vllm/          MedusaConfig + Medusa.load_weights: 15/15 parameters\n"
         "skip  sglang             DFlash   sglang/        loader pieces: no --sglang-wheel given\n"
         "FAIL  vllm 0.33.0        EAGLE-3  speculators/   SpeculatorsConfig conversion: aux ids (2, 2, 1)\n"
         "2 ok/skipped, 1 failed\n")


@pytest.fixture
def results(tmp_path):
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps({"about": "x", "runs": [{"kind": "main_job", "date": "2026-12-01"}], "test_runs": []}))
    return path


def _write(tmp_path, name, contents):
    path = tmp_path / name
    path.write_text(contents if isinstance(contents, str) else json.dumps(contents))
    return path


def test_a_run_summary_becomes_a_main_job_entry_newest_first(tmp_path, results):
    entry = record(_write(tmp_path, "run_summary.json", SUMMARY), results, CHECKOUT, fresh_clone=True, what="main job")
    data = json.loads(results.read_text())
    assert data["runs"][0] == entry and data["runs"][1]["date"] == "2026-12-01"
    assert entry["commit"] == CHECKOUT.commit and entry["dirty"] is False and entry["fresh_clone"] is True
    assert entry["machine"] == SUMMARY["machine"] and entry["total_min"] == 19.2 and entry["serve_s"] == 170
    assert entry["stages_s"] == {"prepare": 9, "collect": 300, "train": 460, "evaluate": 380, "export": 5}
    assert [m["method"] for m in entry["methods"]] == ["eagle3", "eagle3+lookup+table"]
    assert entry["served"]["tau"] == 1.31 and entry["served"]["identical"] == "9/9"
    assert entry["served"]["method"] == "eagle3-vllm"
    assert entry["store"] == "0123456789ab" and entry["train"]["eagle3"]["peak_rss_mb"] == 2100
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # the temp file was renamed


def test_a_run_summary_keeps_the_dtype_its_evaluation_ran_the_target_at(tmp_path, results):
    """The README's results state each run's prompt count and target dtype from its entry."""
    summary = {**SUMMARY, "evaluate": {**SUMMARY["evaluate"], "target_dtype": "torch.bfloat16"}}
    entry = record(_write(tmp_path, "run_summary.json", summary), results, CHECKOUT)
    assert entry["eval_set"] == "9 prompts, 32 new tokens, batch 1" and entry["target_dtype"] == "bfloat16"
    assert "target_dtype" not in record(_write(tmp_path, "run_summary.json", SUMMARY), results, CHECKOUT)


def test_a_serve_report_a_test_log_and_a_loader_check_are_recorded(tmp_path, results):
    serve = record(_write(tmp_path, "serve_report.json", SERVE), results, CHECKOUT, machine="box")
    assert (serve["kind"], serve["tau"], serve["speedup"], serve["identical"], serve["machine"]) == \
        ("serve", 1.35, 0.89, "12/12", "box")
    tests = record(_write(tmp_path, "ci.log", LOG), results, CHECKOUT, wall_s=1086, machine="box")
    assert (tests["passed"], tests["skipped"], tests["failed"], tests["tests_min"], tests["total_min"]) == \
        (1190, 17, 0, 15.3, 18.1)
    check = record(_write(tmp_path, "check.txt", CHECK), results, CHECKOUT, machine="box")
    assert (check["ok"], check["skipped"], check["failed"]) == (1, 1, 1)
    assert check["checks"][0] == {"ok": True, "engine": "vllm 0.32.0", "head": "Medusa", "layout": "vllm/",
                                  "check": "MedusaConfig + Medusa.load_weights", "detail": "15/15 parameters"}
    data = json.loads(results.read_text())
    assert [len(data[k]) for k in ("serve_runs", "test_runs", "export_checks")] == [1, 1, 1]


@pytest.mark.parametrize("name, contents, words", [
    ("run_summary.json", '{"stages_s": {', "corrupt JSON"),
    ("report.json", {"methods": [], "num_prompts": 12}, "not one specheads record reads"),
    ("notes.txt", "nothing measured here\n", "neither a pytest log"),
])
def test_a_corrupt_or_wrong_kind_input_is_a_one_line_error_and_changes_nothing(tmp_path, results, name, contents,
                                                                                words):
    before = results.read_text()
    with pytest.raises(RecordError, match=words):
        record(_write(tmp_path, name, contents), results, CHECKOUT)
    assert results.read_text() == before


def test_the_command_stamps_the_checkouts_commit_and_dirtiness(tmp_path, capsys):
    repo = tmp_path / "clone"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "benchmarks.json").write_text(json.dumps({"runs": [], "test_runs": []}))
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert checkout_state(repo) == Checkout(head, False)
    (repo / "docs" / "benchmarks.json").write_text(json.dumps({"runs": [], "test_runs": [], "x": 1}))
    assert checkout_state(repo).dirty
    log = _write(tmp_path, "ci.log", LOG)
    with pytest.raises(SystemExit) as exit_:
        main(["record", str(log), "--checkout", str(repo), "--machine", "box", "--date", "2026-12-04"])
    assert exit_.value.code == 0 and f"commit {head[:7]} (dirty tree)" in capsys.readouterr().out
    entry = json.loads((repo / "docs" / "benchmarks.json").read_text())["test_runs"][0]
    assert (entry["commit"], entry["dirty"], entry["date"], entry["machine"]) == (head, True, "2026-12-04", "box")
    with pytest.raises(SystemExit) as exit_:
        main(["record", str(tmp_path / "missing.json"), "--checkout", str(repo)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "missing.json" in err


def test_into_a_results_file_of_ones_own_starts_it_and_appends_newest_first(tmp_path, capsys):
    repo = tmp_path / "clone"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "x"], check=True)
    mine = tmp_path / "mine" / "results.json"
    mine.parent.mkdir()
    summary = _write(tmp_path, "run_summary.json", json.dumps({**SUMMARY, "settings": {"train": ["lr=1e-3"]}}))
    for date in ("2026-12-04", "2026-12-05"):
        with pytest.raises(SystemExit) as exit_:
            main(["record", str(summary), "--checkout", str(repo), "--into", str(mine), "--date", date])
        assert exit_.value.code == 0
    runs = json.loads(mine.read_text())["runs"]
    assert [r["date"] for r in runs] == ["2026-12-05", "2026-12-04"]
    assert runs[0]["settings"] == {"train": ["lr=1e-3"]} and runs[0]["machine"] == SUMMARY["machine"]
    assert not (repo / "docs").exists()  # the project's own record is not started behind the user's back
    capsys.readouterr()


def test_method_keys_follow_the_evaluation_row_names():
    assert [method_key(n) for n in ("eagle3-auto", "eagle3-auto+ngram4+x1", "eagle3-auto+ngram4", "eagle3-vllm",
                                    "ngram-chain4", "dflash-chain7", "dspark-chain7", "dspark-sched0.5")] == \
        ["eagle3", "eagle3+lookup+table", "eagle3+lookup", "eagle3-vllm", "ngram", "dflash", "dspark", "dspark-sched"]


def _results_tables():
    """scripts/results_tables.py as a module, and the repository's root."""
    from pathlib import Path

    from tests.conftest import load_script

    return load_script("scripts/results_tables.py"), Path(__file__).resolve().parents[1]


def test_a_recorded_run_is_what_the_docs_render(tmp_path):
    rt, repo = _results_tables()
    results = tmp_path / "benchmarks.json"
    results.write_text((repo / "docs" / "benchmarks.json").read_text(encoding="utf-8"), encoding="utf-8")
    record(_write(tmp_path, "run_summary.json", {**SUMMARY, "date": "2099-01-01"}), results, CHECKOUT,
           fresh_clone=True, date="2099-01-01")
    data = rt.load(results)
    assert "2099-01-01, commit `0123456` (" not in rt.results_table(data)  # clean tree: no dirty mark
    assert "| 1.60 | 0.44 | 1.01× |" in rt.results_table(data) and "2099-01-01, commit `0123456`" in rt.results_table(data)
    assert "τ 1.31 against the evaluator's 1.31" in rt.served_line(data) and "commit `0123456`" in rt.served_line(data)
    # the history's engine cell names the chain the engine drafted (the serve stage picks it per run)
    assert "τ 1.31, 0.81×, identical 9/9 (vLLM 0.32.0, chain 3) |" in rt.history_table(data)


def test_a_ci_log_opening_with_a_bracketed_line_is_read_as_a_test_log(tmp_path, results):
    """.ci/run's log opens with "[setup] ..." lines: a pytest log still, not corrupt JSON."""
    log = "[setup] installing torch==2.13.0\n[setup] done in 105 s\n" + LOG
    tests = record(_write(tmp_path, "ci.log", log), results, CHECKOUT, wall_s=825, machine="box")
    assert (tests["kind"], tests["passed"], tests["skipped"]) == ("test_suite", 1190, 17)


def test_heads_recorded_on_one_store_render_head_to_head(tmp_path):
    """docs/methods.md: the newest record of each head on the newest store two heads share; each head's own rows
    (not its lookup or vLLM-profile rows), the n-gram baseline once, and τ per domain by drafter."""
    rt, repo = _results_tables()
    results = tmp_path / "benchmarks.json"
    results.write_text(json.dumps({"about": "x", "runs": [], "test_runs": []}))
    assert rt.head_to_head(rt.load(results)).startswith("(no two heads")

    def run(head, store, tau, date, rows=None):
        names = rows or [f"{head}-chain4"]
        summary = {**SUMMARY, "head": head, "date": date, "collect": {"store_id": store},
                   "train": {"steps": 10, "tokens_per_s": 500.0, "peak_rss_mb": 1500.0},
                   "methods": [{"name": n, "shape": "chain4", "tau": tau, "alpha": 0.3, "speedup": 0.9,
                                "gpu_speedup_pred": 1.4} for n in names] +
                              [{"name": "ngram-chain4", "shape": "chain4", "tau": 1.28, "alpha": 0.4, "speedup": 1.0}],
                   "per_domain": {"T": 0.0, "columns": [*names, "ngram-chain4"],
                                  "rows": [["code", *[tau + 0.5] * len(names), 2.0], ["all", *[tau] * len(names), 1.28]]}}
        record(_write(tmp_path, "run_summary.json", summary), results, CHECKOUT, date=date)

    run("eagle3", "aaaa", 1.5, "2099-01-01")
    assert rt.head_to_head(rt.load(results)).startswith("(no two heads")  # one head alone compares with nothing
    run("dflash", "bbbb", 1.9, "2099-01-02")  # another store
    assert rt.head_to_head(rt.load(results)).startswith("(no two heads")
    run("dspark", "aaaa", 1.7, "2099-01-03", rows=["dspark-chain7", "dspark-sched0.5", "dspark-chain7+ngram4"])
    text = rt.head_to_head(rt.load(results))
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| drafter")]
    table = [r.split(" | ")[0][2:] for r in rows[:4]]
    assert table == ["eagle3-chain4", "dspark-chain7", "dspark-sched0.5", "ngram-chain4 (no training)"], rows
    assert "| 1.70 | 0.30 | 0.90× | 1.40× | 10 | 500 | 1,500 | exact | 2099-01-03" in text
    assert "| code | 2.00 | 2.20 | 2.20 |" in text and "| all | 1.50 | 1.70 | 1.70 |" in text
    run("eagle3", "aaaa", 1.6, "2099-01-04")  # a newer EAGLE-3 record on the store replaces the older
    assert "| eagle3-chain4 | chain4 | 1.60 |" in rt.head_to_head(rt.load(results))
    # a head trained with other settings on the store: its own rows, after the head's default ones
    summary = {**SUMMARY, "head": "dspark", "date": "2099-01-05", "collect": {"store_id": "aaaa"},
               "settings": {"train": ["method.loss=dpace"]},
               "methods": [{"name": "dspark-chain7", "shape": "chain7", "tau": 1.9, "alpha": 0.3, "speedup": 0.9}],
               "per_domain": {"T": 0.0, "columns": ["dspark-chain7"], "rows": [["code", 2.4], ["all", 1.9]]}}
    entry = record(_write(tmp_path, "run_summary.json", summary), results, CHECKOUT, date="2099-01-05")
    assert entry["settings"] == {"train": ["method.loss=dpace"]}
    text = rt.head_to_head(rt.load(results))
    rows = [ln.split(" | ")[0][2:] for ln in text.splitlines() if ln.startswith("| ") and " | chain" in ln]
    assert rows == ["eagle3-chain4", "dspark-chain7", "dspark-sched0.5", "dspark-chain7 (method.loss=dpace)",
                    "ngram-chain4 (no training)"], rows
    assert "| code | 2.10 | 2.20 | 2.20 | 2.40 |" in text


def test_domino_and_the_suffix_baseline_take_rows_in_the_head_to_head(tmp_path):
    """Domino is a head of the table like the others, and every baseline with no training (n-gram, suffix decoding)
    gets its row once, in that order, from the first run that evaluated it."""
    rt, _ = _results_tables()
    results = tmp_path / "benchmarks.json"
    results.write_text(json.dumps({"about": "x", "runs": [], "test_runs": []}))
    base = [{"name": "suffix-chain4", "shape": "chain4", "tau": 1.31, "alpha": 0.5, "speedup": 1.02},
            {"name": "ngram-chain4", "shape": "chain4", "tau": 1.28, "alpha": 0.4, "speedup": 1.0}]
    for head, name, date in (("eagle3", "eagle3-auto", "2099-01-01"), ("domino", "domino-chain7", "2099-01-02")):
        summary = {**SUMMARY, "head": head, "date": date, "collect": {"store_id": "cccc"},
                   "methods": [{"name": name, "shape": "chain4", "tau": 1.4, "alpha": 0.3, "speedup": 0.9}, *base],
                   "per_domain": {"T": 0.0, "columns": [name], "rows": [["all", 1.4]]}}
        record(_write(tmp_path, "run_summary.json", summary), results, CHECKOUT, date=date)
    text = rt.head_to_head(rt.load(results))
    rows = [ln.split(" | ")[0][2:] for ln in text.splitlines() if ln.startswith("| ") and " | chain" in ln]
    assert rows == ["eagle3-auto", "domino-chain7", "ngram-chain4 (no training)", "suffix-chain4 (no training)"], rows
    assert "| suffix-chain4 (no training) | chain4 | 1.31 | 0.50 | 1.02× |" in text


def test_the_readme_results_take_a_heads_default_settings_only(tmp_path):
    rt, repo = _results_tables()
    results = tmp_path / "benchmarks.json"
    results.write_text((repo / "docs" / "benchmarks.json").read_text(encoding="utf-8"), encoding="utf-8")
    row = {"name": "dflash-chain7", "shape": "chain7", "alpha": 0.3, "speedup": 0.9}
    default = {**SUMMARY, "head": "dflash", "date": "2099-01-01", "methods": [{**row, "tau": 8.88}]}
    variant = {**default, "date": "2099-01-02", "settings": {"train": ["method.loss=dpace"]},
               "methods": [{**row, "tau": 9.99}]}
    record(_write(tmp_path, "run_summary.json", default), results, CHECKOUT, date="2099-01-01")
    record(_write(tmp_path, "run_summary.json", variant), results, CHECKOUT, date="2099-01-02")
    table = rt.results_table(rt.load(results))
    assert "| 8.88 |" in table and "9.99" not in table
    engine = {**SUMMARY, "date": "2099-01-03", "settings": {"collect": ["engine=vllm"]}}  # eagle3, another stage's
    record(_write(tmp_path, "run_summary.json", engine), results, CHECKOUT, date="2099-01-03", fresh_clone=True)
    assert rt.latest_main_job(rt.load(results))["date"] != "2099-01-03"  # the README's main job has no override
    # engine=auto took vLLM (its venv was set up): not the README's two commands either
    auto = {**SUMMARY, "date": "2099-01-04",
            "collect": {**SUMMARY["collect"], "engine": "vllm", "store_id": "abcdef012345"}}
    entry = record(_write(tmp_path, "run_summary.json", auto), results, CHECKOUT, date="2099-01-04", fresh_clone=True)
    assert entry["collect_engine"] == "vllm" and rt.latest_main_job(rt.load(results))["date"] != "2099-01-04"
    plain = {**SUMMARY, "date": "2099-01-05",
             "collect": {**SUMMARY["collect"], "engine": "hf", "store_id": "fedcba987654"}}
    record(_write(tmp_path, "run_summary.json", plain), results, CHECKOUT, date="2099-01-05", fresh_clone=True)
    assert rt.latest_main_job(rt.load(results))["date"] == "2099-01-05"
    held = {**plain, "date": "2099-01-06", "collect": {**plain["collect"], "store_id": "0123456789ab"}}
    record(_write(tmp_path, "run_summary.json", held), results, CHECKOUT, date="2099-01-06", fresh_clone=True,
           run="bash scripts/setup.sh && ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/specheads run")
    assert rt.latest_main_job(rt.load(results))["date"] == "2099-01-05"  # a CPU held to AVX2: not the README's run


BACKENDS = {"kind": "collect_backends", "target": "smollm2", "dtype": "bfloat16", "samples": 200, "max_length": 512,
            "collect": {"hf": {"wall_s": 80.2, "peak_rss_gb": 1.9, "tokens": 77242, "collect_s": 68.6,
                               "tokens_per_s": 1126, "tokens_per_wall_s": 963},
                        "vllm": {"wall_s": 70.1, "peak_rss_gb": 4.8, "tokens": 77242, "collect_s": 40.0,
                                 "tokens_per_s": 1931, "tokens_per_wall_s": 1101}, "vllm_over_hf": 1.71},
            "regenerate": {"hf_static": {"wall_s": 131.6, "peak_rss_gb": 1.1, "answer_tokens": 9958,
                                         "answer_tokens_per_wall_s": 75.7},
                           "vllm_captured": {"wall_s": 60.3, "peak_rss_gb": 5.4, "answer_tokens": 10010,
                                             "answer_tokens_per_wall_s": 166.0},
                           "collect_from_capture": {"wall_s": 9.1, "peak_rss_gb": 0.7, "tokens": 14743,
                                                    "collect_s": 0.5, "tokens_per_s": 29486, "tokens_per_wall_s": 1620},
                           "vllm_over_hf": 2.19}}


def test_a_backends_benchmark_is_recorded_and_rendered_in_the_collect_guide(tmp_path, results):
    rt, _ = _results_tables()
    entry = record(_write(tmp_path, "backends.json", BACKENDS), results, CHECKOUT, machine="box", date="2099-01-01")
    assert entry["kind"] == "collect_backends" and entry["commit"] == CHECKOUT.commit
    data = rt.load(results)
    assert data["backend_runs"][0]["collect"]["vllm"]["tokens_per_s"] == 1931
    table = rt.backends(data)
    assert "| collection, vLLM (`engine=vllm`) | 70.1 | 77242 | 1931 | 4.80 |" in table
    assert "| regeneration + capture, vLLM (`regenerate=engine`) | 60.3 | 10010 answer | 166.0 (per wall s) | 5.40 |" in table
    assert "commit `0123456` on 2099-01-01, box" in table and "dtype bfloat16" in table
    assert "No record yet" in rt.backends({"runs": []})


def _compare_report(**over) -> dict:
    """What ``scripts/peers/compare_speculators.py --json`` writes: one setting, both trainers, both heads evaluated."""
    def run(trainer, steps, rate, acc, taus):
        return {"setting": "bfloat16:ttt1", "trainer": trainer, "rc": 0, "wall_s": 99.0, "peak_rss_mib": 2050.4,
                "peak_anon_mib": 1500.6, "steps": steps, "tokens": 331000, "train_s": 80.04, "tokens_per_s": rate,
                "steady_tokens_per_s": rate + 0.4, "first_loss": 9.87654, "last_loss": 2.34567,
                "command": ["specheads", "train"], "log": "/tmp/x/ours.log", "head_dir": "/tmp/x/ours",
                "heldout": {"loss": 2.5, ("top1_step0" if trainer == "ours" else "full_acc_step0"): acc},
                "eval": {"prompts": 12, "max_new_tokens": 32, "target_dtype": "float32", "wall_s": 120.0,
                         "command": ["specheads", "evaluate"],
                         "methods": [{"name": "eagle3-tree", "shape": "tree(d5,k4,n24)", "lossless": True,
                                      "domains": {"code": {"alpha": 0.61234, "tau": taus[0], "prompts": 2},
                                                  "math": {"alpha": 0.3, "tau": 1.2752613, "prompts": 1},
                                                  "all": {"alpha": 0.51234, "tau": taus[1], "prompts": 12}}}]}}
    report = {"kind": "speculators_compare", "machine": "CPU X (2 cores)", "target": "smollm2",
              "versions": {"torch": "2.13.0", "transformers": "5.25.0", "speculators": "0.9.0"},
              "budget": {"epochs": 1}, "settings": {"draft_vocab_size": 4096, "max_tokens": 2048, "lr": 0.0015,
                                                    "warmup_steps": 10, "threads": 2, "our_args": [],
                                                    "their_args": ["--no-norm-output"]},
              "store": {"num_train": 700, "num_heldout": 16, "train_tokens": 331000},
              "evaluation": {"prompts": ["eval.humaneval=2"], "fixed": ["head_shape=tree"], "extra": []},
              "args": {"features": "/tmp/h2h/features"}, "workdir": "/tmp/x",
              "runs": [run("ours", 180, 4000.2, 0.41, (2.31234, 1.91234)),
                       run("theirs", 165, 1600.0, 0.45, (2.01234, 1.71234))]}
    return {**report, **over}


def test_a_speculators_comparison_is_recorded_without_commands_and_rendered(tmp_path, results):
    rt, _ = _results_tables()
    entry = record(_write(tmp_path, "compare.json", _compare_report()), results, CHECKOUT, date="2099-01-01",
                   run="python scripts/peers/compare_speculators.py --epochs 1 --evaluate")
    assert entry["kind"] == "trainer_compare" and entry["peer"] == "speculators" and entry["commit"] == CHECKOUT.commit
    assert entry["machine"] == "CPU X (2 cores)" and entry["budget"] == {"epochs": 1}
    data = rt.load(results)
    assert data["trainer_comparisons"] == [entry]
    ours, theirs = entry["runs"]
    # figures kept (rounded), this machine's commands, logs and folders left out
    assert "command" not in ours and "log" not in ours and "head_dir" not in ours and "args" not in entry
    assert ours["steady_tokens_per_s"] == 4001 and ours["peak_anon_mib"] == 1501 and ours["last_loss"] == 2.3457
    assert ours["eval"]["methods"][0]["domains"]["all"] == {"alpha": 0.5123, "tau": 1.9123, "prompts": 12}
    assert theirs["heldout"] == {"loss": 2.5, "full_acc_step0": 0.45}

    text = rt.trainer_comparisons(data, "speculators")
    assert "1 epoch over the same 700 training rows (331000 tokens) for each trainer" in text
    assert "commit `0123456`" in text and "speculators 0.9.0" in text
    assert "2 threads; speculators also given `--no-norm-output`;" in text and "ours also given" not in text
    assert "torch 2.13.0 (`python scripts/peers/compare_speculators.py --epochs 1 --evaluate`):" in text
    assert "| bfloat16:ttt1 | ours (specheads) | 180 | 331000 | 4,001 | 4,000 | 2.50× | 2,050 | 1,501 | 2.500 | 0.410 |" in text
    assert "| bfloat16:ttt1 | theirs (speculators) | 165 | 331000 | 1,600 | 1,600 | – |" in text
    assert "12 prompts × 32 new tokens, target float32, batch 1; lossless exact" in text
    assert "| ours bfloat16:ttt1, tree(d5,k4,n24) | theirs bfloat16:ttt1, tree(d5,k4,n24) |" in text
    assert "| code | 0.61 / 2.31 | 0.61 / 2.01 |" in text and "| math | 0.30 / 1.28 |" in text  # rounded once and text.rstrip().endswith("| all | 0.51 / 1.91 | 0.51 / 1.71 |")
    # a time-budget report without evaluation renders its training rows only; the newest per machine and budget
    record(_write(tmp_path, "minutes.json", _compare_report(budget={"minutes": 2.5}, runs=[
        {**r, "eval": None} for r in _compare_report()["runs"]])), results, CHECKOUT, date="2099-01-02")
    text = rt.trainer_comparisons(rt.load(results), "speculators")
    assert text.startswith("**EAGLE-3**: 2099-01-02") and "2.5 minutes of training each" in text
    assert text.count("Acceptance") == 1
    assert "No record yet" in rt.trainer_comparisons({"runs": []}, "speculators")
    other = _compare_report()
    other["runs"][1]["eval"] = {**other["runs"][1]["eval"], "target_dtype": "bfloat16"}
    record(_write(tmp_path, "dtypes.json", other), results, CHECKOUT, date="2099-01-03")
    assert "target bfloat16 / float32 (differs between heads)" in rt.trainer_comparisons(rt.load(results), "speculators")
    default = _compare_report()  # speculators' default recipe: shown beside its head in our architecture
    default["settings"] = {**default["settings"], "their_args": []}
    record(_write(tmp_path, "default.json", default), results, CHECKOUT, date="2099-01-04")
    text = rt.trainer_comparisons(rt.load(results), "speculators")
    assert text.startswith("**EAGLE-3**: 2099-01-04") and "2099-01-03" in text
    assert text.count("speculators also given") == 2


def test_a_comparison_of_another_family_is_its_own_record_beside_eagle3s(tmp_path, results):
    """compare_speculators.py --method peagle|dflash: the family heads its record and keeps it from replacing the
    newest EAGLE-3 one (same machine, budget and flags); the family's matched settings are named."""
    rt, _ = _results_tables()
    record(_write(tmp_path, "eagle3.json", _compare_report()), results, CHECKOUT, date="2099-01-01")
    for method, extra in (("peagle", {"num_depths": 4, "mask_token_id": 2}),
                          ("dflash", {"block_size": 8, "anchors": 32, "mask_token_id": 2})):
        report = _compare_report(method=method)
        report["settings"] = {**report["settings"], **extra}
        report["runs"] = [{**r, "setting": "bfloat16"} for r in report["runs"]]
        entry = record(_write(tmp_path, f"{method}.json", report), results, CHECKOUT, date="2099-01-02")
        assert entry["method"] == method
    entries = rt.load(results)["trainer_comparisons"]
    assert [e["method"] for e in entries] == ["dflash", "peagle", "eagle3"]
    text = rt.trainer_comparisons(rt.load(results), "speculators")
    assert text.index("**DFlash**: 2099-01-02") < text.index("**P-EAGLE**: 2099-01-02") < text.index("**EAGLE-3**")
    assert "the target's whole vocabulary, block size 8, blocks per row (ours) 32, mask token 2, 2048 tokens" in text
    assert "draft vocabulary 4096, depths per forward 4, mask token 2, 2048 tokens per batch" in text
    assert "| bfloat16 | ours (specheads) |" in text
    # DSpark's two rows share a shape: its columns are named by row
    report = _compare_report(method="dspark")
    for r in report["runs"]:
        first = r["eval"]["methods"][0]
        r["eval"] = {**r["eval"], "methods": [{**first, "name": "dspark-chain7", "shape": "chain7"},
                                              {**first, "name": "dspark-sched0.5", "shape": "chain7"}]}
    record(_write(tmp_path, "dspark.json", report), results, CHECKOUT, date="2099-01-03")
    text = rt.trainer_comparisons(rt.load(results), "speculators")
    assert ("| domain | ours bfloat16:ttt1, dspark-chain7 | theirs bfloat16:ttt1, dspark-chain7 | "
            "ours bfloat16:ttt1, dspark-sched0.5 | theirs bfloat16:ttt1, dspark-sched0.5 |") in text


def test_each_peers_comparison_is_rendered_in_its_own_section(tmp_path, results):
    rt, _ = _results_tables()
    report = _compare_report(kind="trainer_compare", peer="modelopt",
                             versions={"torch": "2.13.0", "modelopt": "0.47.0"})
    entry = record(_write(tmp_path, "modelopt.json", report), results, CHECKOUT, date="2099-01-01")
    assert entry["kind"] == "trainer_compare" and entry["peer"] == "modelopt"
    data = rt.load(results)
    text = rt.trainer_comparisons(data, "modelopt")
    assert "modelopt 0.47.0, torch 2.13.0" in text and "| theirs (modelopt) |" in text
    assert "2 threads; modelopt also given `--no-norm-output`;" in text
    assert "No record yet" in rt.trainer_comparisons(data, "speculators")  # not shown as speculators'
    with pytest.raises(RecordError, match="against 'vendorx'"):
        record(_write(tmp_path, "x.json", _compare_report(peer="vendorx")), results, CHECKOUT)


def test_a_comparison_report_without_runs_is_refused(tmp_path, results):
    bad = _write(tmp_path, "compare.json", {"kind": "speculators_compare", "runs": [{"setting": "x"}]})
    with pytest.raises(RecordError, match="not a finished --json report"):
        record(bad, results, CHECKOUT)
    assert "trainer_comparisons" not in json.loads(results.read_text())


def test_a_comparison_with_both_heads_served_records_and_renders_the_engines_figures(tmp_path, results):
    rt, _ = _results_tables()
    report = _compare_report(kind="trainer_compare", peer="speculators",
                             serving={"engine": "vLLM CPU build (specheads serve-eval)", "num_speculative_tokens": 3})
    for run, tau in zip(report["runs"], (1.61234, 1.4)):
        run["serve"] = {"prompts": 12, "engine": "0.32.0", "head_source": "specheads" if tau > 1.5 else "speculators",
                        "wall_s": 200.0, "command": ["specheads", "serve-eval"],
                        "domains": {"code": {"tau": 2.0, "tau_evaluator": 1.9, "identical": 2, "compared": 2,
                                             "speedup": 1.2},
                                    "all": {"tau": tau, "tau_evaluator": 1.55, "identical": 12, "compared": 12,
                                            "speedup": 1.054321, "reach": [0.4, 0.1, 0.0]}}}
    entry = record(_write(tmp_path, "served.json", report), results, CHECKOUT, date="2099-01-01")
    ours, theirs = entry["runs"]
    assert ours["serve"]["domains"]["all"] == {"tau": 1.6123, "tau_evaluator": 1.55, "identical": 12, "compared": 12,
                                               "speedup": 1.054}
    assert "command" not in ours["serve"] and theirs["serve"]["head_source"] == "speculators"
    text = rt.trainer_comparisons(rt.load(results), "speculators")
    assert "Served by vLLM 0.32.0" in text and "theirs as speculators wrote it), greedy chain of 3, 12 prompts" in text
    assert "| all | 1.61 / 1.55 | 1.40 / 1.55 |" in text and "| identical | 12 of 12 | 12 of 12 |" in text
    # a comparison recorded without serving shows no engine table
    record(_write(tmp_path, "plain.json", _compare_report(budget={"minutes": 1})), results, CHECKOUT, date="2099-01-02")
    assert rt.trainer_comparisons(rt.load(results), "speculators").count("Served by vLLM") == 1


@pytest.mark.parametrize("stamp, words", [({"date": "yesterday"}, "--date yesterday: give a calendar date"),
                                          ({"date": "2024-13-45"}, "YYYY-MM-DD"),
                                          ({"wall_s": -5.0}, "--wall-s -5.0")])
def test_a_bad_date_or_wall_time_is_refused_and_changes_nothing(tmp_path, results, stamp, words):
    from specheads.errors import ConfigError

    before = results.read_text()
    with pytest.raises(ConfigError, match=words):
        record(_write(tmp_path, "ci.log", LOG), results, CHECKOUT, **stamp)
    assert results.read_text() == before


def _long_row(method, steps, tokens, mib, cpu_s):
    return {"method": method, "variant": "fused", "tokens": tokens, "steps": steps, "loss_kind": "ttt",
            "mixed_precision": "no", "threads": 2, "loss": 10.5, "seconds": cpu_s / 1.9, "cpu_seconds": cpu_s,
            "set_up_mib": 900, "peak_above_set_up_mib": mib, "dense_mask_mib": 0}


def test_a_long_row_benchmark_is_recorded_and_rendered_with_its_growth_in_the_training_guide(tmp_path, results):
    rt, _ = _results_tables()
    rows = [_long_row("eagle3", 7, 8192, 1000, 40.0), _long_row("eagle3", 7, 16384, 2000, 110.0),
            _long_row("eagle3", 7, 32768, 4100, 230.0), _long_row("dflash", 1, 8192, 300, 10.0),
            _long_row("dflash", 1, 32768, 1200, 80.0)]
    report = {"kind": "long_row_bench", "target": "shape:smollm2-135m", "dtype": "float32", "threads": 2,
              "run": "scripts/bench/ttt_memory.py --json /tmp/r.json", "rows": rows}
    entry = record(_write(tmp_path, "r.json", report), results, CHECKOUT, machine="box", date="2099-01-01",
                   run="scripts/bench/ttt_memory.py --tokens 8192 16384 32768")
    assert entry["kind"] == "long_row_bench" and entry["commit"] == CHECKOUT.commit
    assert entry["run"] == "scripts/bench/ttt_memory.py --tokens 8192 16384 32768"  # --run over the report's own
    data = rt.load(results)
    table = rt.long_row_benches(data)
    assert "| EAGLE-3 | 7 | fused | 16384 | 2000 | 2900 | 57.9 | 110.0 |" in table
    assert "EAGLE-3 TTT 7 (fused) memory 4.1x, CPU time 5.8x" in table
    assert "DFlash TTT 1 (fused) memory 4.0x, CPU time 8.0x" in table
    assert "commit `0123456` on 2099-01-01, box" in table
    assert "No record yet" in rt.long_row_benches({"runs": []})
    # a newer record of other methods keeps this one's EAGLE-3 rows; a newer EAGLE-3 record replaces them
    newer = {**report, "rows": [_long_row("peagle", 3, 8192, 500, 20.0), _long_row("dflash", 1, 8192, 250, 9.0)]}
    record(_write(tmp_path, "p.json", newer), results, CHECKOUT, machine="box", date="2099-01-02")
    table = rt.long_row_benches(rt.load(results))
    assert "| EAGLE-3 | 7 | fused | 16384 | 2000 |" in table and "| P-EAGLE | 3 | fused | 8192 | 500 |" in table
    assert "| DFlash | 1 | fused | 8192 | 250 |" in table and "| DFlash | 1 | fused | 8192 | 300 |" not in table
    assert table.count("commit `0123456`") == 2
    latest = {**report, "rows": [_long_row("eagle3", 3, 8192, 700, 30.0)]}
    record(_write(tmp_path, "e.json", latest), results, CHECKOUT, machine="box", date="2099-01-03")
    table = rt.long_row_benches(rt.load(results))
    assert "| EAGLE-3 | 3 | fused | 8192 | 700 |" in table and "| EAGLE-3 | 7 |" not in table
