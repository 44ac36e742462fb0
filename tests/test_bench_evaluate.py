"""scripts/bench/bench_evaluate.py: a step's time split by phase, every verification backend decoding the same
tokens (a backend that differs fails the run), and a report that ``specheads record`` takes."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


def _bench():
    return load_script("scripts/bench/bench_evaluate.py")


ARGS = ["--target", "tiny", "--batch", "1", "3", "--nodes", "6", "--new-tokens", "6", "--prompt-len", "12",
        "--sequential-rows", "2", "--draft-vocab", "200"]


def test_every_backend_decodes_the_same_tokens_and_the_report_is_recorded(tmp_path):
    from specheads.record import Checkout, record

    out = tmp_path / "eval.json"
    assert _bench().main(ARGS + ["--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "eval_bench" and report["mismatches"] == [] and report["device"] == "cpu"
    got = {(r["batch"], r["nodes"], r["backend"]) for r in report["rows"]}
    assert got == {(1, 0, "plain"), (1, 6, "torch"), (1, 6, "rows"), (3, 0, "plain"), (3, 6, "torch"),
                   (3, 6, "rows"), (3, 6, "sequential")}  # triton needs CUDA
    for r in report["rows"]:
        parts = r["draft_ms"] + r["forward_ms"] + r["verify_ms"] + r["rest_ms"]
        assert parts == pytest.approx(r["ms_per_step"], rel=1e-6) and r["forward_ms"] > 0
        assert r["emitted"] == r["batch"] * 6 or (r["backend"] == "sequential" and r["emitted"] == 2 * 6)
        per_row = r["fed_per_step"] / (1 if r["backend"] == "sequential" else r["batch"])
        assert per_row == 1 if r["nodes"] == 0 else 1 < per_row <= 7  # the pending token (+ up to 6 drafts)
    results = tmp_path / "benchmarks.json"
    results.write_text(json.dumps({"runs": []}))
    entry = record(out, results, Checkout("0" * 40, False))
    assert json.loads(results.read_text())["eval_benches"] == [entry]
    assert entry["machine"] == report["machine"] and entry["rows"] == report["rows"]
    table = load_script("scripts/results_tables.py").eval_benches(json.loads(results.read_text()))
    assert "| 3 | 6 | sequential |" in table and "| 1 | - (plain) | plain |" in table


def test_a_backend_that_decides_otherwise_fails_the_run(monkeypatch, capsys):
    import specheads.decoding.batched_verify as bv

    real = bv.to_verdicts

    def off_by_one(*a):  # the batched decisions' bonus token shifted: other tokens than row by row
        verdicts = real(*a)
        for v in verdicts:
            v.bonus = (v.bonus + 1) % 1000
        return verdicts

    monkeypatch.setattr(bv, "to_verdicts", off_by_one)
    assert _bench().main(ARGS) == 1
    assert "MISMATCH B=1 nodes=6: rows decoded other tokens than torch" in capsys.readouterr().out


def test_sampled_steps_are_verified_row_by_row_by_each_backend(monkeypatch, tmp_path):
    import specheads.decoding.batched_verify as bv

    def no_batched_greedy(*a, **k):
        raise AssertionError("a sampled run verified a batch greedily")

    monkeypatch.setattr(bv, "verify_greedy_batched", no_batched_greedy)
    fused = []
    real = bv.verify_tree_sampling_batched
    monkeypatch.setattr(bv, "verify_tree_sampling_batched", lambda *a, **k: fused.append(k["backend"]) or real(*a, **k))
    out = tmp_path / "eval.json"
    args = ["--target", "tiny", "--batch", "2", "--nodes", "4", "--new-tokens", "4", "--prompt-len", "8",
            "--sequential-rows", "1", "--draft-vocab", "200", "--temperature", "1.0", "--json", str(out)]
    assert _bench().main(args) == 0
    report = json.loads(out.read_text())
    assert report["temperature"] == 1.0 and report["mismatches"] == []
    assert [r["backend"] for r in report["rows"]] == ["plain", "torch", "rows", "sequential"]
    assert fused and set(fused) == {"torch"}  # the torch backend's rows went through the fused per-row call
