"""The engine tier for MTP fine-tuning: tiny targets of the two MTP layouts with the embedded tokenizer (MiMo: Qwen2
plus ``model.mtp_layers.0.*``; Qwen3-Next: ``mtp.*`` with a sparse-MoE layer, its decoder layers all full attention
so that the evaluator can verify on it), the MTP layer fine-tuned here, stitched back and served by vLLM's CPU build
with ``method: mtp``: greedy output identical to plain decoding, and the engine accepting at each draft position
what the evaluator's MTP drafter accepted on the same prompts in the same precision (the layer's maths is the
engine's). About 3 minutes a family on 2 cores (two engine loads with ``enforce_eager``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.engine.conftest import specheads

pytestmark = [pytest.mark.engine, pytest.mark.slow]

EVAL = ["eval=tiny", "eval.mtbench_per_category=0", "eval.humaneval=2", "eval.max_new_tokens=16"]


def tiny_target(folder, family: str):
    """vLLM's CPU attention wants head sizes of 32 or more: one 64-wide head; the embedded default's tokenizer.
    (Its Qwen3-Next model also wants a sparse-MoE layer: the MTP layer is one.)"""
    from specheads.targets import resolve_target_path
    from tests.methods.test_mtp import make_mimo
    from tests.methods.test_mtp_qwen3_next import make_qwen3_next

    if family == "mimo":
        make_mimo(folder, vocab=49152, heads=1, kv_heads=1)
    else:
        make_qwen3_next(folder, experts=2, vocab=49152, heads=1, head_dim=64)
    for f in Path(resolve_target_path("smollm2")).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy2(f, folder / f.name)
    return folder


@pytest.mark.parametrize("family", ["mimo", "qwen3_next"])
def test_a_fine_tuned_mtp_layer_is_served_by_vllm_with_the_evaluators_acceptance(tmp_path, family):
    target = ["target=hf", f"target.name_or_path={tiny_target(tmp_path / family, family)}"]
    specheads("prepare", *target, "data.num_samples=32", "data.max_length=256", f"output_dir={tmp_path / 'prepared'}",
              cwd=tmp_path)
    specheads("train", "method=mtp", *target, "method.labels=target", f"prepared_dir={tmp_path / 'prepared'}",
              f"output_dir={tmp_path / 'train'}", "data.max_tokens=512", "train.max_steps=30", "train.max_minutes=null",
              "train.eval_every=0", "train.save_every=0", "train.measure_prompts=0", "train.progress=false",
              "data.eval_samples=4", "optim.lr=3e-3", "optim.warmup_steps=0", cwd=tmp_path)
    # evaluated in the precision the engine serves in (float32)
    specheads("evaluate", *target, "target.dtype=float32", "head_method=mtp", f"head_dir={tmp_path / 'train'}",
              f"output_dir={tmp_path / 'eval'}",
              *EVAL, "baselines=[]", "temperatures=[0.0]", "batch_sizes=[1]", "serving.engines=[vllm]", cwd=tmp_path)
    specheads("export", *target, f"head_dir={tmp_path / 'train'}", f"output_dir={tmp_path / 'export'}", "engine=vllm",
              "eval_report=null", cwd=tmp_path)
    out = tmp_path / "serve"
    specheads("serve-eval", *target, f"export_dir={tmp_path / 'export'}", f"eval_report={tmp_path / 'eval/report.json'}",
              *EVAL, "num_speculative_tokens=3", "vllm.enforce_eager=true", "vllm.max_model_len=512",
              f"output_dir={out}", cwd=tmp_path)
    report = json.loads((out / "serve_report.json").read_text())
    every = report["domains"]["all"]
    assert report["num_prompts"] == every["compared"] == every["identical"] == 2  # greedy: speculative == plain
    spec = every["spec"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] == 3 * spec["drafts"] and spec["accepted"] > 0
    log = (out / "engine_spec.log").read_text()
    assert "method='mtp'" in log  # the engine drafted with the target's own (stitched) MTP layer
    ours = report["evaluator"]["domains"]["all"]
    assert not ours["tau_flagged"] and not any(p["flagged"] for p in ours["positions"])
    # the same drafts accepted at each position: the evaluator's steps times its reach, the engine's counts
    evaluator_counts = [round(p["evaluator"] * ours["evaluator_steps"]) for p in ours["positions"]]
    assert evaluator_counts == spec["accepted_per_pos"], (evaluator_counts, spec)
