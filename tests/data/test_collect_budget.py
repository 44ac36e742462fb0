"""Collection under a time budget: the prepared rows in order that fit, decided once and kept on a re-run."""

from __future__ import annotations

import json
import time

import pytest

from specheads.data.budget import BUDGET_FILE, decide, measure_rate, rows_within
from specheads.data.store import StoreMismatchError, read_manifest
from specheads.training.config import check_store_source
from tests.data.test_features import SPEC, collect, make_prepared, prepared, shard_digests  # noqa: F401 (fixture)
from specheads.data.prepare import load_prepared


def test_rows_within_takes_rows_in_order_and_at_least_one():
    assert rows_within([5, 5, 5], 10) == 2
    assert rows_within([5, 5, 5], 9.9) == 1
    assert rows_within([5, 5, 5], 0) == 1
    assert rows_within([5, 5, 5], 100) == 3


def test_measure_rate_times_a_warm_forward_of_mid_length_rows():
    calls = []

    def forward(rows):
        calls.append(rows)
        return 4 * len(rows)

    lengths = [4, 4, 4, 4, 4, 4, 30, 2]
    rate = measure_rate(forward, lengths, batch_tokens=64, probe_tokens=12, runs=3)
    assert rate > 0 and len(calls) == 4 and calls[0] == calls[1] == calls[3]  # a warm-up, then 3 timed runs
    assert all(lengths[i] == 4 for i in calls[0]) and len(calls[0]) == 3  # 3 rows of 4 fit 12 tokens


def test_the_fastest_timed_run_counts():
    """A pause of the machine slows one run; the rate is the fastest run's, not the slow ones'."""
    delays = iter([0.0, 0.2, 0.02, 0.2])  # warm-up, then a slow, a fast and a slow run

    def forward(rows):
        time.sleep(next(delays))
        return 100

    rate = measure_rate(forward, [4] * 4, batch_tokens=64, probe_tokens=8, runs=3)
    assert 2000 < rate <= 100 / 0.02  # the slow runs alone would read 500 tokens/s


def test_decide_writes_once_and_a_resume_keeps_the_decision(tmp_path):
    lengths = [10] * 20
    d = decide(tmp_path, lengths, 2.0, 1, True, rate=lambda: 1.0)  # 120 s x 1 token/s: 12 rows
    assert d["rows"] == 12 and d["tokens"] == 120 and d["prepared_rows"] == 20
    assert json.loads((tmp_path / BUDGET_FILE).read_text()) == d
    again = decide(tmp_path, lengths, 2.0, 1, True, rate=lambda: pytest.fail("decided already"))
    assert again == d
    other = decide(tmp_path, lengths, 2.0, 2, False, rate=lambda: pytest.fail("not the first process"))
    assert other == d  # a second process reads the first's decision


def test_two_processes_share_the_budget(tmp_path):
    assert decide(tmp_path, [10] * 20, 1.0, 2, True, rate=lambda: 1.0)["rows"] == 12  # 60 s x 2 processes


def test_a_tiny_budget_collects_the_first_rows_and_says_it_is_partial(tiny_target, prepared, tmp_path):
    root = tmp_path / "s"
    summary = collect(tiny_target, prepared, root, max_minutes=1e-9)
    manifest = read_manifest(root)
    assert manifest["num_samples"] == 1 == summary["samples"]
    assert [i for s in manifest["shards"] for i in s["ids"]] == [prepared["id"][0]]
    record = manifest["source"]["budget"]
    assert record["rows"] == 1 and record["prepared_rows"] == len(prepared) and record["tokens_per_s"] > 0


def test_a_budget_that_fits_keeps_the_whole_set(tiny_target, prepared, tmp_path):
    root = tmp_path / "s"
    collect(tiny_target, prepared, root, max_minutes=1e6)
    assert read_manifest(root)["num_samples"] == len(prepared)
    assert read_manifest(root)["source"]["budget"]["rows"] == len(prepared)


def test_a_resumed_budgeted_store_keeps_its_rows_and_shards(tiny_target, prepared, tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    lengths = [len(x) for x in prepared["input_ids"]]
    (root / BUDGET_FILE).write_text(json.dumps({"rows": 9, "prepared_rows": len(prepared), "max_minutes": 5.0,
                                                "tokens": sum(lengths[:9]), "tokens_per_s": 1.0, "processes": 1}))
    first = collect(tiny_target, prepared, root, max_minutes=5.0)
    digests = shard_digests(root)
    again = collect(tiny_target, prepared, root, max_minutes=5.0)
    assert first["samples"] == 9 and again["shards_written"] == 0 and shard_digests(root) == digests
    with pytest.raises(StoreMismatchError, match="another budget"):
        collect(tiny_target, prepared, root, max_minutes=7.0)


def test_training_accepts_a_budgeted_store_and_refuses_a_cut_one(tiny_target, tmp_path):
    path = make_prepared(tmp_path)
    prepared = load_prepared(path)[0]
    collect(tiny_target, prepared, tmp_path / "budgeted", max_minutes=1e-9)
    collect(tiny_target, prepared.select(range(3)), tmp_path / "cut")

    class Method:  # what check_store_source reads of a method
        name = "eagle3"
        feature_spec = SPEC

    check_store_source(tmp_path / "budgeted", path, Method())
    with pytest.raises(StoreMismatchError, match="other data"):
        check_store_source(tmp_path / "cut", path, Method())


def test_a_non_positive_budget_is_refused(tiny_target, prepared, tmp_path):
    with pytest.raises(ValueError, match="max_minutes"):
        collect(tiny_target, prepared, tmp_path / "s", max_minutes=0)



def test_the_time_estimate_uses_the_budgets_rate_without_another_timed_forward(tiny_target, prepared, tmp_path,
                                                                                monkeypatch, caplog):
    """The budget's probe measured the rate: the estimate reuses it, no extra forward is timed for it."""
    import logging

    import specheads.data.features as features

    calls = []
    real = features.compute_features
    monkeypatch.setattr(features, "compute_features", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    caplog.set_level(logging.INFO, logger=features.log.name)
    collect(tiny_target, prepared, tmp_path / "plain", estimate_time=True)
    assert "one timed batch" in caplog.text
    unbudgeted, calls[:] = len(calls), []  # the collection's batches + the estimate's one
    caplog.clear()
    collect(tiny_target, prepared, tmp_path / "s", max_minutes=1e6, estimate_time=True)
    assert len(calls) == unbudgeted - 1 + 4  # the same batches, the budget's warm-up and 3 timed runs, nothing else
    assert "the budget's measured rate" in caplog.text and "one timed batch" not in caplog.text


def _slow_collection(monkeypatch, seconds_per_batch: float):
    """A machine slower than its probe: the probe reads any rate (the budget takes every row), then every
    forward of the collection takes ``seconds_per_batch``."""
    import specheads.data.budget as budget
    import specheads.data.features as features

    monkeypatch.setattr(budget, "measure_rate", lambda *a, **kw: 1e12)
    real = features.compute_features

    def slow(*a, **kw):
        time.sleep(seconds_per_batch)
        return real(*a, **kw)

    monkeypatch.setattr(features, "compute_features", slow)


def _features_by_id(root, target):
    from specheads.data.features import FeatureDataset

    ds = FeatureDataset(root, SPEC, target)
    return {ds[i]["id"]: ds[i] for i in range(len(ds))}


def test_a_collection_past_its_deadline_is_cut_to_the_rows_it_collected(tiny_target, prepared, tmp_path,
                                                                         monkeypatch):
    import torch

    from specheads.data.budget import OVERRUN

    full = tmp_path / "full"
    collect(tiny_target, prepared, full)  # every row, no budget: the reference features
    _slow_collection(monkeypatch, 0.25)
    root = tmp_path / "s"
    minutes = 1.0 / 60 / OVERRUN  # a deadline 1 s after the collection began: 4 of its batches
    summary = collect(tiny_target, prepared, root, max_minutes=minutes)
    manifest = read_manifest(root)
    cut = json.loads((root / BUDGET_FILE).read_text())["cut"]
    assert json.loads((root / BUDGET_FILE).read_text())["rows"] == len(prepared)  # the budget took every row
    assert 0 < cut["rows"] == manifest["num_samples"] < len(prepared) and summary["manifest"] == manifest
    assert len(manifest["shards"]) >= 2  # finished shards kept beside the cut one's collected rows
    ids = sorted(i for s in manifest["shards"] for i in s["ids"])
    assert ids == sorted(prepared["id"][i] for i in cut["kept_rows"])
    lengths = sorted(len(x) for x in prepared["input_ids"])
    assert sorted(n for s in manifest["shards"] for n in s["lengths"]) == lengths[:cut["rows"]]  # shortest first
    assert manifest["source"]["budget"]["cut"]["rows"] == cut["rows"]
    reference, kept = _features_by_id(full, tiny_target), _features_by_id(root, tiny_target)
    for i, item in kept.items():
        for key in ("input_ids", "hidden_last", "hidden_aux", "target_argmax"):
            assert torch.equal(item[key], reference[i][key]), (i, key)
    digests = shard_digests(root)
    again = collect(tiny_target, prepared, root, max_minutes=minutes)  # a re-run keeps the cut store as it is
    assert again["shards_written"] == 0 and shard_digests(root) == digests and read_manifest(root) == manifest


def test_a_cut_killed_halfway_is_completed_by_the_rerun(tiny_target, prepared, tmp_path, monkeypatch):
    import specheads.data.features as features
    from specheads.data.budget import OVERRUN
    from specheads.data.store import PLAN

    _slow_collection(monkeypatch, 0.25)
    root = tmp_path / "s"
    minutes = 1.0 / 60 / OVERRUN
    real = features.replan

    def killed(*a, **kw):
        raise KeyboardInterrupt  # the process dies after budget.json recorded the cut, before the store moved

    monkeypatch.setattr(features, "replan", killed)
    with pytest.raises(KeyboardInterrupt):
        collect(tiny_target, prepared, root, max_minutes=minutes)
    cut = json.loads((root / BUDGET_FILE).read_text())["cut"]
    assert json.loads((root / PLAN).read_text())["plan_hash"] == cut["from_plan"]
    finished = shard_digests(root)
    assert finished  # shards finished before the cut, under the old plan
    monkeypatch.setattr(features, "replan", real)
    summary = collect(tiny_target, prepared, root, max_minutes=minutes)
    manifest = read_manifest(root)
    assert manifest["plan_hash"] == cut["to_plan"] and manifest["num_samples"] == cut["rows"]
    assert sorted(i for s in manifest["shards"] for i in s["ids"]) == sorted(prepared["id"][i] for i in cut["kept_rows"])
    assert summary["shards_written"] == len(manifest["shards"]) - len(finished)  # only the cut shard again
    assert {k: v for k, v in shard_digests(root).items() if k in finished} == finished
