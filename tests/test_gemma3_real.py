"""Gemma 3 270M on its real weights (the embedded GGUF, the base model with Gemma's template given by the preset)
through every stage of `specheads run`: prepare, collect, train a few steps, evaluate 2 prompts losslessly,
export. What no random tiny config reaches: a tokenizer without a template, a 262k-row LM head on a CPU,
sliding-window layers with real weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_gemma3_270m_runs_every_stage_on_real_weights(tmp_path):
    from specheads.hardware import cpu_bf16_supported

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # the evaluator's target in the dtype the kernels give it (float32 without bfloat16 kernels; bfloat16 where
    # they are, which the timed probe picks here), named instead of probed: the probe pads the calls of the
    # 262k-row float32 LM head to their row floor, whose search alone takes half a minute (the probe's choice on a
    # real target: tests/evaluation/test_smollm2_eval.py)
    dtype = "bfloat16" if cpu_bf16_supported() else "float32"
    cmd = [sys.executable, "-m", "specheads.cli", "run", "target=gemma3_270m", f"run_dir={run}", "serve=false",
           "prepare.data.num_samples=12", "prepare.data.max_length=96",
           "collect.collect.max_minutes=null", "collect.engine=hf",  # vLLM's collection: tests/engine, gpu_check.sh
           "train.train.max_minutes=null", "train.train.max_steps=3", "train.train.measure_prompts=2",
           "train.train.measure_tokens=8", "train.data.eval_samples=4", "train.train.save_every=0",
           "evaluate.eval=tiny", f"evaluate.target.dtype={dtype}", "evaluate.eval.mtbench_per_category=0",
           "evaluate.eval.humaneval=1",
           "evaluate.eval.chat=1", "evaluate.eval.max_new_tokens=6", "evaluate.eval.max_minutes=null",
           "evaluate.head_ngram=0", "evaluate.head_ngram_extend=0", "evaluate.head_shape=tree",
           "evaluate.baselines=[]", "evaluate.serving.engines=[]", "evaluate.temperatures=[0.0]"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    from specheads.data.prepare import load_prepared

    dataset, meta = load_prepared(run / "prepared")
    row = dataset[0]
    from specheads.targets import load_tokenizer

    tok = load_tokenizer("gemma3_270m", "gemma3")
    text = tok.decode(row["input_ids"])
    assert "<start_of_turn>user" in text and "<start_of_turn>model" in text  # Gemma's template, given by the preset
    masked = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert masked and "<start_of_turn>" not in masked  # the model's turns only (a row may be cut at max_length)
    store = json.loads((run / "features" / "manifest.json").read_text())
    assert store["num_samples"] == len(dataset) and store["aux_layers"] == [2, 9, 15]
    assert json.loads((run / "run_summary.json").read_text())["collect"]["engine"] == "hf"
    summary = json.loads((run / "train" / "eagle3" / "train_summary.json").read_text())
    assert summary["steps"] == 3
    report = json.loads((run / "eval" / "eagle3" / "report.json").read_text())
    assert report["num_prompts"] == 2 and [m["name"] for m in report["methods"]] == ["eagle3-tree"]
    assert report["methods"][0]["lossless"]["exact"]
    export = json.loads((run / "export" / "eagle3" / "vllm" / "config.json").read_text())
    assert export["draft_vocab_size"] == 4096
    card = (run / "export" / "eagle3" / "vllm" / "README.md").read_text()
    assert "google/gemma-3-270m" in card
