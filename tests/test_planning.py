"""`specheads plan`: parameter counts of the presets' real modules (on the meta device), store bytes, the layout
and disk advice, and the recipe through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specheads.data.store import bytes_per_token
from specheads.planning import make_plan, target_config

REPO = Path(__file__).resolve().parents[1]


def preset(name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / "target" / f"{name}.yaml").read_text())


def plan_for(name: str, method: str = "eagle3", **kw):
    raw = preset(name)
    settings = {"aux_layers": raw["eagle3"]["aux_layers"], "draft_vocab_size": 32000} if method == "eagle3" else {}
    args = dict(target_name=name, config=target_config(raw["name_or_path"], raw["architecture"]), method_name=method,
                method_settings=settings, dtype="bfloat16", store_dtype="bfloat16", num_samples=1000,
                tokens_per_sample=1000, epochs=1, batch_tokens=1024, device="cpu", probe_tokens=8)
    return make_plan(**{**args, **kw})


# the totals (and active parameters per token, without the input embedding's lookup) the model cards publish,
# in billions; Qwen3-30B-A3B's card counts its 0.31B input embedding among the 3.3B active, gpt-oss's does not
@pytest.mark.parametrize("name,total,active", [
    ("llama3_1_8b", 8.03, None), ("llama3_3_70b", 70.55, None), ("qwen3_8b", 8.19, None),
    ("qwen3_30b_a3b", 30.5, 3.3 - 0.31), ("gpt_oss_20b", 20.9, 3.6), ("gemma3_12b", 11.8, None)])
def test_preset_architectures_have_their_published_sizes(name, total, active):
    size = plan_for(name).target_size
    assert size.params / 1e9 == pytest.approx(total, abs=0.1)
    if active is not None:
        assert size.active_params / 1e9 == pytest.approx(active, abs=0.1)


def test_store_bytes_follow_the_stored_vectors():
    p = plan_for("qwen3_8b")
    # EAGLE-3 stores three fused layers plus the last hidden state, bfloat16, for every token
    assert p.store_bytes == 1000 * 1000 * bytes_per_token(4096, 3, True, "bfloat16")
    fp8 = plan_for("qwen3_8b", store_dtype="fp8_e4m3")
    assert 0.45 < fp8.store_bytes / p.store_bytes < 0.55


def test_layouts_split_the_weights_and_the_advice_follows_the_device():
    p = plan_for("llama3_3_70b")
    assert p.memory["one device"] > 2 * 70.5e9 / 2**30  # 141 GB of bfloat16 weights alone
    assert p.memory["tp 8"] < p.memory["tp 4"] < p.memory["tp 2"] < p.memory["one device"]
    assert any(a.startswith("smallest layout") and "tp 2" in a for a in p.advice)
    small = plan_for("llama3_3_70b", device_gib=8)
    assert any(a.startswith("no layout") for a in small.advice)


def test_a_store_that_does_not_fit_the_disk_recommends_online_training(tmp_path):
    p = plan_for("qwen3_8b", num_samples=10**7, disk_dir=tmp_path)
    assert p.store_bytes > p.disk_free
    assert any("train online" in a for a in p.advice)
    assert p.train_online_s > p.train_offline_s
    assert any("the store fits" in a for a in plan_for("qwen3_8b", num_samples=1, tokens_per_sample=1,
                                                       disk_dir=tmp_path).advice)


def test_a_method_that_trains_the_target_has_no_store():
    p = plan_for("qwen3_8b", method="medusa2")
    assert p.store_bytes == 0 and any("online training only" in a for a in p.advice)


def run_cli(*args: str, cwd: Path):
    return subprocess.run([sys.executable, "-m", "specheads.cli", "plan", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_plan_through_the_cli(tmp_path):
    out = run_cli("target=qwen3_30b_a3b", "plan.num_samples=2000", "plan.probe_tokens=8", "plan.json=plan.json",
                  "plan.disk_dir=.", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "plan for Qwen/Qwen3-30B-A3B + eagle3: 2000 samples" in out.stdout
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["num_samples"] == 2000 and saved["target_size"]["active_params"] < saved["target_size"]["params"] / 5
    assert "128 experts per layer, 3.0" in out.stdout
    bad = run_cli("plan.num_samples=0", cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("specheads plan: error: plan needs positive sizes")


def test_a_prepared_set_sizes_the_tokens_per_sample(tmp_path):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "specheads_meta.json").write_text(json.dumps({"num_samples": 40, "num_tokens": 20000}))
    out = run_cli(f"prepared_dir={prepared}", "plan.num_samples=100", "plan.probe_tokens=8", "plan.json=p.json",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "p.json").read_text())["tokens"] == 100 * 500
