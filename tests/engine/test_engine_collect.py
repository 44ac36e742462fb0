"""The engine tier for collection through vLLM (``specheads collect engine=vllm``): the embedded target's states
captured by vLLM's CPU build fill a store with the same plan as the Hugging Face forward's; stored in bfloat16,
every value is within one bfloat16 step of the Hugging Face store's, plus 1e-5 of its row's largest state in that
layer (values near zero, where float32 forwards differ by ~1e-6 of that), and the target argmax is the same; a head
trained on it for as many steps as one trained on the Hugging Face store ends with the same loss within 2% and the
same held-out accuracy within 3 points; two ranks, each with an engine of its own, write the one-rank store.
About 4 minutes on 2 cores (four engine loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.conftest import ROOT, specheads

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _collect(tmp_path, name, *extra):
    specheads("collect", "target.dtype=float32", f"prepared_dir={tmp_path / 'prepared'}",
              f"output_dir={tmp_path / name}", "method=eagle3", *extra, cwd=tmp_path)
    return tmp_path / name


def _shards(store):
    out = {}
    for f in sorted((store / "shards").glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            out.setdefault(k, []).append(v)
    return {k: torch.cat(v) for k, v in out.items()}


def test_the_engines_store_is_the_hugging_face_forwards(tmp_path):
    specheads("prepare", "data.num_samples=16", "data.max_length=256", f"output_dir={tmp_path / 'prepared'}",
              cwd=tmp_path)
    hf, engine = _collect(tmp_path, "hf"), _collect(tmp_path, "engine", "engine=vllm")
    a, b = json.loads((hf / "manifest.json").read_text()), json.loads((engine / "manifest.json").read_text())
    assert a["plan_hash"] == b["plan_hash"] and a["num_tokens"] == b["num_tokens"]
    assert b["source"]["engine"] == "vllm" and a["source"]["engine"] == "hf"
    x, y = _shards(hf), _shards(engine)
    assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
    assert torch.equal(x["target_argmax"], y["target_argmax"])
    H = int(a["hidden_size"])
    for key in ("hidden_aux", "hidden_last"):  # float32 forwards on both sides, each rounded to bfloat16
        ref, got = x[key].float().view(len(x[key]), -1, H), y[key].float().view(len(y[key]), -1, H)  # per layer
        step = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)  # one bfloat16 step at |ref|
        scale = ref.abs().amax(-1, keepdim=True)  # a row's largest state of that layer
        assert bool(((got - ref).abs() <= step + 1e-5 * scale).all()), key
        assert float((got == ref).float().mean()) > 0.98, key
    # a head trained on either store: the same held-out figures within noise (same seed, same steps)
    trained = {}
    for name, store in (("hf", hf), ("engine", engine)):
        specheads("train", "method=eagle3", f"features_dir={store}", f"prepared_dir={tmp_path / 'prepared'}",
                  f"output_dir={tmp_path / ('train_' + name)}", "method.draft_vocab_size=1024", "train.max_steps=30",
                  "train.max_minutes=null", "train.eval_every=0", "train.save_every=0", "train.measure_prompts=0",
                  "train.progress=false", "data.eval_samples=4", "data.max_tokens=1024", cwd=tmp_path)
        trained[name] = json.loads((tmp_path / f"train_{name}" / "train_summary.json").read_text())
    assert (tmp_path / "train_engine" / "head" / "config.json").is_file()
    a_sum, b_sum = trained["hf"], trained["engine"]
    assert a_sum["steps"] == b_sum["steps"] == 30
    assert abs(a_sum["final_loss"] - b_sum["final_loss"]) <= 0.02 * abs(a_sum["final_loss"]), (a_sum, b_sum)
    assert abs(a_sum["eval"]["step0_acc"] - b_sum["eval"]["step0_acc"]) <= 0.03, (a_sum["eval"], b_sum["eval"])

    # two ranks, an engine each: the store of one rank
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           "29531", str(ROOT / "recipes" / "collect_hidden_states.py"), "engine=vllm",
                           "target.dtype=float32", f"prepared_dir={tmp_path / 'prepared'}",
                           f"output_dir={tmp_path / 'two'}", "method=eagle3", "collect.shard_samples=4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    two = _shards(tmp_path / "two")
    assert torch.equal(two["target_argmax"], y["target_argmax"]) and torch.equal(two["hidden_last"], y["hidden_last"])
