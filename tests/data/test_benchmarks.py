"""Benchmark prompt files: MT-bench, HumanEval, JSONL."""

from __future__ import annotations

import json

import pytest

from specheads.data.benchmarks import load_humaneval, load_jsonl, load_mtbench


def test_mtbench_has_8_categories_and_both_turns():
    ps = load_mtbench(per_category=None)
    assert len(ps) == 160 and len({p.domain for p in ps}) == 8
    two = load_mtbench(per_category=2)
    assert len(two) == 32 and {p.turn for p in two} == {0, 1}


def test_humaneval_count_and_domain():
    ps = load_humaneval(limit=None)
    assert len(ps) == 164 and {p.domain for p in ps} == {"code"}
    assert "def has_close_elements" in ps[0].turns[0]


def test_jsonl_loader_and_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "domain": "x"}) + "\n" +
                 json.dumps({"turns": ["a", "b"], "domain": "y", "id": "c"}) + "\n")
    ps = load_jsonl(f)
    assert [(p.id, p.domain, p.turn) for p in ps] == [("1/t1", "x", 0), ("c/t1", "y", 0), ("c/t2", "y", 1)]
    f.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="p.jsonl:1: each line needs"):
        load_jsonl(f)
    f.write_text("{nope\n")
    with pytest.raises(ValueError, match="p.jsonl:1: not valid JSON"):
        load_jsonl(f)
