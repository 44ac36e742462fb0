"""render_samples on the real chat templates and tokenizers of six model families (tests/data/real_chat_formats.py).

For every assistant turn the masked tokens must be exactly what the model generates there, written out
by hand per family from its documented format, and the ids before the turn must be the tokenizer's
own tokenization of the template's generation prompt for the chat so far (what a serving engine feeds
the model). Templates that keep history as generated give one sample per chat; those that rewrite it
(Qwen3 and DeepSeek-R1 drop reasoning, gpt-oss keeps only the final channel and closes it with
``<|end|>`` instead of the generated ``<|return|>``, Mistral moves the system prompt to the last user
turn) give one sample per turn.
"""

from __future__ import annotations

import pytest

from specheads.data.render import render_samples, turn_token_groups
from specheads.data.sources import Conversation
from specheads.targets.chat_templates import SHIPPED, shipped_template
from tests.data.real_chat_formats import FAMILIES, SOURCES, package_file, real_tokenizer

USERS = ("Hi there, who are you?", "What is 17 * 3?")
ANSWERS = ("I am a helpful assistant.", "17 * 3 = 51.")
REASONS = ("The user greets me.\nI should introduce myself.", "17 * 3: 10*3 + 7*3 = 30 + 21 = 51.")
SYSTEM = "You are terse."


def chat(reasoning: bool = False, system: bool = False) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM}] if system else []
    for user, answer, why in zip(USERS, ANSWERS, REASONS):
        msgs.append({"role": "user", "content": user})
        msgs.append({"role": "assistant", "content": answer} | ({"reasoning_content": why} if reasoning else {}))
    return msgs


# What the model writes after its generation prompt, per family: (answer, reasoning or None) -> text.
def _qwen3(c, r):  # the last turn always carries a think block (empty when the turn has no reasoning)
    return f"<think>\n{r or ''}\n</think>\n\n{c}<|im_end|>"


def _gpt_oss(c, r):  # after "<|start|>assistant": the analysis message (if any), then the final one
    analysis = f"<|channel|>analysis<|message|>{r}<|end|><|start|>assistant" if r else ""
    return f"{analysis}<|channel|>final<|message|>{c}<|return|>"


def _deepseek_r1(c, r):  # the generation prompt ends in "<think>\n"; an empty reasoning is "\n"
    return f"{r or ''}\n</think>\n\n{c}<｜end▁of▁sentence｜>"


GENERATED = {
    "llama3": lambda c, r: f"{c}<|eot_id|>",
    "qwen3": _qwen3,
    "gpt_oss": _gpt_oss,
    "gemma3": lambda c, r: f"{c}<end_of_turn>",
    "mistral": lambda c, r: f" {c}</s>",  # the template writes " " + content after [/INST]
    "deepseek_r1": _deepseek_r1,
}
REWRITES = {"qwen3", "gpt_oss", "deepseek_r1"}  # one sample per turn for every chat
REASONING = ("qwen3", "gpt_oss", "deepseek_r1")


def _template_view(m: dict) -> dict:
    return m | {"thinking": m["reasoning_content"]} if "reasoning_content" in m else m


def check(family: str, msgs: list[dict], n_samples: int, kwargs: dict | None = None,
          generated=None) -> None:
    tok = real_tokenizer(family)
    generated = generated or GENERATED[family]
    out = render_samples(Conversation("c", msgs), tok, max_length=1 << 20, template_kwargs=kwargs)
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert len(out.samples) == n_samples, [s.turns for s in out.samples]
    assert sorted(i for s in out.samples for i in s.turns) == assistant
    for s in out.samples:
        runs = turn_token_groups(s)
        assert len(runs) == len(s.turns), (s.turns, [tok.decode(r) for r in runs])
        starts = [k for k in range(len(s.loss_mask)) if s.loss_mask[k] and (k == 0 or not s.loss_mask[k - 1])]
        for i, start, run in zip(s.turns, starts, runs):
            prompt = tok.apply_chat_template([_template_view(m) for m in msgs[:i]], tokenize=False,
                                             add_generation_prompt=True, **(kwargs or {}))
            assert s.input_ids[:start] == tok(prompt, add_special_tokens=False)["input_ids"], f"turn {i}: prompt ids"
            before, through = tok.decode(s.input_ids[:start]), tok.decode(s.input_ids[:start + len(run)])
            assert through.startswith(before)
            want = generated(msgs[i]["content"], msgs[i].get("reasoning_content"))
            assert through[len(before):] == want, f"turn {i}"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_template_is_where_shipped_says(name):
    """``target.chat_template=<name>`` reads the file ``SHIPPED`` names: a wrong path or a package the set-up
    forgot fails here (``ChatTemplateError``), as it would for a user."""
    assert "{%" in shipped_template(name)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tokenizer_source_is_installed(family):
    package, files = SOURCES[family]["tokenizer"]
    for rel in files:
        assert package_file(package, rel).stat().st_size > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_two_turn_chat(family, support):
    support(f"chat:{family}", "prepare")
    check(family, chat(), 2 if family in REWRITES else 1)


@pytest.mark.parametrize("family", REASONING)
def test_reasoning_turns(family, support):
    support(f"chat:{family}", "prepare")
    check(family, chat(reasoning=True), 2)


def test_qwen3_thinking_off(support):
    support("chat:qwen3", "prepare")
    # enable_thinking=False: the generation prompt holds the empty think block, the model writes the answer
    check("qwen3", chat(), 2, {"enable_thinking": False}, generated=lambda c, r: f"{c}<|im_end|>")


@pytest.mark.parametrize("family", FAMILIES)
def test_system_prompt(family, support):
    support(f"chat:{family}", "prepare")
    # Mistral v0.3 puts the system prompt in the last user turn: each turn's prompt differs from history
    check(family, chat(system=True), 2 if family in REWRITES | {"mistral"} else 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_specials(family):
    """The turn closers and role markers are single tokens of the real vocabulary."""
    tok = real_tokenizer(family)
    marks = {"llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"],
             "qwen3": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
             "gpt_oss": ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"],
             "gemma3": ["<start_of_turn>", "<end_of_turn>", "<bos>"],
             "mistral": ["[INST]", "[/INST]", "</s>", "<s>"],
             "deepseek_r1": ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>"],
             }[family]
    for m in marks:
        assert len(tok(m, add_special_tokens=False)["input_ids"]) == 1, m
