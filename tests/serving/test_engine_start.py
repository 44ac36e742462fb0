"""Engines started side by side (``engine_process.start_engines``) with the stand-in worker
(tests/serving/fake_engine_worker.py): both processes start before either is ready, and an engine that fails to
start (refused, or silent past the timeout) is named in the error while every process already started is closed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from specheads import engine_process as ep

FAKE_PYTHON = Path(__file__).with_name("fake_python.sh")
ENGINE = ep.Engine(str(FAKE_PYTHON), "0.32.0", "vllm.python")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone but not yet reaped
    except OSError:
        return False


def starts(path: Path) -> dict[tuple[str, str], dict]:
    """The stand-in workers' records: (kind, event) -> {pid, t}."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {(r["kind"], r["event"]): r for r in rows}


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_REAL_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_ENGINE_STARTS", str(tmp_path / "starts.jsonl"))
    for name in ("FAKE_ENGINE_LOAD_S", "FAKE_ENGINE_PLAIN_LOAD_S", "FAKE_ENGINE_SPEC_LOAD_S", "FAKE_ENGINE_REFUSE_AFTER"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def configs(root: Path, spec_model: str = "head") -> dict:
    spec = {"method": "eagle3", "model": str(root / spec_model), "num_speculative_tokens": 3}
    return {"plain": ({"model": "target", "speculative_config": None}, root / "engine_plain.log"),
            "spec": ({"model": "target", "speculative_config": spec}, root / "engine_spec.log")}


def test_both_engines_load_at_the_same_time(tmp_path, stand_in):
    stand_in.setenv("FAKE_ENGINE_LOAD_S", "1.5")
    procs = ep.start_engines(ENGINE, configs(tmp_path), {}, 60)
    try:
        seen = starts(tmp_path / "starts.jsonl")
        # each started before the other was ready: the loads overlap
        assert seen["spec", "start"]["t"] < seen["plain", "ready"]["t"]
        assert seen["plain", "start"]["t"] < seen["spec", "ready"]["t"]
        assert {name: p.load_s for name, p in procs.items()} == {"plain": 0.1, "spec": 0.1}  # the workers' own
        assert all(p.wall_load_s >= 1.5 and p.version == "0.32.0" for p in procs.values())
        assert procs["spec"].generate([1, 2, 3], 4)["event"] == "result"
        assert json.loads((tmp_path / "engine_spec.json").read_text())["speculative_config"]["method"] == "eagle3"
        assert "fake engine log" in (tmp_path / "engine_plain.log").read_text()
    finally:
        for p in procs.values():
            p.close()
    assert not any(alive(p.proc.pid) for p in procs.values())


@pytest.mark.parametrize("plain_s, spec_s", [(30, 0), (0, 1)], ids=["plain-still-loading", "plain-ready"])
def test_an_engine_that_is_refused_is_named_and_the_other_is_closed(tmp_path, stand_in, plain_s, spec_s):
    stand_in.setenv("FAKE_ENGINE_PLAIN_LOAD_S", str(plain_s))
    stand_in.setenv("FAKE_ENGINE_SPEC_LOAD_S", str(spec_s))
    stand_in.setenv("FAKE_ENGINE_REFUSE_AFTER", "plain")  # the assertion below needs the plain one started
    t = time.perf_counter()
    with pytest.raises(ep.EngineRefusedError) as refused:
        ep.start_engines(ENGINE, configs(tmp_path, "refuse"), {}, 60)
    assert time.perf_counter() - t < 20  # said as it happens, not after the other engine's load
    message = str(refused.value)
    assert "Unsupported speculative method: 'medusa'" in message and "engine_spec.log" in message
    assert "engine_plain.log" not in message
    seen = starts(tmp_path / "starts.jsonl")
    assert {kind for kind, event in seen if event == "start"} == {"plain", "spec"}
    assert not any(alive(r["pid"]) for r in seen.values())


def test_an_engine_silent_past_the_timeout_is_named_and_every_engine_closed(tmp_path, stand_in):
    stand_in.setenv("FAKE_ENGINE_PLAIN_LOAD_S", "30")
    with pytest.raises(ep.EngineRefusedError, match=r"no drafter: timeout: no answer in 1 s \(vllm.timeout_s\)") as e:
        ep.start_engines(ENGINE, configs(tmp_path), {}, 1)
    assert "engine_plain.log" in str(e.value)
    assert not any(alive(r["pid"]) for r in starts(tmp_path / "starts.jsonl").values())


def test_an_engine_process_still_waits_for_its_engine_by_default(tmp_path, stand_in):
    stand_in.setenv("FAKE_ENGINE_LOAD_S", "0.3")
    with ep.EngineProcess(ENGINE, configs(tmp_path)["plain"][0], tmp_path / "e.log", {}, 60) as p:
        assert p.load_s == 0.1 and p.wall_load_s >= 0.3 and p.version == "0.32.0"
    later = ep.EngineProcess(ENGINE, {"model": "target"}, tmp_path / "later.log", {}, 60, wait=False)
    try:
        assert later.load_s is None and later.wait_ready() is later and later.load_s == 0.1
    finally:
        later.close()
        later.close()  # a second close does nothing
