"""The collect recipe end to end: a tiny Llama saved to a folder, 1 process vs 2 (torchrun)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.data.features import FeatureDataset
from specheads.data.store import verify_store
from specheads.targets import default_eagle3_layers, load_target, tokenizer_fingerprint
from tests.conftest import make_tiny_model
from tests.data.test_features import make_prepared, shard_digests

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """(model folder with a word-level tokenizer, prepared folder tokenized 'by' it)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("recipe")
    model_dir = root / "tiny-llama"
    make_tiny_model("llama", layers=6).save_pretrained(model_dir)
    vocab = {f"w{i}": i for i in range(256)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")),
                                  unk_token="w0", eos_token="w1")
    tok.save_pretrained(model_dir)
    prepared = make_prepared(root, n=30, fingerprint=tokenizer_fingerprint(tok))
    return model_dir, prepared


def run(cmd: list[str], *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*cmd, *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def overrides(model_dir: Path, prepared: Path, out: Path) -> list[str]:
    return [f"target.name_or_path={model_dir}", "target.dtype=float32", "target.device=cpu",
            f"prepared_dir={prepared}", f"out_dir={out}", "method=eagle3", "collect.shard_bytes=20000",
            "collect.batch_tokens=64"]


def test_one_process_and_two_processes_write_the_same_store(tiny_setup, tmp_path):
    model_dir, prepared = tiny_setup
    one = run([sys.executable, "-m", "specheads.cli", "collect"], *overrides(model_dir, prepared, tmp_path / "one"))
    assert "rank 0/1" in one.stdout and "store complete" in one.stdout
    assert re.search(r"~[\d.]+ GiB in all", one.stdout) and "estimated collection time" in one.stdout
    two = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
               "recipes/collect_hidden_states.py"], *overrides(model_dir, prepared, tmp_path / "two"))
    assert "rank 0/2" in two.stdout and "rank 1/2" in two.stdout and "store complete" in two.stdout

    m1, m2 = verify_store(tmp_path / "one"), verify_store(tmp_path / "two")
    assert m1["shards"] == m2["shards"] and shard_digests(tmp_path / "one") == shard_digests(tmp_path / "two")
    assert m1["aux_layers"] == list(default_eagle3_layers(6)) and m1["has_last"]
    per_rank = [{i for s in m2["shards"][r::2] for i in s["ids"]} for r in (0, 1)]
    assert not per_rank[0] & per_rank[1] and len(per_rank[0] | per_rank[1]) == 30
    assert all(10 <= len(ids) <= 20 for ids in per_rank)

    target = load_target(str(model_dir))
    ds = FeatureDataset(tmp_path / "two", target=target)
    assert len(ds) == 30 and ds[0]["hidden_aux"].shape[-1] == 3 * target.hidden_size


def test_rerun_skips_and_mismatched_tokenizer_is_refused(tiny_setup, tmp_path):
    model_dir, prepared = tiny_setup
    args = overrides(model_dir, prepared, tmp_path / "s")
    run([sys.executable, "recipes/collect_hidden_states.py"], *args)
    again = run([sys.executable, "recipes/collect_hidden_states.py"], *args)
    assert "wrote 0 shards" in again.stdout and "skipped" in again.stdout
    meta_path = prepared / "specheads_meta.json"
    meta = json.loads(meta_path.read_text())
    try:
        meta_path.write_text(json.dumps({**meta, "tokenizer_fingerprint": "0123456789abcdef"}))
        proc = subprocess.run([sys.executable, "recipes/collect_hidden_states.py", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode != 0 and "another tokenizer" in proc.stderr
    finally:
        meta_path.write_text(json.dumps(meta))


def test_bench_collect_reports_ratio_and_dtypes(tiny_setup, tmp_path):
    model_dir, prepared = tiny_setup
    out = tmp_path / "bench.json"
    run([sys.executable, "scripts/bench/bench_collect.py", "--target", str(model_dir), "--prepared", str(prepared),
         "--samples", "12", "--max-length", "32", "--batch-tokens", "64", "--repeats", "1", "--train-steps", "3",
         "--json", str(out)])
    report = json.loads(out.read_text())
    tp = report["throughput"]
    assert tp["samples"] == 12 and tp["tokens"] > 0 and tp["ratio_wall"] > 0 and tp["ratio_cpu"] > 0
    d = report["dtypes"]
    assert d["float32"]["rel_err_hidden_last"] == 0 and d["float32"]["target_top1_agreement"] == 1
    assert d["fp8_e4m3"]["bytes_per_token_payload"] < 0.55 * d["bfloat16"]["bytes_per_token_payload"]
    assert 0 < d["bfloat16"]["rel_err_hidden_aux"] < d["fp8_e4m3"]["rel_err_hidden_aux"] < 0.05
    losses = d["bfloat16"]["medusa1_train_loss"]
    assert losses["first"] > 0 and abs(losses["last"] - d["float32"]["medusa1_train_loss"]["last"]) < 0.05


def test_a_users_own_target_starts_on_a_cpu_without_device_or_dtype_overrides(tiny_setup, tmp_path):
    """``target=hf`` with only a folder: the preset's device and dtype are auto (a GPU preset's cuda/bfloat16
    crashed on a CPU machine), decided here and recorded in the store, within a collection budget."""
    model_dir, prepared = tiny_setup
    out = tmp_path / "hf"
    proc = run([sys.executable, "-m", "specheads.cli", "collect"], "target=hf", f"target.name_or_path={model_dir}",
               f"prepared_dir={prepared}", f"output_dir={out}", "method=eagle3", "collect.batch_tokens=64",
               "collect.max_minutes=1000")
    assert "store complete" in proc.stdout
    source = verify_store(out)["source"]
    import torch

    if not torch.cuda.is_available():
        assert source["target_dtype"]["value"] in ("float32", "bfloat16") and "cores" in source["machine"]
    assert source["budget"]["rows"] == source["budget"]["prepared_rows"] == 30


BAD_ENGINE_SETTINGS = [
    (["engine=sglang"], ["engine=sglang", "hf", "vllm", "auto"]),
    (["engine=vllm", "vllm.max_model_len=8"], ["vllm.max_model_len=8", "longest prepared row"]),
    (["engine=vllm", "method.aux_layers=[1,2,99]"], ["99", "out of range"]),
    (["engine=vllm", "target.parallel=tp"], ["vllm.tensor_parallel_size"]),
]


def test_a_bad_engine_setting_is_one_line_before_any_engine_starts(tiny_setup, tmp_path):
    """Refused before the engine is looked for: these fail the same with no engine installed. One command through
    the CLI (its one line and exit status); every bad setting through the recipe's own ``collect`` below."""
    model_dir, prepared = tiny_setup
    override, words = BAD_ENGINE_SETTINGS[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SPECHEADS_ENGINE_PYTHON": "/nonexistent"}
    proc = subprocess.run([sys.executable, "-m", "specheads.cli", "collect",
                           *overrides(model_dir, prepared, tmp_path / "out"), *override],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    assert proc.returncode == 2 and err.startswith("specheads collect: error:"), proc.stderr[-2000:]
    assert all(w in err for w in words), err


@pytest.mark.parametrize("override, words", BAD_ENGINE_SETTINGS)
def test_the_recipe_refuses_a_bad_engine_setting_before_any_engine_is_looked_for(tiny_setup, tmp_path, monkeypatch,
                                                                                 override, words):
    """The collect recipe's ``collect`` (what the CLI runs) on the composed config, with no engine to be found
    (a run that looked for one would fail otherwise): the setting's ConfigError, no store written."""
    import importlib.util

    from hydra import compose, initialize_config_dir

    from specheads.errors import ConfigError

    model_dir, prepared = tiny_setup
    monkeypatch.setenv("SPECHEADS_ENGINE_PYTHON", "/nonexistent")
    spec = importlib.util.spec_from_file_location("collect_recipe_engine_settings",
                                                  REPO / "recipes" / "collect_hidden_states.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)  # registers the schema
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose("collect_hidden_states", [*overrides(model_dir, prepared, tmp_path / "out"), *override])
    with pytest.raises(ConfigError) as e:
        recipe.collect(cfg)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_engine_auto_takes_the_transformers_forward_where_no_engine_is_found(tiny_setup, tmp_path):
    model_dir, prepared = tiny_setup
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SPECHEADS_ENGINE_VENV": "/nonexistent",
           "PATH": "/usr/bin:/bin"}  # no engine venv, no vllm on PATH
    proc = subprocess.run([sys.executable, "-m", "specheads.cli", "collect",
                           *overrides(model_dir, prepared, tmp_path / "out"), "engine=auto"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "engine=auto: the transformers forward runs the forward passes (no vLLM engine here" in proc.stdout + proc.stderr
    assert verify_store(tmp_path / "out")["source"]["engine"] == "hf"
