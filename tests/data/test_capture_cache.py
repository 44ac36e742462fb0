"""States captured while vLLM answered (``regenerate=engine``): the cache collection reads, the target that serves
it (rows it lacks computed by a real forward), and the engine worker's bookkeeping (which request and position
each captured token is, and how a row is assembled from a chat's requests), all without an engine."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.data.capture_cache import CaptureCache, CaptureCacheError, CapturedTarget, row_key
from specheads.targets import Target
from specheads.serving import engine_worker as w
from tests.conftest import make_tiny_target

IDENTITY = {"target": "t", "engine": "vllm", "dtype": "float32", "layers": [0, 2], "last": True, "argmax": True}


def _states(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"aux_0": torch.randn(n, 4, generator=g), "aux_2": torch.randn(n, 4, generator=g),
            "last": torch.randn(n, 4, generator=g), "argmax": torch.randint(0, 9, (n,), generator=g)}


def test_rows_come_back_by_their_exact_ids_and_a_torn_index_line_is_ignored(tmp_path):
    cache = CaptureCache.open_for_writing(tmp_path / "c", IDENTITY)
    rows = [[1, 2, 3], [4, 5], [1, 2, 3, 4]]
    states = [_states(len(r), i) for i, r in enumerate(rows)]
    cache.add(rows[:2], states[:2])
    cache.add(rows[2:], states[2:])
    with (tmp_path / "c" / "index.jsonl").open("a") as f:
        f.write('{"key": "torn')  # a crash mid-append
    again = CaptureCache(tmp_path / "c")
    for r, s in zip(rows, states):
        got = again.get(r)
        assert set(got) == set(s) and all(torch.equal(got[k], s[k]) for k in s)
    assert again.get([1, 2]) is None and again.count(rows + [[9]]) == 3
    assert again.covers([2], True) and not again.covers([1], True)


def test_a_part_whose_bytes_changed_is_refused_and_other_settings_start_over(tmp_path):
    cache = CaptureCache.open_for_writing(tmp_path / "c", IDENTITY)
    cache.add([[1, 2, 3]], [_states(3, 0)])
    part = next((tmp_path / "c").glob("part-*.safetensors"))
    raw = bytearray(part.read_bytes())
    raw[-1] ^= 0xFF
    part.write_bytes(bytes(raw))
    with pytest.raises(CaptureCacheError, match="checksum"):
        CaptureCache(tmp_path / "c").get([1, 2, 3])
    fresh = CaptureCache.open_for_writing(tmp_path / "c", {**IDENTITY, "layers": [1]})
    assert fresh.get([1, 2, 3]) is None and not list((tmp_path / "c").glob("part-*"))
    assert json.loads((tmp_path / "c" / "meta.json").read_text())["layers"] == [1]


def test_captured_rows_are_served_and_the_rest_computed_by_a_real_forward(tmp_path):
    tiny = make_tiny_target("llama", layers=3)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    ref = tiny.forward_features(ids, mask, aux_layers=(0, 2), need_last=True)
    cache = CaptureCache.open_for_writing(tmp_path / "c", IDENTITY)
    kept = {"aux_0": ref.aux[0][0], "aux_2": ref.aux[1][0], "last": ref.last[0],
            "argmax": tiny.logits(ref.last[0]).argmax(-1)}
    cache.add([[5, 6, 7, 8]], [kept])
    built = []
    target = CapturedTarget(Target(tiny.model, None, "t"), cache, lambda: built.append(1) or tiny)
    got = target.forward_features(ids, mask, aux_layers=(0, 2), need_last=True)
    assert built == [1] and (target.rows_from_cache, target.rows_computed) == (1, 1)
    for j in range(2):
        assert torch.allclose(got.aux[j][:, :3], ref.aux[j][:, :3], atol=1e-6)
    assert torch.allclose(got.last[1, :3], ref.last[1, :3], atol=1e-6)
    assert torch.equal(got.argmax[0], kept["argmax"]) and bool((got.last[1, 3] == 0).all())
    target.forward_features(ids[:1], mask[:1], aux_layers=(0, 2))
    assert built == [1] and target.rows_from_cache == 2  # no forward needed for a row it has


def test_each_captured_token_goes_to_its_request_and_position():
    # step 1: A's prefill of 3 and B's of 2; step 2: a decode token each (B first, as a runner may reorder)
    steps = [(["A-x1", "B-x2"], [0, 0], [3, 2]), (["B-x2", "A-x1"], [2, 3], [1, 1])]
    order = [("A", 0), ("A", 1), ("A", 2), ("B", 0), ("B", 1), ("B", 2), ("A", 3)]
    code = torch.tensor([(10 if r == "A" else 20) + p for r, p in order], dtype=torch.float32)
    per = w._per_request({"steps": steps, "last": code[:, None].repeat(1, 2), "argmax": code.long()})
    assert per["A-x1"]["pos"].tolist() == [0, 1, 2, 3] and per["A-x1"]["argmax"].tolist() == [10, 11, 12, 13]
    assert per["B-x2"]["pos"].tolist() == [0, 1, 2] and per["B-x2"]["last"][:, 0].tolist() == [20, 21, 22]
    with pytest.raises(RuntimeError, match="scheduled tokens"):
        w._per_request({"steps": steps, "last": code[:5, None]})

    class Out:
        def __init__(self, rid):
            self.request_id = rid
    assert w._internal_ids([Out("B"), Out("A"), Out("C")], per) == ["B-x2", "A-x1", None]


def test_a_row_takes_each_position_from_a_request_that_computed_it_after_the_same_tokens():
    caps = w.Captures()

    def states(pos, base):
        pos = torch.tensor(pos)
        return {"pos": pos, "last": (base + pos).float()[:, None], "argmax": base + pos}

    # the answer's generation computed 0..4 of [1,2,3,4,5,(6)]; the row adds a closer: [1,2,3,4,5,6,7]
    caps.keep("chat", [1, 2, 3, 4, 5, 6], states([0, 1, 2, 3, 4], 100))
    row = [1, 2, 3, 4, 5, 6, 7]
    got = caps.assemble(row, "chat", states([4, 5, 6], 200))  # the row's request: cache blocks cover 0..3
    assert got["argmax"].tolist() == [100, 101, 102, 103, 204, 205, 206] and caps.reused == 4
    # a request whose tokens differ from position 2 on cannot give positions 2 and later
    caps.keep("other", [1, 2, 9, 4, 5], states([0, 1, 2, 3, 4], 300))
    with pytest.raises(RuntimeError, match=r"positions \[2, 3\]"):
        caps.assemble(row, "other", states([4, 5, 6], 400))
    caps.release(["chat", "other"])
    assert caps.by_salt == {}
