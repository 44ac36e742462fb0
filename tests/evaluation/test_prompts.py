"""The evaluation's prompts: held-out chat, an empty spec; chat-template encoding of turn 2."""

from __future__ import annotations

import pytest

from specheads.data.benchmarks import load_mtbench
from specheads.evaluation.prompts import BenchmarkSpec, encode, load_benchmarks, load_chat_heldout


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
