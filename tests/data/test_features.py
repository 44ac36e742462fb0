"""Feature store, collection and reader on a tiny random Llama and a tiny prepared dataset."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specheads.data.features import (
    CollectOptions, FeatureDataset, OnlineFeatures, TokenDataset, add_features, check_disk_space,
    collate_features, collect_hidden_states, compute_features, feature_loader, length_batches,
    plan_shards, spec_for_method,
)
from specheads.data.prepare import load_prepared, write_prepared
from specheads.data.store import (
    MANIFEST, CorruptShardError, InsufficientDiskError, StoreMismatchError, bytes_per_token, disk_slack,
    dequantize_fp8, quantize_fp8, read_manifest, record_file, verify_store,
)
from specheads.targets import Target
from specheads.methods.base import FeatureSpec
from tests.conftest import make_tiny_model, make_tiny_target

REPO = Path(__file__).resolve().parents[2]
SPEC = FeatureSpec(aux_layers=(3, 0, 2), need_last=True)  # deliberately not sorted
SMALL = dict(shard_bytes=6000, batch_tokens=64, max_batch_size=8)


def make_prepared(root: Path, n: int = 24, vocab: int = 256, seed: int = 0, fingerprint: str = "none") -> Path:
    """A prepared folder of n random samples of 3..20 tokens, written by the prepare stage's writer."""
    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "input_ids": [], "loss_mask": [], "domain": []}
    for i in range(n):
        t = int(torch.randint(3, 21, (1,), generator=g))
        rows["id"].append(f"conv-{i}")
        rows["input_ids"].append(torch.randint(0, vocab, (t,), generator=g).tolist())
        rows["loss_mask"].append([0] * (t // 3) + [1] * (t - t // 3))
        rows["domain"].append("chat")
    path = root / "prepared"
    write_prepared(rows, {"target": "tiny", "tokenizer_fingerprint": fingerprint, "max_length": 32}, path)
    return path


@pytest.fixture
def prepared(tmp_path):
    return load_prepared(make_prepared(tmp_path))[0]


def collect(target, dataset, root, spec=SPEC, **kw):
    return collect_hidden_states(target, dataset, spec, root, CollectOptions(**{**SMALL, **kw}))


def shard_digests(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((root / "shards").glob("*.safetensors"))}


def single_sample_features(target, item, spec=SPEC):
    batch = collate_features([{"input_ids": item["input_ids"], "loss_mask": item["loss_mask"]}])
    return compute_features(target, batch, spec)


# --------------------------------------------------------------------------- computing


def test_compute_features_are_hf_hidden_states_post_norm_last(tiny_target):
    ids = torch.randint(0, 256, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    out = compute_features(tiny_target, {"input_ids": ids, "attention_mask": mask, "loss_mask": mask}, SPEC)
    ref = tiny_target.model(ids, attention_mask=mask, output_hidden_states=True)
    aux = torch.cat([ref.hidden_states[i] for i in SPEC.aux_layers], dim=-1)
    torch.testing.assert_close(out["hidden_aux"][0], aux[0])
    torch.testing.assert_close(out["hidden_last"][0], ref.hidden_states[-1][0])
    # last is post-norm: the final norm of the last layer's output, and the LM head applied to it gives the logits
    pre = {}
    hook = tiny_target.layers[-1].register_forward_hook(lambda m, a, o: pre.setdefault("h", o[0] if isinstance(o, tuple) else o))
    compute_features(tiny_target, {"input_ids": ids[:1]}, SPEC)
    hook.remove()
    torch.testing.assert_close(out["hidden_last"][0], tiny_target.decoder.norm(pre["h"])[0])
    assert not torch.allclose(out["hidden_last"][0], pre["h"][0])
    torch.testing.assert_close(tiny_target.logits(out["hidden_last"])[1, :6], ref.logits[1, :6])
    assert out["hidden_last"].dtype == torch.float32 and out["hidden_aux"].shape == (2, 9, 3 * 64)
    assert out["hidden_last"][1, 6:].abs().sum() == 0 and out["hidden_aux"][1, 6:].abs().sum() == 0
    alone = compute_features(tiny_target, {"input_ids": ids[1:, :6]}, SPEC)
    torch.testing.assert_close(out["hidden_last"][1, :6], alone["hidden_last"][0])


def test_spec_for_method():
    assert spec_for_method("eagle3", 30) == FeatureSpec((2, 15, 27), True, image_rows=True)  # trains on image rows
    assert not spec_for_method("eagle1", 30).image_rows and not spec_for_method("medusa1", 30).image_rows
    assert spec_for_method("eagle3", 30, [1, 2, 3]).aux_layers == (1, 2, 3)
    assert spec_for_method("eagle1", 30) == FeatureSpec((), True)
    assert spec_for_method("medusa1", 30).aux_layers == ()
    assert spec_for_method("medusa2", 30).online_only
    with pytest.raises(ValueError, match="unknown method"):
        spec_for_method("hydra", 30)


# --------------------------------------------------------------------------- store round trip


def test_store_round_trip_float32(tiny_target, prepared, tmp_path):
    root = tmp_path / "store"
    summary = collect(tiny_target, prepared, root, dtype="float32")
    manifest = verify_store(root)
    assert summary["manifest"] == manifest and manifest["num_shards"] > 2
    assert manifest["num_samples"] == len(prepared) == sum(s["num_samples"] for s in manifest["shards"])
    assert manifest["num_tokens"] == sum(len(x) for x in prepared["input_ids"])
    assert manifest["num_loss_tokens"] == sum(sum(m) for m in prepared["loss_mask"])
    assert manifest["aux_layers"] == [3, 0, 2] and manifest["has_last"] and manifest["dtype"] == "float32"
    assert manifest["target_config_hash"] == tiny_target.config_hash()
    assert manifest["tokenizer_fingerprint"] == tiny_target.tokenizer_fingerprint()
    for rec in manifest["shards"]:  # checksums are those of the files on disk
        assert hashlib.sha256((root / rec["file"]).read_bytes()).hexdigest() == rec["sha256"]
    lengths = [len(prepared[i]["input_ids"]) for i in range(len(prepared))]
    assert all(a <= b for a, b in zip(FeatureDataset(root).lengths, sorted(lengths)[1:] + [99]))  # sorted

    ds = FeatureDataset(root, SPEC, tiny_target)
    by_id = {r["id"]: r for r in prepared}
    assert sorted(ds.ids) == sorted(by_id)
    for i in range(len(ds)):
        item = ds[i]
        row = by_id[item["id"]]
        assert item["input_ids"].tolist() == row["input_ids"] and item["loss_mask"].tolist() == row["loss_mask"]
        ref = single_sample_features(tiny_target, item)
        torch.testing.assert_close(item["hidden_last"], ref["hidden_last"][0])
        torch.testing.assert_close(item["hidden_aux"], ref["hidden_aux"][0])
        # the target's full-vocabulary argmax, stored so training needs no full logits
        assert item["target_argmax"].tolist() == tiny_target.logits(ref["hidden_last"][0]).argmax(-1).tolist()
    assert manifest["has_argmax"]
    batch = collate_features([ds[0], ds[1]])
    n0 = len(ds[0]["input_ids"])
    assert batch["target_argmax"].shape == batch["input_ids"].shape
    assert batch["target_argmax"][0, :n0].tolist() == ds[0]["target_argmax"].tolist()


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 2**-8), ("float16", 2**-11)])
def test_half_stores_round_to_their_dtype(tiny_target, prepared, tmp_path, dtype, tol):
    collect(tiny_target, prepared, tmp_path / "s", dtype=dtype)
    ds = FeatureDataset(tmp_path / "s", SPEC, tiny_target)
    for i in (0, len(ds) - 1):
        ref = single_sample_features(tiny_target, ds[i])
        for key in ("hidden_last", "hidden_aux"):
            got, want = ds[i][key], ref[key][0]
            assert got.dtype == torch.float32
            assert ((got - want).abs() <= want.abs() * tol + 1e-6).all(), key


def test_bytes_per_token_per_dtype(tiny_target, prepared, tmp_path):
    # SmolLM2 (H=576): EAGLE-3 stores 3 aux + last = 4 vectors per token
    assert bytes_per_token(576, 3, True, "bf16") == 9 + 4 * 576 * 2  # ids, mask, target argmax + vectors
    assert bytes_per_token(576, 3, True, "fp8") == 9 + 4 * 576 + 4 * 4
    assert bytes_per_token(576, 0, True, "fp16") == 9 + 576 * 2
    for dtype in ("bfloat16", "fp8_e4m3"):
        m = collect(tiny_target, prepared, tmp_path / dtype, dtype=dtype)["manifest"]
        per_token = m["bytes_on_disk"] / m["num_tokens"]
        assert m["bytes_per_token"] <= per_token < m["bytes_per_token"] * 1.5  # headers + offsets on top


# --------------------------------------------------------------------------- fp8


def test_fp8_round_trip_error_is_bounded():
    torch.manual_seed(0)
    x = torch.randn(64, 3 * 48) * torch.logspace(-3, 2, 64).unsqueeze(1)
    x[:, 5] *= 50  # an outlier channel, like the massive activations of real models
    q, scale = quantize_fp8(x, groups=3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 3)
    back = dequantize_fp8(q, scale)
    s = scale.repeat_interleave(48, dim=1)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 (in scaled units)
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    assert (back - x).norm() / x.norm() < 0.04
    assert (back.view(64, 3, 48).abs().amax(-1) - x.view(64, 3, 48).abs().amax(-1)).abs().max() < 1e-3 * x.abs().max()


def test_fp8_store_close_to_float32_store(tiny_target, prepared, tmp_path):
    collect(tiny_target, prepared, tmp_path / "f32", dtype="float32")
    collect(tiny_target, prepared, tmp_path / "fp8", dtype="fp8")
    a, b = FeatureDataset(tmp_path / "f32"), FeatureDataset(tmp_path / "fp8")
    assert a.ids == b.ids
    for i in range(len(a)):
        for key in ("hidden_last", "hidden_aux"):
            exact, approx = a[i][key], b[i][key]
            assert (approx - exact).norm() <= 0.04 * exact.norm(), (i, key)


# --------------------------------------------------------------------------- resuming and ranks


def test_rerun_skips_finished_and_redoes_partial(tiny_target, prepared, tmp_path):
    root = tmp_path / "s"
    first = collect(tiny_target, prepared, root)
    digests = shard_digests(root)
    # a shard whose record is missing (killed between file and record) and a stale temp file
    (root / record_file(1)).unlink()
    (root / "shards" / "00002.safetensors.tmp999").write_bytes(b"half a shard")
    (root / MANIFEST).unlink()
    again = collect(tiny_target, prepared, root)
    assert again["shards_written"] == 1 and again["shards_skipped"] == first["shards_written"] - 1
    assert shard_digests(root) == digests and not list((root / "shards").glob("*.tmp*"))
    assert verify_store(root)["num_samples"] == len(prepared)


def test_store_with_other_settings_is_refused(tiny_target, prepared, tmp_path):
    collect(tiny_target, prepared, tmp_path / "s")
    with pytest.raises(StoreMismatchError, match="dtype"):
        collect(tiny_target, prepared, tmp_path / "s", dtype="float16")


def test_two_ranks_write_the_same_store_as_one(tiny_target, prepared, tmp_path):
    one = collect(tiny_target, prepared, tmp_path / "one")["manifest"]
    r0 = collect(tiny_target, prepared, tmp_path / "two", rank=0, world_size=2)
    assert r0["manifest"] is None  # rank 1 has not written its shards yet
    r1 = collect(tiny_target, prepared, tmp_path / "two", rank=1, world_size=2)
    assert r1["manifest"] == read_manifest(tmp_path / "two")
    assert shard_digests(tmp_path / "one") == shard_digests(tmp_path / "two")
    assert r1["manifest"]["shards"] == one["shards"]
    ids = [set(s["ids"]) for s in r1["manifest"]["shards"]]
    rank_ids = [set().union(*ids[r::2]) for r in (0, 1)]
    assert not rank_ids[0] & rank_ids[1] and rank_ids[0] | rank_ids[1] == set(prepared["id"])
    assert r0["samples"] + r1["samples"] == len(prepared)
    assert abs(r0["samples"] - r1["samples"]) <= len(prepared) // 4


KILL_SCRIPT = textwrap.dedent("""
    import logging, os, signal, sys
    from tests.conftest import make_tiny_target
    from specheads.data.features import CollectOptions, collect_hidden_states
    from specheads.data.prepare import load_prepared
    from specheads.methods.base import FeatureSpec

    logging.basicConfig(level=logging.INFO)
    prepared, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    target = make_tiny_target("llama")
    calls = [0]

    def kill_on_forward(module, args, output):
        calls[0] += 1
        if calls[0] == kill_at:  # mid-shard: earlier shards are written or being written
            os.kill(os.getpid(), signal.SIGKILL)

    target.decoder.register_forward_hook(kill_on_forward)
    opts = CollectOptions(dtype="bfloat16", shard_bytes=6000, batch_tokens=64, max_batch_size=8)
    collect_hidden_states(target, load_prepared(prepared)[0], FeatureSpec((3, 0, 2), True), out, opts)
""")


def test_sigkill_mid_shard_then_rerun_gives_the_same_store(tiny_target, tmp_path):
    prep = make_prepared(tmp_path)
    script = tmp_path / "collect_and_die.py"
    script.write_text(KILL_SCRIPT)
    # same thread count as this process, so both compute bit-identical features
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    out = tmp_path / "killed"
    killed = subprocess.run([sys.executable, str(script), str(prep), str(out), "9"], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert "(0 finished already)" in killed.stderr and not (out / MANIFEST).exists()
    finished = len(list((out / "shards").glob("*.json")))
    dataset = load_prepared(prep)[0]
    assert 1 <= finished < json.loads((out / "plan.json").read_text())["num_shards"]
    rerun = collect_hidden_states(tiny_target, dataset, SPEC, out, CollectOptions(dtype="bfloat16", **SMALL))
    assert rerun["shards_skipped"] == finished and rerun["shards_written"] >= 1
    clean = tmp_path / "clean"
    collect_hidden_states(tiny_target, dataset, SPEC, clean, CollectOptions(dtype="bfloat16", **SMALL))
    m_killed, m_clean = verify_store(out), verify_store(clean)
    assert m_killed["shards"] == m_clean["shards"]  # same ids, lengths and checksums, shard by shard
    assert shard_digests(out) == shard_digests(clean)


# --------------------------------------------------------------------------- integrity and identity


def test_corrupt_shard_is_detected_named_and_redone(tiny_target, prepared, tmp_path):
    root = tmp_path / "s"
    collect(tiny_target, prepared, root)
    path = root / "shards" / "00001.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="00001.safetensors"):
        verify_store(root)
    ds = FeatureDataset(root)
    bad = next(i for i, (s, _, _) in enumerate(ds.locations) if s == 1)
    with pytest.raises(CorruptShardError, match="00001.safetensors.*corrupt"):
        ds[bad]
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(CorruptShardError, match="00001.safetensors has"):
        FeatureDataset(root)
    again = collect(tiny_target, prepared, root)
    assert again["shards_written"] == 1 and verify_store(root)


def test_store_from_another_target_or_tokenizer_is_refused(tiny_target, prepared, tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    collect(tiny_target, prepared, tmp_path / "s")
    other = make_tiny_target("llama", hidden=32)
    with pytest.raises(StoreMismatchError, match="config hash"):
        FeatureDataset(tmp_path / "s", SPEC, other)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")))
    same_model_other_tokenizer = Target(make_tiny_model("llama"), tokenizer=tok, name="tiny-with-tokenizer")
    with pytest.raises(StoreMismatchError, match="tokenizer fingerprint"):
        FeatureDataset(tmp_path / "s", SPEC, same_model_other_tokenizer)
    with pytest.raises(StoreMismatchError, match=r"missing \[1\]"):
        FeatureDataset(tmp_path / "s", FeatureSpec((1, 2), True), tiny_target)
    with pytest.raises(StoreMismatchError, match="online_only"):
        FeatureDataset(tmp_path / "s", FeatureSpec((), True, online_only=True), tiny_target)


def test_online_only_method_is_not_collected(tiny_target, prepared, tmp_path):
    with pytest.raises(ValueError, match="online"):
        collect(tiny_target, prepared, tmp_path / "s", spec=FeatureSpec((), True, online_only=True))


def test_disk_refusal_is_clear(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(InsufficientDiskError, match=r"needs ~.*GiB.*free.*fp8"):
        check_disk_space(tmp_path / "new" / "store", free + 2**40)
    check_disk_space(tmp_path, 1000)


def test_disk_slack_scales_with_the_store(tmp_path, monkeypatch):
    """A small store fits a nearly full disk (CI machines have had 0.7 GiB free); a large one keeps 1 GiB spare."""
    free = int(0.68 * 2**30)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(free * 4, free * 3, free))
    check_disk_space(tmp_path / "store", 300_000)
    check_disk_space(tmp_path / "store", int(0.5 * 2**30))
    with pytest.raises(InsufficientDiskError, match=r"needs ~0\.65 GiB \(\+0\.13 GiB slack\), 0\.68 GiB are free"):
        check_disk_space(tmp_path / "store", int(0.65 * 2**30))
    assert disk_slack(100 * 2**30) == 2**30 and disk_slack(0) == 64 * 2**20


def test_estimate_is_logged_before_collection(tiny_target, prepared, tmp_path, caplog):
    caplog.set_level("INFO", logger="specheads.data.features")
    collect(tiny_target, prepared, tmp_path / "s")
    text = caplog.text
    assert "GiB in all" in text and "estimated collection time" in text
    assert text.index("estimated collection time") < text.index("wrote")


# --------------------------------------------------------------------------- reader, batching, online


def test_offline_and_online_batches_are_equal(tiny_target, prepared, tmp_path):
    collect(tiny_target, prepared, tmp_path / "s", dtype="float32")
    offline = FeatureDataset(tmp_path / "s", SPEC, tiny_target)
    tokens = TokenDataset(prepared)
    assert sorted(offline.lengths) == sorted(tokens.lengths)
    online = OnlineFeatures(tiny_target, SPEC)
    by_id = {offline.ids[i]: i for i in range(len(offline))}
    order = [by_id[str(x)] for x in prepared["id"]]  # same samples in the same batches
    for batch_ids in length_batches(range(len(tokens)), tokens.lengths, 40, 4):
        off = collate_features([offline[order[i]] for i in batch_ids])
        on = online(collate_features(tokens.rows(batch_ids)))
        # the store adds the target's argmax; online batches leave it to the method
        assert set(off) - {"target_argmax"} == set(on) == {"input_ids", "attention_mask", "loss_mask",
                                                            "hidden_last", "hidden_aux"}
        for key in on:
            torch.testing.assert_close(on[key], off[key])
        assert add_features(off, tiny_target, SPEC) is off  # offline batches pass through


def test_reader_selects_and_orders_aux_layers(tiny_target, prepared, tmp_path):
    collect(tiny_target, prepared, tmp_path / "s", dtype="float32")
    spec = FeatureSpec(aux_layers=(2, 3), need_last=False)
    ds = FeatureDataset(tmp_path / "s", spec, tiny_target)
    item = ds[3]
    assert "hidden_last" not in item
    torch.testing.assert_close(item["hidden_aux"], single_sample_features(tiny_target, item, spec)["hidden_aux"][0])


def test_loader_batches_within_token_budget_cover_every_sample(tiny_target, prepared, tmp_path):
    collect(tiny_target, prepared, tmp_path / "s")
    ds = FeatureDataset(tmp_path / "s", SPEC, tiny_target)
    seen = []
    for batch in feature_loader(ds, max_tokens=48, shuffle=True, seed=1):
        B, T = batch["input_ids"].shape
        assert B * T <= 48 or B == 1
        assert batch["hidden_aux"].shape == (B, T, 3 * 64) and batch["hidden_last"].dtype == torch.float32
        assert (batch["hidden_last"][batch["attention_mask"] == 0] == 0).all()
        seen += batch["input_ids"].ne(0).sum(1).tolist()
    assert len(seen) == len(ds)
    ranks = [feature_loader(ds, max_tokens=48, seed=1, rank=r, world_size=2).batch_sampler for r in (0, 1)]
    flat = [set(i for b in s for i in b) for s in ranks]
    assert not flat[0] & flat[1] and len(ranks[0]) == len(ranks[1])


def test_plan_is_sorted_and_within_budget():
    lengths = [5, 1, 9, 3, 3, 7, 2]
    shards = plan_shards(lengths, shard_tokens=10, shard_samples=3)
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(7)) and [lengths[i] for i in flat] == sorted(lengths)
    assert all(len(s) <= 3 and (sum(lengths[i] for i in s) <= 10 or len(s) == 1) for s in shards)
    assert length_batches([1, 6, 3], lengths, max_tokens=6, max_batch_size=None) == [[1, 6], [3]]
    assert length_batches([1, 6, 3, 2], lengths, max_tokens=9, max_batch_size=None) == [[1, 6, 3], [2]]
    assert length_batches([1, 6, 3], lengths, max_tokens=None, max_batch_size=2) == [[1, 6], [3]]


def test_missing_store_error_is_clear(tmp_path):
    with pytest.raises(Exception, match="no feature store manifest.*specheads collect"):
        FeatureDataset(tmp_path)
    (tmp_path / "plan.json").write_text(json.dumps({}))
    with pytest.raises(Exception, match="has not finished"):
        FeatureDataset(tmp_path)


@pytest.mark.parametrize("name", ["medusa1", "medusa2", "eagle1", "eagle3"])
def test_spec_for_method_agrees_with_the_method_registry(name):
    from specheads.methods import build_method

    target = make_tiny_target("llama", layers=6)
    method = build_method(name)
    if hasattr(method, "bind"):
        method.bind(target)
    ours = spec_for_method(name, target.num_layers)
    assert ours.aux_layers == method.feature_spec.aux_layers and ours.online_only == method.feature_spec.online_only
    if not ours.online_only:
        assert ours.need_last == method.feature_spec.need_last


def test_float16_overflow_is_refused_not_stored_as_inf():
    from specheads.data.store import StoreError, encode_hidden

    with pytest.raises(StoreError, match="overflow float16"):
        encode_hidden("hidden_last", torch.tensor([[1.0, 7e4]]), "float16")
    assert encode_hidden("hidden_last", torch.tensor([[1.0, 7e4]]), "bfloat16")["hidden_last"].isfinite().all()


def test_writer_error_surfaces_in_the_collecting_call(prepared, tmp_path):
    from specheads.data.store import StoreError

    target = make_tiny_target("llama")
    target.embed_tokens.weight.data *= 1e6  # residual stream far beyond float16's range
    with pytest.raises(StoreError, match="overflow float16"):
        collect(target, prepared, tmp_path / "s", dtype="float16")
    assert not (tmp_path / "s" / MANIFEST).exists()


def test_loader_workers_reopen_shards_and_give_the_same_batches(tiny_target, prepared, tmp_path):
    collect(tiny_target, prepared, tmp_path / "s")
    ds = FeatureDataset(tmp_path / "s", SPEC, tiny_target)
    ds[0]  # an open shard handle must not travel to the workers
    serial = list(feature_loader(ds, max_tokens=64, seed=3))
    parallel = list(feature_loader(ds, max_tokens=64, seed=3, num_workers=2))
    assert len(serial) == len(parallel)
    for a, b in zip(serial, parallel):
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_shards_are_cut_by_tokens_so_a_long_row_fills_its_own():
    """16 rows of 2k tokens share one shard of a 32k-token budget; each 32k-token row is a shard of its own."""
    lengths = [2048] * 16 + [32768] * 2
    shards = plan_shards(lengths, shard_tokens=32768, shard_samples=8192)
    assert shards == [list(range(16)), [16], [17]]


def test_the_shard_writer_holds_a_bounded_number_of_tokens_whatever_the_rows_length(tmp_path, monkeypatch):
    """With ``max_pending_tokens`` the producer waits while the batches handed over and not yet encoded would pass
    the bound: two 1k-token batches wait together under a 4k bound, a 4k-token row's batch waits alone."""
    import threading

    from specheads.data.store import ShardWriter

    gate = threading.Event()
    writer = ShardWriter(tmp_path, "float32", 1, "plan", max_pending=8, max_pending_tokens=4096)
    rows = writer._rows
    monkeypatch.setattr(writer, "_rows", lambda b: (gate.wait(), rows(b))[1])  # the writer stalls until the gate opens

    def batch(T):
        return {"input_ids": torch.zeros(1, T, dtype=torch.long), "attention_mask": torch.ones(1, T, dtype=torch.long),
                "loss_mask": torch.ones(1, T, dtype=torch.long), "hidden_last": torch.zeros(1, T, 4)}

    writer.add(batch(1024))
    writer.add(batch(1024))  # within the bound: handed over at once
    assert writer._tokens == 2048
    done = threading.Event()
    threading.Thread(target=lambda: (writer.add(batch(4096)), done.set()), daemon=True).start()
    assert not done.wait(0.5) and writer._tokens == 2048  # would pass 4096: waits for the writer
    gate.set()
    assert done.wait(10)
    writer.finish(0, ["a", "b", "c"])
    assert [r.num_tokens for r in writer.close()] == [1024 + 1024 + 4096] and writer._tokens == 0
