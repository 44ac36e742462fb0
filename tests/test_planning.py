"""`specheads plan`: parameter counts of the presets' real modules (on the meta device), store bytes, the layout
and disk advice, and the recipe through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from specheads.data.store import bytes_per_token
from specheads.planning import make_plan, target_config

REPO = Path(__file__).resolve().parents[1]


def preset(name: str) -> dict:
    return yaml.safe_load((REPO / "conf" / "target" / f"{name}.yaml").read_text())


def plan_for(name: str, method: str = "eagle3", **kw):
    """The plan of a preset; the tests of sizes, bytes and advice take the probes at fixed rates (``fixed_rates``):
    a real probe of a 70B model's layers in bfloat16 takes minutes on a CPU without bfloat16 kernels (the CLI
    tests run the real one)."""
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
def test_preset_architectures_have_their_published_sizes(name, total, active, fixed_rates):
    size = plan_for(name).target_size
    assert size.params / 1e9 == pytest.approx(total, abs=0.1)
    if active is not None:
        assert size.active_params / 1e9 == pytest.approx(active, abs=0.1)


def test_store_bytes_follow_the_stored_vectors(fixed_rates):
    p = plan_for("qwen3_8b")
    # EAGLE-3 stores three fused layers plus the last hidden state, bfloat16, for every token
    assert p.store_bytes == 1000 * 1000 * bytes_per_token(4096, 3, True, "bfloat16")
    fp8 = plan_for("qwen3_8b", store_dtype="fp8_e4m3")
    assert 0.45 < fp8.store_bytes / p.store_bytes < 0.55


def test_layouts_split_the_weights_and_the_advice_follows_the_device(fixed_rates):
    p = plan_for("llama3_3_70b")
    assert p.memory["one device"] > 2 * 70.5e9 / 2**30  # 141 GB of bfloat16 weights alone
    assert p.memory["tp 8"] < p.memory["tp 4"] < p.memory["tp 2"] < p.memory["one device"]
    assert any(a.startswith("smallest layout") and "tp 2" in a for a in p.advice)
    small = plan_for("llama3_3_70b", device_gib=8)
    assert any(a.startswith("no layout") for a in small.advice)


def test_a_store_that_does_not_fit_the_disk_recommends_online_training(tmp_path, fixed_rates):
    p = plan_for("qwen3_8b", num_samples=10**7, disk_dir=tmp_path)
    assert p.store_bytes > p.disk_free
    assert any("train online" in a for a in p.advice)
    assert p.train_online_s > p.train_offline_s
    assert any("the store fits" in a for a in plan_for("qwen3_8b", num_samples=1, tokens_per_sample=1,
                                                       disk_dir=tmp_path).advice)


def test_a_method_that_trains_the_target_has_no_store(fixed_rates):
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
    assert bad.stderr.strip().splitlines()[-1].startswith("specheads plan: error: plan.num_samples=0 is out of range")
    other = run_cli("plan.engine=sglang", cwd=tmp_path)
    assert other.returncode == 2 and other.stderr.strip().splitlines()[-1] == (
        "specheads plan: error: plan.engine=sglang: use vllm (time vLLM's collection too) or leave it null")


def test_a_prepared_set_sizes_the_tokens_per_sample(tmp_path):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "specheads_meta.json").write_text(json.dumps({"num_samples": 40, "num_tokens": 20000}))
    out = run_cli(f"prepared_dir={prepared}", "plan.num_samples=100", "plan.probe_tokens=8", "plan.json=p.json",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "p.json").read_text())["tokens"] == 100 * 500


# --------------------------------------------------------------------------- issue 38: what a 262k vocabulary costs

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # its published config


@pytest.fixture
def fixed_rates(monkeypatch):
    """The probes at fixed rates (decoder 1e10, LM head 2e10 FLOP/s), recording the dtype each ran in."""
    seen = []

    def rate(value):
        def probe(size, dtype, device, tokens=256, repeats=3):
            seen.append(dtype)
            return value
        return probe

    monkeypatch.setattr("specheads.planning.probe_flops", rate(1e10))
    monkeypatch.setattr("specheads.planning.probe_lm_head_flops", rate(2e10))
    return seen


def gemma_plan(**kw):
    return plan_for("gemma3_270m", **{"dtype": "float32", "method_settings": {"aux_layers": [2, 9, 15],
                                                                                "draft_vocab_size": 4096}, **kw})


def test_the_lm_head_is_costed_apart_from_the_decoder(fixed_rates):
    p = gemma_plan()
    s, h = p.target_size, p.lm_head
    assert (s.lm_head_params, s.tied, s.softcap) == (640 * 262144, True, False)
    assert h.flops_share == pytest.approx(0.626, abs=0.001)  # most of Gemma 3 270M's forward
    decoder_s, head_s = 2 * s.decoder_params * p.tokens / 1e10, 2 * s.lm_head_params * p.tokens / 2e10
    decoder_s += p.attention.collect_s  # attention's products, at the decoder's rate
    assert p.collect_s == pytest.approx(decoder_s + head_s)
    assert h.time_share == pytest.approx(head_s / (decoder_s + head_s))
    smollm2 = plan_for("gemma3_270m", target_name="smollm2", config=target_config("smollm2", SMOLLM2),
                       dtype="float32", method_settings={"aux_layers": [2, 15, 27], "draft_vocab_size": 2048})
    assert smollm2.lm_head.flops_share == pytest.approx(0.210, abs=0.001)


def test_collection_holds_one_chunk_of_logits_not_a_batch(fixed_rates):
    small, big = gemma_plan(batch_tokens=512, tokens_per_sample=500), gemma_plan(batch_tokens=8192)
    assert small.lm_head.collect_bytes == 512 * 262144 * 4
    assert big.lm_head.chunk_rows == 1024 and big.lm_head.collect_bytes == 1024 * 262144 * 4  # 1 GiB, not 8
    assert big.memory["one device"] < 268098176 * 4 / 2**30 + 1.5
    bf16 = gemma_plan(batch_tokens=8192, dtype="bfloat16")
    assert bf16.lm_head.collect_bytes == 1024 * 262144 * 2  # the LM head runs in the target's dtype
    # Tensor parallel keeps the (tied) embedding / LM head whole on every rank.
    assert big.memory["tp 8"] > 167772160 * 4 / 2**30 > big.memory["device_map 8"] - 1.1


def test_training_computes_the_target_columns_its_loss_needs(fixed_rates):
    e3 = gemma_plan()
    assert (e3.lm_head.train_columns, e3.lm_head.online_columns, e3.lm_head.probs_width) == (4096, 262144, 4096)
    e1 = gemma_plan(method="eagle1", method_settings={}, train_tokens=4096, device_gib=16)
    V = 262144
    assert e1.lm_head.train_bytes == (1024 * V + 4096 * V) * 4  # the full distribution of every trained row
    assert any("keeps the target's distribution over 262144 columns" in a for a in e1.advice)
    assert e1.train_offline_s > e3.train_offline_s
    m1 = gemma_plan(method="medusa1", method_settings={})
    assert m1.lm_head.train_columns == 0 and m1.lm_head.train_bytes == 0  # trained on the data's tokens


def test_the_probe_runs_in_the_dtype_the_stages_choose(fixed_rates, monkeypatch):
    from specheads.hardware import BF16_ENV

    monkeypatch.setenv(BF16_ENV, "0")  # a CPU without bfloat16 kernels (the AVX2 EPYC)
    p = gemma_plan(dtype="auto")
    assert (p.dtype, p.dtype_reason) == ("float32", "this CPU has no bfloat16 kernels")
    assert set(fixed_rates) == {torch.float32}
    fixed_rates.clear()
    monkeypatch.setenv(BF16_ENV, "1")  # with kernels: the stages' probe of the model's own linear shapes
    probed = []

    def probe_seconds(shapes, weights, rows, reps=3, backward=False, dtypes=("float32", "bfloat16")):
        probed.append((dict(shapes), rows))
        return {"float32": 2.0, "bfloat16": 1.0}

    monkeypatch.setattr("specheads.hardware.probe_seconds", probe_seconds)
    p = gemma_plan(dtype="auto")
    assert p.dtype == "bfloat16" and set(fixed_rates) == {torch.bfloat16}
    (shapes, rows), = probed
    # the LM head among them (cut into 10 slices of at most 2**24 weights: the same FLOPs), at load_target's rows
    assert shapes[(640, 262144 // 10)] == 10 and rows == 256 and max(i * o for i, o in shapes) <= 2**24


def test_bfloat16_on_a_cpu_without_its_kernels_is_said_in_readable_figures(monkeypatch):
    from specheads.hardware import BF16_ENV
    from specheads.planning import format_plan

    monkeypatch.setenv(BF16_ENV, "0")
    monkeypatch.setattr("specheads.planning.probe_flops", lambda *a, **k: 3e9)
    monkeypatch.setattr("specheads.planning.probe_lm_head_flops", lambda *a, **k: 4e9)
    p = gemma_plan(dtype="bfloat16")
    assert p.dtype_reason == "as set"
    assert any("slow generic path (the probe: 3.0 GFLOP/s); target.dtype=auto loads float32" in a for a in p.advice)
    text = format_plan(p)
    assert "0.00 TFLOP/s" not in text and "at the probe's 3.0 GFLOP/s" in text
    assert "LM head  640 x 262144: 63% of a forward's matrix-product FLOPs" in text
    assert "collection keeps the argmax only, 1024 rows of logits at a time: 0.50 GiB" in text
    assert "4096 from the store, all 262144 online" in text


# --------------------------------------------------------------------------- long rows: attention grows with the row

def test_a_token_of_a_long_row_costs_more_than_one_of_a_short_row(fixed_rates):
    """The same 16M tokens as 2k-token rows and as 16k-token rows: attention's products grow with the row (a token
    at position t reads t keys), the matrix products do not, so collection and training cost more per token at 16k;
    Qwen3-8B's 36 full-attention layers of 32 x 128 query columns read (T + 1) / 2 keys per token on average."""
    from specheads.planning import mean_keys

    short, long = (plan_for("qwen3_8b", tokens_per_sample=T, num_samples=2**24 // T) for T in (2048, 16384))
    assert short.tokens == long.tokens == 2**24
    assert long.collect_s > 1.2 * short.collect_s and long.train_offline_s > 1.1 * short.train_offline_s
    assert long.train_online_s > short.train_online_s
    for plan, T in ((short, 2048), (long, 16384)):
        assert plan.attention.row_tokens == T
        assert plan.attention.target_flops == pytest.approx(36 * 4 * 32 * 128 * (T + 1) / 2)
        assert plan.attention.head_flops == pytest.approx(3 * 4 * 32 * 128 * (T + 1) / 2)  # one draft layer
        assert plan.attention.collect_s == pytest.approx(plan.attention.target_flops * 2**24 / 1e10)
    matrix = short.collect_s - short.attention.collect_s
    assert long.collect_s - long.attention.collect_s == pytest.approx(matrix)
    # a sliding-window layer reads at most its window: Gemma 3's local layers grow no further past 512 keys
    assert mean_keys(16384, 512) == pytest.approx((512 * 513 / 2 + (16384 - 512) * 512) / 16384)
    g_short, g_long = (gemma_plan(tokens_per_sample=T) for T in (2048, 16384))
    assert g_short.attention.target_flops < g_long.attention.target_flops < 8 * g_short.attention.target_flops
    # collection's activations: a row longer than collect.batch_tokens (1024 here) is a batch of its own
    assert long.memory["one device"] > short.memory["one device"]
    assert plan_for("qwen3_8b", tokens_per_sample=512).memory == plan_for("qwen3_8b", tokens_per_sample=1024).memory


def test_the_reasoning_preset_is_priced_at_its_long_rows(tmp_path, fixed_rates, capsys):
    """``specheads plan target=qwen3_8b_reasoning``: rows of its data_preset.max_length (16384), training batches of
    one such row, 7 training-time-test steps, 10 epochs; a token costs more to collect and to train than with
    ``qwen3_8b`` (the same target and TTT 7, priced at ShareGPT's 1,350-token rows)."""
    from tests.test_hydra_configs import load_recipe
    from tests.test_target_presets import compose

    plan = load_recipe("plan.py")
    common = ["method=eagle3", "plan.num_samples=1000", "plan.device=cpu", "plan.disk_dir=null",
              f"prepared_dir={tmp_path / 'none'}"]
    long = plan.run(compose("plan", "target=qwen3_8b_reasoning", *common))
    assert "attention over rows of 16384 tokens" in capsys.readouterr().out
    assert (long.attention.row_tokens, long.lm_head.train_tokens, long.epochs) == (16384, 16384, 10)
    assert long.tokens == 1000 * 16384
    short = plan.run(compose("plan", "target=qwen3_8b", *common))
    assert short.attention.row_tokens == 1350 and (short.lm_head.train_tokens, short.epochs) == (2048, 10)
    assert long.collect_s / long.tokens > 1.2 * short.collect_s / short.tokens
    assert long.train_offline_s / long.tokens > 1.1 * short.train_offline_s / short.tokens
