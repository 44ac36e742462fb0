"""The linear layers' row floors and forms, remembered per key (``exact.remembered_form``): a second proof of the
same kinds on the same machine and kernels measures nothing, another key measures again, the cache file is checked
when read, and the end-to-end proof runs every time, a remembered floor it refutes measured again."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from tests.conftest import make_tiny_model
import specheads.decoding.exact as exact
from specheads.decoding.exact import ExactDecodeCalls, make_exact, prove_exact


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Nothing remembered to begin with (this process's memo and the cache folder fresh); counts the measurements
    (``layer_row_floor``) and the proofs (``tree_vs_sequential``) made."""
    monkeypatch.setattr(exact, "_FORM_MEMO", {})
    monkeypatch.setattr(exact, "memo_dir", lambda: tmp_path / "row_floors")
    monkeypatch.setattr(exact, "FORMS", ("linear",))  # the layers' own forward: no timed choice of form
    counts = {"floors": 0, "proofs": 0}
    real_floor, real_proof = exact.layer_row_floor, exact.tree_vs_sequential

    def floor(*a, **k):
        counts["floors"] += 1
        return real_floor(*a, **k)

    def proof(*a, **k):
        counts["proofs"] += 1
        return real_proof(*a, **k)

    monkeypatch.setattr(exact, "layer_row_floor", floor)
    monkeypatch.setattr(exact, "tree_vs_sequential", proof)
    return counts


def _model(**kw):
    model = make_tiny_model("llama", layers=1, **kw)
    make_exact(model, "on")
    return model


def _kinds(model) -> int:
    return len({exact.linear_kind(m) for m in model.modules() if isinstance(m, torch.nn.Linear)})


def test_a_second_proof_of_the_same_kinds_measures_nothing_and_still_proves(measured):
    n = _kinds(_model())
    first = prove_exact(_model())
    assert first["proven"] and first["floor_recalled"] == [] and measured == {"floors": n, "proofs": 1}
    second = prove_exact(_model(seed=1))  # other weights, the same kinds of layer
    assert measured == {"floors": n, "proofs": 2}  # the proof ran again, no floor was measured
    assert second["proven"] and sorted(second["floor_recalled"]) == sorted(first["row_form"])
    assert second["row_floor"] == first["row_floor"] and second["row_form"] == first["row_form"]


def test_another_thread_count_dtype_or_kernel_setting_measures_again(measured, monkeypatch):
    n = _kinds(_model())
    prove_exact(_model())
    assert measured["floors"] == n
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        prove_exact(_model())
    finally:
        torch.set_num_threads(threads)
    assert measured["floors"] == 2 * n
    prove_exact(_model(dtype=torch.float64))
    assert measured["floors"] == 3 * n
    # another instruction set asked of PyTorch: read at the key (this process's dispatch was fixed at its first op,
    # so nothing else changes here); CI's AVX2 pass sets it already
    before = os.environ.get("ATEN_CPU_CAPABILITY")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default" if before != "default" else "avx2")
    prove_exact(_model())
    assert measured["floors"] == 4 * n
    if before is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", before)
    prove_exact(_model())
    assert measured["floors"] == 4 * n  # the first key again: remembered


def test_the_dtype_probe_and_the_proof_share_the_measurement(measured):
    """The evaluate stage's dtype probe (``ExactDecodeCalls``) measures the floors of the target's kinds; the proof
    that follows on the loaded target recalls them."""
    model = make_tiny_model("llama", layers=1)
    weights = {(m.in_features, m.out_features): m.weight.detach() for m in model.modules()
               if isinstance(m, torch.nn.Linear)}
    rows = ExactDecodeCalls(tokens=4)
    rows("float32", weights)
    assert measured["floors"] == len(weights)
    make_exact(model, "on")
    record = prove_exact(model)
    assert measured["floors"] == len(weights) and len(record["floor_recalled"]) == _kinds(model)
    assert record["row_floor"] == rows.floors["float32"] and record["proven"]


def test_another_process_recalls_the_cache_file(measured, monkeypatch):
    first = prove_exact(_model())
    files = sorted(exact.memo_dir().glob("*.json"))
    assert len(files) == _kinds(_model()) and not list(exact.memo_dir().glob("*.tmp"))
    monkeypatch.setattr(exact, "_FORM_MEMO", {})  # a new process: only the files remain
    second = prove_exact(_model())
    assert measured == {"floors": len(files), "proofs": 2} and second["row_floor"] == first["row_floor"]


def _tamper_truncate(data: dict, text: str) -> str:
    return text[: len(text) // 2]


def _tamper_floor(data: dict, text: str) -> str:
    data["pick"]["floor"] = 1 if data["pick"]["floor"] != 1 else 2  # a plausible value the checksum does not cover
    return json.dumps(data)


def _tamper_key(data: dict, text: str) -> str:
    data["key"]["threads"] += 1  # another key's file under this key's name
    data["sha256"] = exact._digest([data["key"], data["pick"]])
    return json.dumps(data)


@pytest.mark.parametrize("tamper", [_tamper_truncate, _tamper_floor, _tamper_key])
def test_a_corrupt_cache_file_is_logged_ignored_and_measured_again(measured, monkeypatch, caplog, tamper):
    n = _kinds(_model())
    prove_exact(_model())
    monkeypatch.setattr(exact, "_FORM_MEMO", {})
    for path in exact.memo_dir().glob("*.json"):
        text = path.read_text()
        path.write_text(tamper(json.loads(text), text))
    with caplog.at_level(logging.WARNING, logger=exact.__name__):
        record = prove_exact(_model())
    assert measured["floors"] == 2 * n and record["floor_recalled"] == [] and record["proven"]
    assert sum("row floor cache" in r.getMessage() for r in caplog.records) == n
    monkeypatch.setattr(exact, "_FORM_MEMO", {})  # measured again and written whole: the next process recalls it
    assert len(prove_exact(_model())["floor_recalled"]) == n and measured["floors"] == 2 * n


def _moves_below(model, rows: int) -> None:
    """Every linear layer a kernel whose calls of fewer than ``rows`` rows sum in another order (as a one-row
    kernel does): its measured floor is ``rows``."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            inner = m.forward
            m.forward = lambda x, inner=inner: inner(x) + (1e-3 if x.reshape(-1, x.shape[-1]).shape[0] < rows else 0.0)


def test_a_remembered_floor_the_proof_refutes_is_measured_again(measured, caplog):
    model = _model()
    n = _kinds(model)
    _moves_below(model, 3)
    for m in {exact.linear_kind(m): m for m in model.modules() if isinstance(m, torch.nn.Linear)}.values():
        key = exact.form_key(m, True)  # a floor of 1 remembered for every kind: wrong on this model's kernels
        exact.remember_form(key, {"form": "linear", "floor": 1, "floors": {"linear": 1}, "ms": {}})
    with caplog.at_level(logging.WARNING, logger=exact.__name__):
        record = prove_exact(model)
    assert measured == {"floors": n, "proofs": 2}  # proven in the remembered floor: refuted; measured, proven again
    # 3 at least (the kernels' own floor may be higher)
    assert record["proven"] and record["row_floor"] >= 3 and record["floor_recalled"] == []
    assert any("fail the proof" in r.getMessage() for r in caplog.records)
    again = _model()
    _moves_below(again, 3)
    assert prove_exact(again)["row_floor"] == record["row_floor"] and measured["floors"] == n  # remembered


class _MovesWithTheRows(torch.nn.Module):
    """An activation whose output moves once a forward feeds more than one row (no linear layer's floor fixes it)."""

    def forward(self, x):
        return x + 0.05 * (x.shape[-2] > 1)


def test_floors_that_stay_unproven_are_forgotten(measured):
    """A model no row floor makes exact: its measured floors are not kept, so the next proof measures them again."""
    model = _model()
    model.model.layers[0].mlp.act_fn = _MovesWithTheRows()
    assert not prove_exact(model)["proven"] and measured["proofs"] == 1
    assert not exact._FORM_MEMO and not list(exact.memo_dir().glob("*.json"))
