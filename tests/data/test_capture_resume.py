"""Regeneration with capture (``regenerate=engine``) under faults, with a stand-in engine (tests/data/
fake_answer_engine.py: vLLM's answer and capture protocol, a deterministic "model", seeded sampling as the real
worker seeds it; no vLLM): a run that dies between a part's rename and its index lines (leaving the part), a torn
index line, then a run killed with SIGKILL after one chat of a batch was journaled; the next run ends with the
journal, the capture folder, the prepared data and the collected store bitwise those of an uninterrupted run, no
chat lost or twice. A flipped byte in a capture part, or in an index line, is refused when collection reads it,
never served. The real engine's runs: tests/engine/test_engine_resume.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specheads.data import capture_cache
from specheads.data.capture_cache import CaptureCache, CaptureCacheError, CapturedTarget, capture_dir

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake_answer_python.sh")
BATCH = 3  # 10 chats: batches at 0, 3, 6 and 9 of the planned order

KILLED = textwrap.dedent("""
    import logging, sys
    from tests.data.kill_at import install
    from tests.data.test_capture_resume import run_prepare

    logging.basicConfig(level=logging.INFO)
    install(sys.argv[1])
    run_prepare(*sys.argv[2:])
""")


class Crash(BaseException):
    """A run dying at this point (nothing after it runs; what is on disk stays as it is)."""


def run_prepare(target_dir: str, chats: str, out: str) -> dict:
    """``specheads prepare regenerate=engine`` as the recipe runs it (the target's config and tokenizer, no
    weights), sampled so that a chat's answer depends on the seed its batch gives it."""
    from specheads.data.engine_answers import EngineRegenConfig
    from specheads.data.engine_features import meta_target
    from specheads.data.prepare import PrepareConfig, prepare
    from specheads.data.regenerate import RegenerateConfig

    regen = RegenerateConfig(batch_size=BATCH, max_new_tokens=12, max_prompt_tokens=200, temperature=1.0, seed=3,
                             engine=EngineRegenConfig(python=str(FAKE), dtype="float32", max_model_len=512))
    cfg = PrepareConfig(source="jsonl", path=chats, num_samples=None, max_length=256, num_proc=1, regenerate=regen)
    return prepare(meta_target(target_dir), cfg, out)


@pytest.fixture(scope="module")
def target_and_chats(tmp_path_factory, smollm2_tokenizer):
    """A target folder (a tiny Llama's config, SmolLM2's tokenizer) and ten chats of different lengths."""
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("capture_resume")
    target = root / "target"
    make_tiny_model("llama", vocab=len(smollm2_tokenizer), hidden=32, layers=4).config.save_pretrained(target)
    smollm2_tokenizer.save_pretrained(target)
    chats = root / "chats.jsonl"
    words = ["apples", "rivers", "stars", "trains", "clocks", "maps", "bridges", "songs", "tides", "lamps"]
    chats.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Tell me about {w}. " + "Why? " * (i % 4)},
        {"role": "assistant", "content": "An old answer."}]}) + "\n" for i, w in enumerate(words)))
    return root, target, chats


UNSTABLE = ("specheads_meta.json", "state.json")  # its run's seconds; the datasets library's random fingerprint


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _collect(prepared: Path, target: Path, out: Path) -> dict:
    from specheads.data.engine_features import meta_target
    from specheads.data.features import CollectOptions, collect_hidden_states
    from specheads.data.prepare import load_prepared
    from specheads.methods.base import FeatureSpec

    cache = CaptureCache(capture_dir(prepared))
    captured = CapturedTarget(meta_target(str(target)), cache, None)
    opts = CollectOptions(dtype="bfloat16", shard_samples=4, estimate_time=False, progress=False)
    return collect_hidden_states(captured, load_prepared(prepared)[0], FeatureSpec(tuple(cache.layers), True), out,
                                 opts)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def clean(target_and_chats, monkeypatch_module) -> Path:
    """An uninterrupted run's prepared folder."""
    root, target, chats = target_and_chats
    monkeypatch_module.setenv("FAKE_ENGINE_REAL_PYTHON", sys.executable)
    out = root / "clean" / "prepared"
    run_prepare(str(target), str(chats), str(out))
    return out


def _faulted(root: Path, target: Path, chats: Path, monkeypatch) -> Path:
    """A run through three faults, then the same command again: its prepared folder."""
    resumed = root / "resumed" / "prepared"
    cache, journal = capture_dir(resumed), resumed.with_name("prepared.regen.jsonl")
    # 1. the run dies right after batch 2's part is renamed into place, before any line names it
    real_sha = capture_cache._sha256
    calls = []

    def dies_on_the_second_part(path):
        calls.append(path)
        if len(calls) == 2:
            raise Crash("killed between the part's rename and its index lines")
        return real_sha(path)

    with monkeypatch.context() as mp:
        mp.setattr(capture_cache, "_sha256", dies_on_the_second_part)
        with pytest.raises(Crash):
            run_prepare(str(target), str(chats), str(resumed))
    assert sorted(p.name for p in cache.glob("part-*")) == ["part-00000.safetensors", "part-00001.safetensors"]
    assert {json.loads(x)["part"] for x in (cache / "index.jsonl").read_text().splitlines()} == {
        "part-00000.safetensors"}
    assert len(journal.read_text().splitlines()) == BATCH
    # 2. a torn index line (a crash mid-append) and a half-written part
    with (cache / "index.jsonl").open("a") as f:
        f.write('{"key": "0123')
    (cache / "part-00002.safetensors.tmp").write_bytes(b"half a part")

    # 3. a run killed with SIGKILL after the first chat of batch 2 was journaled (its rows are indexed)
    script = root / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_ENGINE_REAL_PYTHON": sys.executable}
    killed = subprocess.run([sys.executable, str(script), "specheads.data.regenerate:_append:2", str(target),
                             str(chats), str(resumed)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300, start_new_session=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "dropping a torn last line" in killed.stderr and "removing part-00001.safetensors" in killed.stderr
    assert len(journal.read_text().splitlines()) == BATCH + 1 and not resumed.exists()
    assert sorted(p.name for p in cache.glob("part-*")) == ["part-00000.safetensors", "part-00001.safetensors"]

    # 4. the same command again finishes it
    run_prepare(str(target), str(chats), str(resumed))
    return resumed


def test_killed_regeneration_with_capture_resumes_to_the_uninterrupted_runs_bytes(target_and_chats, clean, monkeypatch,
                                                                                   tmp_path):
    root, target, chats = target_and_chats
    resumed = _faulted(root, target, chats, monkeypatch)
    ids = [json.loads(x)["id"] for x in resumed.with_name("prepared.regen.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 10  # no chat lost, none twice
    journals = [p.with_name("prepared.regen.jsonl").read_bytes() for p in (resumed, clean)]
    assert journals[0] == journals[1]
    assert _files(capture_dir(resumed)) == _files(capture_dir(clean))  # parts, index and meta, byte for byte
    assert len(list(capture_dir(clean).glob("part-*"))) == 4
    data = {k: v for k, v in _files(resumed).items() if k not in UNSTABLE}
    assert data and data == {k: v for k, v in _files(clean).items() if k not in UNSTABLE}
    meta = [json.loads((p / "specheads_meta.json").read_text()) for p in (resumed, clean)]
    assert [{k: v for k, v in m.items() if k != "seconds"} for m in meta][0] == \
        [{k: v for k, v in m.items() if k != "seconds"} for m in meta][1]
    assert meta[0]["captured"]["rows"] == meta[0]["num_samples"] == 10

    a, b = _collect(resumed, target, tmp_path / "a"), _collect(clean, target, tmp_path / "b")
    assert a["manifest"] is not None and a["manifest"]["shards"] == b["manifest"]["shards"]
    assert _files(tmp_path / "a" / "shards") == _files(tmp_path / "b" / "shards")


def test_a_flipped_byte_in_a_capture_part_or_index_line_is_refused_not_served(target_and_chats, clean, tmp_path):
    from specheads.data.prepare import load_prepared

    root, target, _ = target_and_chats
    prepared = tmp_path / "prepared"
    shutil.copytree(clean, prepared)
    shutil.copytree(capture_dir(clean), capture_dir(prepared))
    rows = [list(r) for r in load_prepared(prepared)[0]["input_ids"]]
    good = CaptureCache(capture_dir(prepared))
    truth = {row_i: good.get(r) for row_i, r in enumerate(rows)}

    part = capture_dir(prepared) / "part-00001.safetensors"
    raw = part.read_bytes()
    for at in (0, 9, len(raw) // 2, len(raw) - 1):  # the header's length, its JSON, the states, the last byte
        flipped = bytearray(raw)
        flipped[at] ^= 0xFF
        part.write_bytes(bytes(flipped))
        cache = CaptureCache(capture_dir(prepared))
        in_part = [r for r in rows if cache.index()[capture_cache.row_key(r)]["part"] == part.name]
        assert in_part
        with pytest.raises(CaptureCacheError, match="part-00001.safetensors.*checksum"):
            cache.get(in_part[0])
    # collection stops on it, naming the part, and leaves no store that looks finished
    with pytest.raises(CaptureCacheError, match="part-00001.safetensors"):
        _collect(prepared, target, tmp_path / "store")
    assert not (tmp_path / "store" / "manifest.json").exists()
    part.write_bytes(raw)

    # every byte of an index line flipped in turn: refused, or (the byte of a line's end) the row is missing,
    # or (a field's name) the same states: never another row's states
    index = capture_dir(prepared) / "index.jsonl"
    lines = index.read_bytes().splitlines(keepends=True)
    start = sum(map(len, lines[:4]))
    outcomes = set()
    for at in range(start, start + len(lines[4])):
        flipped = bytearray(b"".join(lines))
        flipped[at] ^= 0xFF
        index.write_bytes(bytes(flipped))
        cache = CaptureCache(capture_dir(prepared))
        for i, r in enumerate(rows):
            try:
                got = cache.get(r)
            except CaptureCacheError:
                outcomes.add("refused")
                break
            if got is None:
                outcomes.add("missing")
            else:
                assert all(bool((got[k] == truth[i][k]).all()) for k in got), (at, i)
    assert "refused" in outcomes
