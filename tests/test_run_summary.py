"""The run's last lines: stage seconds and each stage's choices, read back from what the stages wrote."""

from __future__ import annotations

import json

from specheads.run_summary import SUMMARY_FILE, summarize, write_summary


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_a_run_folder_is_summarized_from_its_markers_store_summary_and_report(tmp_path):
    run = tmp_path / "run"
    for key, s in (("prepare", 5.0), ("collect", 300.0), ("train.eagle3", 480.0), ("evaluate.eagle3", 240.0),
                   ("export.eagle3", 3.0), ("train.medusa1", 999.0)):
        _write(run / ".done" / f"{key}.json", {"seconds": s})
    budget = {"rows": 200, "prepared_rows": 700, "tokens": 90000, "max_minutes": 5, "tokens_per_s": 300.0,
              "processes": 1}
    _write(run / "features" / "manifest.json", {"num_samples": 200, "num_tokens": 90000, "source": {
        "budget": budget, "target_dtype": {"value": "float32", "reason": "this CPU has no bfloat16 kernels"},
        "num_samples": 700}})
    _write(run / "train" / "eagle3" / "train_summary.json", {"steps": 480, "tokens_per_s": 2000.0, "precision": {
        "mixed_precision": "no", "target_dtype": "torch.float32"}, "eval": {"step0_acc": 0.4, "step1_acc": 0.3},
        "peak_rss_mb": 2100.4, "peak_anon_mb": 900.2})
    _write(run / "eval" / "eagle3" / "report.json", {"num_prompts": 12, "max_new_tokens": 32,
                                                      "target_dtype": "torch.float32",
                                                      "methods": [{"lossless": {"exact": True}}, {}]})
    record, lines = write_summary(run, "eagle3", offline=True)
    assert record["stages_s"] == {"prepare": 5.0, "collect": 300.0, "train": 480.0, "evaluate": 240.0, "export": 3.0}
    assert record["total_min"] == 17.1
    assert record["collect"]["budget"] == budget and record["collect"]["tokens_per_s_with_startup"] == 300
    assert record["train"]["steps"] == 480 and record["train"]["heldout_step0_top1"] == 0.4  # EAGLE's step0_acc
    _write(run / "train" / "medusa1" / "train_summary.json", {"eval": {"head0_top1_acc": 0.25, "head1_top1_acc": 0.1}})
    assert summarize(run, "medusa1", offline=True)["train"]["heldout_step0_top1"] == 0.25  # Medusa's head 0
    assert (record["train"]["peak_rss_mb"], record["train"]["peak_anon_mb"]) == (2100.4, 900.2)
    store = record["collect"]["store_id"]  # the manifest's digest: another head on the same store shares it
    assert len(store) == 12 and summarize(run, "dflash", offline=True)["collect"]["store_id"] == store
    _write(run / "features" / "manifest.json", {"num_samples": 199})
    assert summarize(run, "eagle3", offline=True)["collect"]["store_id"] != store
    assert record["evaluate"]["lossless"] == "exact"
    assert json.loads((run / SUMMARY_FILE).read_text()) == record
    text = "\n".join(lines)
    assert "17.1 min" in text and "200 of 700 prepared chats in its 5-minute budget" in text
    assert "480 steps at 2000 tokens/s, mixed precision no, target float32" in text and "lossless exact" in text


def test_a_mismatch_is_named_and_missing_stages_are_left_out(tmp_path):
    run = tmp_path / "run"
    _write(run / "eval" / "eagle3" / "report.json", {"num_prompts": 2, "max_new_tokens": 8, "target_dtype": "f",
                                                      "methods": [{"lossless": {"exact": True}},
                                                                  {"lossless": {"exact": False}}]})
    record = summarize(run, "eagle3", offline=True)
    assert record["evaluate"]["lossless"] == "MISMATCH"
    assert "collect" not in record and "train" not in record and record["stages_s"] == {}


def test_the_engines_figures_end_the_run_beside_the_evaluators_and_apart_from_its_time(tmp_path):
    run = tmp_path / "run"
    for key, s in (("prepare", 60.0), ("export.eagle3", 60.0), ("serve.eagle3", 300.0)):
        _write(run / ".done" / f"{key}.json", {"seconds": s})
    every = {"prompts": 12, "spec": {"tau": 1.35, "reach": [0.3, 0.05, 0.0], "tokens_per_s": 9.0},
             "plain": {"tokens_per_s": 10.0}, "speedup": 0.9, "identical": 12, "compared": 12}
    report = {"engine": {"name": "vLLM", "version": "0.32.0"}, "num_prompts": 12, "num_speculative_tokens": 3,
              "domains": {"all": every}, "evaluator": {"domains": {"all": {"tau_evaluator": 1.34, "tau_flagged": False}}}}
    _write(run / "serve" / "eagle3" / "serve_report.json", report)
    record, lines = write_summary(run, "eagle3", offline=True)
    assert record["total_min"] == 2.0 and record["stages_s"]["serve"] == 300.0  # the main job's time without serve
    assert record["serve"] == {"engine": "vLLM 0.32.0", "prompts": 12, "num_speculative_tokens": 3, "tau": 1.35,
                               "tau_evaluator": 1.34, "flagged": False, "reach": [0.3, 0.05, 0.0], "tokens_per_s": 9.0,
                               "plain_tokens_per_s": 10.0, "speedup": 0.9, "greedy_identical": "12/12"}
    assert ("serve: vLLM 0.32.0, 12 prompts, chain of 3: τ 1.35 (evaluator 1.34), 9.0 tokens/s against plain 10.0 "
            "(0.90x), greedy identical 12/12") in "\n".join(lines)
    (run / ".done" / "serve.eagle3.json").unlink()  # a report left by an earlier run: not this run's figures
    assert "serve" not in write_summary(run, "eagle3", offline=True)[0]


def test_an_engines_refusal_ends_the_run_with_its_message(tmp_path):
    run = tmp_path / "run"
    _write(run / ".done" / "serve.eagle3.started.json", {"fingerprint": "x"})  # the stage ran and failed
    _write(run / "serve" / "eagle3" / "serve_report.json", {
        "engine": {"name": "vLLM", "version": "0.32.0"}, "refused": "vLLM did not start: RuntimeError: Model does "
        "not support EAGLE3 interface", "num_prompts": 0, "num_speculative_tokens": 3, "domains": {}})
    record, lines = write_summary(run, "eagle3", offline=True)
    assert record["serve"]["refused"].endswith("Model does not support EAGLE3 interface")
    assert "serve: vLLM 0.32.0 refused the head: vLLM did not start" in "\n".join(lines)


def test_each_rows_predicted_gpu_speedup_is_kept(tmp_path):
    run = tmp_path / "run"
    every = {"tau": 1.5, "alpha": 0.3, "speedup": 0.9, "gpu_speedup_pred": 1.234}
    _write(run / "eval" / "eagle3" / "report.json", {"num_prompts": 1, "temperatures": [0.0], "methods": [
        {"name": "eagle3-chain3", "shape": "chain3", "by_temperature": {"0.0": {"all": every, "code": every}}}]})
    row = summarize(run, "eagle3", offline=True)["methods"][0]
    assert row == {"name": "eagle3-chain3", "shape": "chain3", "tau": 1.5, "alpha": 0.3, "speedup": 0.9,
                   "gpu_speedup_pred": 1.23}


def test_the_command_lines_stage_overrides_are_kept_apart_from_the_defaults(tmp_path):
    run = tmp_path / "run"
    _write(run / ".done" / "prepare.json", {"seconds": 1.0})
    record = summarize(run, "dflash", offline=True, settings={"train": ["method.loss=dpace"], "evaluate": []})
    assert record["settings"] == {"train": ["method.loss=dpace"]}
    assert "settings" not in summarize(run, "dflash", offline=True, settings={"train": [], "prepare": []})
