"""The engine tier under faults: a run SIGKILLed mid-way (the run and its engine's processes, as a crash kills them;
``tests/data/kill_at.py``), then the same command again, ends bitwise where an uninterrupted run does, no chat or
row lost or twice:

- ``prepare regenerate=engine`` with capture, sampled, killed after the first chat of its second batch was journaled
  (that batch's states already indexed): the journal, the capture folder, the prepared data and the store collected
  from the capture are the uninterrupted run's, byte for byte;
- ``collect engine=vllm`` killed before its third shard is written: the store is the uninterrupted run's.

The same faults, and a flipped byte in a capture part, run in the default suite with a stand-in engine
(tests/data/test_capture_resume.py). About 9 minutes on 2 cores (six engine loads)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.conftest import ROOT, specheads

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _killed(spec: str, *args: str, cwd: Path, worker_config: Path) -> subprocess.CompletedProcess:
    """``specheads *args`` killed at ``spec`` (MODULE:FUNCTION:N); its engine's worker gone too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "tests.data.kill_at", spec, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1800, start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    deadline = time.time() + 30
    while _workers(worker_config) and time.time() < deadline:
        time.sleep(0.5)
    assert not _workers(worker_config), "the killed run's engine outlived it"
    return proc


def _workers(config: Path) -> list[int]:
    """Processes running the engine worker on ``config`` (the file EngineProcess writes beside its log)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(config) in (p / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(p.name))
        except OSError:
            pass
    return found


UNSTABLE = ("specheads_meta.json", "state.json")  # its run's seconds; the datasets library's random fingerprint


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_regeneration_with_capture_killed_then_resumed_is_the_uninterrupted_runs(tmp_path):
    common = ("prepare", "data.num_samples=12", "data.max_length=256", "regenerate=engine", "regenerate.batch_size=4",
              "regenerate.max_new_tokens=24", "regenerate.temperature=1.0", "regenerate.seed=3",
              "regenerate.engine.dtype=float32")
    killed, clean = tmp_path / "killed" / "prepared", tmp_path / "clean" / "prepared"
    _killed("specheads.data.regenerate:_append:6", *common, f"output_dir={killed}", cwd=tmp_path,
            worker_config=killed.parent / "engine_regenerate.json")
    journal = killed.with_name("prepared.regen.jsonl")
    assert len(journal.read_text().splitlines()) == 5 and not killed.exists()
    indexed = len((killed.with_name("prepared.capture") / "index.jsonl").read_text().splitlines())
    again = specheads(*common, f"output_dir={killed}", cwd=tmp_path)
    assert "journaled ones answered again" in again.stdout + again.stderr
    specheads(*common, f"output_dir={clean}", cwd=tmp_path)

    ids = [json.loads(x)["id"] for x in journal.read_text().splitlines()]
    assert len(ids) == len(set(ids)) and len(ids) > 5  # none lost, none twice
    assert journal.read_bytes() == clean.with_name("prepared.regen.jsonl").read_bytes()
    caps = killed.with_name("prepared.capture"), clean.with_name("prepared.capture")
    assert _files(caps[0]) == _files(caps[1]) and indexed > 4  # batch 2's rows were indexed before the kill
    data = [{k: v for k, v in _files(p).items() if k not in UNSTABLE} for p in (killed, clean)]
    assert data[0] == data[1]
    meta = json.loads((killed / "specheads_meta.json").read_text())
    assert meta["captured"]["rows"] == meta["num_samples"] > 5  # every prepared row captured

    stores = []
    for name, prepared in (("store_killed", killed), ("store_clean", clean)):
        specheads("collect", "method=eagle3", f"prepared_dir={prepared}", "target.dtype=float32",
                  f"output_dir={tmp_path / name}", cwd=tmp_path)
        stores.append(tmp_path / name)
    a, b = (json.loads((s / "manifest.json").read_text()) for s in stores)
    assert a["source"]["engine"] == "captured" and a["shards"] == b["shards"]
    assert _files(stores[0] / "shards") == _files(stores[1] / "shards")


def test_engine_collection_killed_then_resumed_is_the_uninterrupted_runs(tmp_path):
    specheads("prepare", "data.num_samples=16", "data.max_length=256", f"output_dir={tmp_path / 'prepared'}",
              cwd=tmp_path)
    common = ("collect", "engine=vllm", "target.dtype=float32", "method=eagle3", "collect.shard_samples=4",
              f"prepared_dir={tmp_path / 'prepared'}")
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    _killed("specheads.data.store:write_shard:3", *common, f"output_dir={killed}", cwd=tmp_path,
            worker_config=killed / "engine_collect_rank0.json")
    plan = json.loads((killed / "plan.json").read_text())
    assert plan["num_shards"] == 4 and len(list((killed / "shards").glob("*.json"))) == 2
    assert not (killed / "manifest.json").exists()
    again = specheads(*common, f"output_dir={killed}", cwd=tmp_path)
    assert "(2 finished already)" in again.stdout + again.stderr
    specheads(*common, f"output_dir={clean}", cwd=tmp_path)

    a, b = (json.loads((s / "manifest.json").read_text()) for s in (killed, clean))
    assert a["source"]["engine"] == "vllm" and a["shards"] == b["shards"]  # ids, lengths and checksums, in order
    assert sum(len(s["ids"]) for s in a["shards"]) == a["num_samples"] > 12  # every prepared row, once
    assert len({i for s in a["shards"] for i in s["ids"]}) == a["num_samples"]
    assert _files(killed / "shards") == _files(clean / "shards")
