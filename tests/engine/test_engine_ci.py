"""CI's real-engine test: a head made here, exported, and decoded by vLLM's CPU build (the real engine, not a
stand-in): plain and speculative greedy outputs identical, the engine's own spec-decode counters read back per
position. The head is P-EAGLE's (EAGLE-3's export plus the parallel-drafting slots), trained for one step: what is
under test is that the export loads, drafts and verifies in the engine as exported, and that serve-eval reads
what the engine did; acceptance against the evaluator's needs a trained head (the engine tier,
``scripts/engine_tests.sh``). About 3 minutes on 2 cores (two engine loads with ``enforce_eager``)."""

from __future__ import annotations

import json

import pytest

from tests.engine.conftest import specheads

pytestmark = [pytest.mark.engine_ci, pytest.mark.slow]


def test_a_head_exported_here_decodes_in_the_real_vllm_with_greedy_output_unchanged(tmp_path):
    specheads("prepare", "data.num_samples=24", f"output_dir={tmp_path / 'prepared'}", cwd=tmp_path)
    specheads("train", "method=peagle", f"prepared_dir={tmp_path / 'prepared'}", f"output_dir={tmp_path / 'train'}",
              "data.max_tokens=512", "train.max_steps=1", "train.max_minutes=null", "train.eval_every=0",
              "train.save_every=0", "train.measure_prompts=0", "train.progress=false", "data.eval_samples=0",
              cwd=tmp_path)
    specheads("export", f"head_dir={tmp_path / 'train'}", f"output_dir={tmp_path / 'export'}", "engine=vllm",
              "eval_report=null", cwd=tmp_path)
    out = tmp_path / "serve"
    specheads("serve-eval", f"export_dir={tmp_path / 'export'}", "eval=tiny", "eval.mtbench_per_category=0",
              "eval.humaneval=2", "eval.max_new_tokens=16", "num_speculative_tokens=3", "vllm.enforce_eager=true",
              f"output_dir={out}", cwd=tmp_path)
    report = json.loads((out / "serve_report.json").read_text())
    every = report["domains"]["all"]
    assert report["num_prompts"] == every["compared"] == every["identical"] == 2  # greedy: speculative == plain
    spec = every["spec"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] == 3 * spec["drafts"]  # the engine drafted chains of 3
    assert len(spec["accepted_per_pos"]) == 3 and sum(spec["accepted_per_pos"]) == spec["accepted"]
    assert spec["new_tokens"] == every["plain"]["new_tokens"] > 0
    assert spec["tau"] == pytest.approx(1 + spec["accepted"] / spec["drafts"])
    # the engine was asked for P-EAGLE's parallel drafting, and said so in its own log
    log = (out / "engine_spec.log").read_text()
    assert "'parallel_drafting': True" in log and "method='eagle3'" in log
