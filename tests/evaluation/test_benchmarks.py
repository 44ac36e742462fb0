"""Benchmark loaders: MT-bench, HumanEval, held-out chat, JSONL; chat-template encoding of turn 2."""

from __future__ import annotations

import json

import pytest

from specheads.evaluation.benchmarks import (BenchmarkSpec, encode, load_benchmarks, load_chat_heldout,
                                             load_humaneval, load_jsonl, load_mtbench)


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


def test_turn2_includes_model_answer(smollm2_tokenizer):
    p1, p2 = load_mtbench(per_category=1)[:2]
    with pytest.raises(KeyError, match="was not generated first"):
        encode(p2, smollm2_tokenizer, {})
    ids = encode(p2, smollm2_tokenizer, {p1.id: "MY ANSWER"})
    text = smollm2_tokenizer.decode(ids)
    assert "MY ANSWER" in text and p2.turns[1] in text and text.rstrip().endswith("assistant")


def test_prompts_are_encoded_with_the_templates_switches(smollm2_tokenizer):
    from tests.data.chat_templates import QWEN3_STYLE, with_template

    tok = with_template(smollm2_tokenizer, QWEN3_STYLE, think_tags=True)
    p1 = load_mtbench(per_category=1)[0]
    assert tok.decode(encode(p1, tok, {})).endswith("<|im_start|>assistant\n")
    assert tok.decode(encode(p1, tok, {}, {"enable_thinking": False})).endswith("assistant\n<think>\n\n</think>\n\n")


def test_chat_heldout_cuts_at_first_assistant_token(tmp_path):
    from specheads.data.prepare import write_prepared

    rows = {"id": [f"r{i:03d}" for i in range(200)], "input_ids": [[1, 2, 3, 4, 5, 6]] * 200,
            "loss_mask": [[0, 0, 0, 1, 1, 0]] * 200, "domain": ["chat"] * 200}
    write_prepared(rows, {}, tmp_path / "prep")
    ps = load_chat_heldout(tmp_path / "prep", limit=None)
    assert [p.id for p in ps] == ["chat/r198", "chat/r199"]  # last 1% of 200 sorted ids
    assert ps[0].input_ids == [1, 2, 3]


def test_empty_spec_is_an_error():
    with pytest.raises(ValueError, match="evaluation set is empty"):
        load_benchmarks(BenchmarkSpec(mtbench_per_category=0, humaneval=0, chat=0))
