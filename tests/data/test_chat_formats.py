"""Exact assistant masks for templates that rewrite history, add reasoning blocks or channels, or close
turns with a token other than eos. The oracle for each turn is the text the model generates there,
written out by hand; the context before it must be the template's own generation prompt."""

from __future__ import annotations

import json

import pytest

from specheads.data.render import TemplateError, render_samples, turn_token_groups
from specheads.data.sources import Conversation
from tests.data.chat_templates import (GEMMA_STYLE, GEMMA_TOKENS, HARMONY_STYLE, HARMONY_TOKENS, QWEN3_STYLE,
                                       R1_STYLE, R1_TOKENS, with_template)

R1, R2 = "Add two and two.", "Three plus three."
CHAT = [{"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4.", "reasoning_content": R1},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6.", "reasoning_content": R2}]
PLAIN = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in CHAT]
INLINE = [m if m["role"] != "assistant" else {"role": "assistant", "content": f"<think>\n{m['reasoning_content']}\n"
                                              f"</think>\n\n{m['content']}"} for m in CHAT]


def qwen3_generated(reasoning: str, content: str, thinking: bool = True) -> str:
    return (f"<think>\n{reasoning}\n</think>\n\n" if thinking else "") + content + "<|im_end|>"


def harmony_generated(thinking: str | None, content: str) -> str:
    analysis = f"<|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant" if thinking else ""
    return f"{analysis}<|channel|>final<|message|>{content}<|return|>"


CASES = {
    # name: (template, special tokens, think tags, template kwargs, messages, per-turn generated text, samples)
    "qwen3 thinking, reasoning field": (QWEN3_STYLE, [], True, {}, CHAT,
                                        [qwen3_generated(R1, "It is 4."), qwen3_generated(R2, "6.")], 2),
    "qwen3 thinking, inline think": (QWEN3_STYLE, [], True, {}, INLINE,
                                     [qwen3_generated(R1, "It is 4."), qwen3_generated(R2, "6.")], 2),
    "qwen3 thinking, no reasoning in data": (QWEN3_STYLE, [], True, {}, PLAIN,
                                             [qwen3_generated("", "It is 4."), qwen3_generated("", "6.")], 2),
    "qwen3 enable_thinking=false": (QWEN3_STYLE, [], True, {"enable_thinking": False}, PLAIN,
                                    [qwen3_generated("", "It is 4.", False), qwen3_generated("", "6.", False)], 2),
    "harmony with analysis": (HARMONY_STYLE, HARMONY_TOKENS, False, {}, CHAT,
                              [harmony_generated(R1, "It is 4."), harmony_generated(R2, "6.")], 2),
    "harmony without analysis": (HARMONY_STYLE, HARMONY_TOKENS, False, {}, PLAIN,
                                 [harmony_generated(None, "It is 4."), harmony_generated(None, "6.")], 2),
    "r1 distill (reasoning written after the prompt)": (
        R1_STYLE, R1_TOKENS, True, {}, CHAT,
        [f"{R1}\n</think>\n\nIt is 4.<｜end▁of▁sentence｜>", f"{R2}\n</think>\n\n6.<｜end▁of▁sentence｜>"], 2),
    "gemma (closer is not eos)": (GEMMA_STYLE, GEMMA_TOKENS, False, {}, PLAIN,
                                  ["It is 4.<end_of_turn>", "6.<end_of_turn>"], 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_masked_tokens_are_what_the_model_generates_after_the_serving_prompt(smollm2_tokenizer, name):
    template, special, think, kwargs, messages, generated, n_samples = CASES[name]
    tok = with_template(smollm2_tokenizer, template, special, think)
    out = render_samples(Conversation("c", messages), tok, max_length=4096, template_kwargs=kwargs)
    assert len(out.samples) == n_samples
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    seen = {}
    for s in out.samples:
        groups = [tok.decode(g) for g in turn_token_groups(s)]
        assert len(groups) == len(s.turns)
        seen.update(zip(s.turns, groups))
        # the context before the sample's last turn is the serving engine's prompt, tokenized as it tokenizes it
        last = s.turns[-1]
        prompt = tok.apply_chat_template([{k: v for k, v in m.items()} for m in messages[:last]],
                                         add_generation_prompt=True, tokenize=False, **kwargs)
        first_of_last = [t for t in range(len(s.loss_mask)) if s.loss_mask[t] and (t == 0 or not s.loss_mask[t - 1])][-1]
        assert s.input_ids[:first_of_last] == tok(prompt, add_special_tokens=False)["input_ids"]
    assert [seen[i] for i in assistant] == generated
    written = name.startswith("r1")  # the template never shows a turn after its prompt: written there
    assert out.written_turns == (len(assistant) if written else 0)
    if n_samples > 1:  # per-turn samples name their turn; the last is the whole chat where the template shows it
        assert [s.suffix for s in out.samples] == [f"@turn{i}" for i in assistant[:-1]] + \
            [f"@turn{assistant[-1]}" if written else ""]


def test_prefix_stable_template_keeps_one_sample_per_chat(smollm2_tokenizer):
    out = render_samples(Conversation("c", PLAIN), smollm2_tokenizer, max_length=4096)
    assert len(out.samples) == 1 and out.samples[0].suffix == "" and not out.split
    assert out.samples[0].turns == (1, 3)


def test_template_that_does_not_render_the_answer_names_the_turn(smollm2_tokenizer):
    drops = "{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n{% endif %}" \
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    tok = with_template(smollm2_tokenizer, drops)
    with pytest.raises(TemplateError, match=r"conversation c: turn 1: .*does not render"):
        render_samples(Conversation("c", PLAIN), tok, max_length=4096)


def test_qwen3_style_data_prepares_every_chat_with_per_turn_samples(smollm2_tokenizer, tmp_path):
    """The reproduction: a Qwen3-style template used to drop every chat as 'not prefix-stable'."""
    from specheads.data.prepare import PrepareConfig, load_prepared, prepare
    from specheads.data.render import chat_id
    from specheads.targets import Target

    tok = with_template(smollm2_tokenizer, QWEN3_STYLE, think_tags=True)
    def numbered(msgs, i):  # six distinct prompts (a repeated first user turn is a duplicate, dropped)
        return [{**m, "content": f"{m['content']} ({i})"} if j == 0 else m for j, m in enumerate(msgs)]

    rows = [{"id": f"r{i}", "messages": numbered(CHAT if i % 2 else INLINE, i)} for i in range(6)]
    rows.append({"id": "single", "messages": CHAT[:2]})
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = prepare(Target.tokenizer_only(tok, "qwen3-style"),
                   PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_samples=None), tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    assert meta["skipped"] == {} and meta["num_samples"] == 13  # 6 chats x 2 turns + 1 single-turn chat
    assert meta["per_turn_samples"]["chats"] == 6 and meta["per_turn_samples"]["samples"] == 12
    assert meta["per_turn_samples"]["extra_tokens"] > 0 and meta["reasoning_turns"] == 13
    assert sorted({chat_id(x) for x in ds["id"]}) == sorted(r["id"] for r in rows)
    for row in ds:
        text = tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        assert text in (qwen3_generated(R1, "It is 4."), qwen3_generated(R2, "6."))


def test_chat_template_kwargs_reach_the_template_and_the_metadata(smollm2_tokenizer, tmp_path):
    from specheads.data.prepare import PrepareConfig, load_prepared, prepare
    from specheads.targets import Target

    tok = with_template(smollm2_tokenizer, QWEN3_STYLE, think_tags=True)
    (tmp_path / "c.jsonl").write_text(json.dumps({"id": "a", "messages": PLAIN[:2]}) + "\n")
    cfg = PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_samples=None,
                        chat_template_kwargs={"enable_thinking": False})
    meta = prepare(Target.tokenizer_only(tok, "qwen3-style"), cfg, tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    assert meta["chat_template_kwargs"] == {"enable_thinking": False}
    assert tok.decode(ds[0]["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 4.<|im_end|>\n")
    assert tok.decode([t for t, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"]) if m]) == "It is 4.<|im_end|>"


def test_reasoning_fields_of_data_sets_are_read(tmp_path):
    from specheads.data.sources import SkipReport, iter_conversations

    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "r"}]}
            for key in ("reasoning_content", "reasoning", "thinking")]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    convs = list(iter_conversations("jsonl", str(tmp_path / "c.jsonl"), "train", SkipReport()))
    assert [c.messages[1].get("reasoning_content") for c in convs] == ["r", "r", "r"]


def test_regeneration_stops_at_the_templates_turn_closer_too(smollm2_tokenizer):
    from specheads.data.regenerate import turn_stop_ids
    from specheads.data.render import ChatRenderer

    tok = with_template(smollm2_tokenizer, GEMMA_STYLE, GEMMA_TOKENS)
    assert turn_stop_ids(ChatRenderer(tok)) == sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")})
    assert turn_stop_ids(ChatRenderer(smollm2_tokenizer)) == [smollm2_tokenizer.eos_token_id]  # ChatML: eos closes
