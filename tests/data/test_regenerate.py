import json

import pytest

from specheads.data import regenerate as regen_mod
from specheads.data.regenerate import RegenerateConfig, read_journal, regenerate
from specheads.data.sources import Conversation
from specheads.targets import Target
from tests.conftest import make_tiny_model


@pytest.fixture
def tiny_chat_target(smollm2_tokenizer):
    """A tiny random Llama speaking SmolLM2's tokenizer (so chat templates work)."""
    import copy

    model = make_tiny_model("llama", vocab=len(smollm2_tokenizer), hidden=32, layers=2)
    return Target(model, copy.deepcopy(smollm2_tokenizer), name="tiny-chat")


def convs(n):
    return [Conversation(f"c{i}", [{"role": "user", "content": f"question {i} " * (i + 1)},
                                   {"role": "assistant", "content": "old answer"},
                                   {"role": "user", "content": "more"},
                                   {"role": "assistant", "content": "old answer 2"}]) for i in range(n)]


def test_regenerate_replaces_answers_and_resumes_without_redoing(tiny_chat_target, tmp_path, monkeypatch):
    cfg = RegenerateConfig(batch_size=2, max_new_tokens=6, max_turns=2)
    full = regenerate(tiny_chat_target, convs(5), tmp_path / "full.jsonl", cfg)
    assert [c.id for c in full] == [f"c{i}" for i in range(5)]
    for c in full:
        answers = [m["content"] for m in c.messages if m["role"] == "assistant"]
        assert answers and all(a not in ("old answer", "old answer 2") for a in answers)

    # Interrupted run: the journal holds two finished chats and a torn line.
    journal = tmp_path / "resumed.jsonl"
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:2]) + lines[2][:15])
    prompts = []
    real = regen_mod._generate
    monkeypatch.setattr(regen_mod, "_generate",
                        lambda t, p, c, s, stops: prompts.extend(t.tokenizer.decode(x) for x in p) or real(t, p, c, s, stops))
    resumed = regenerate(tiny_chat_target, convs(5), journal, cfg)
    assert [(c.id, c.messages) for c in resumed] == [(c.id, c.messages) for c in full]
    assert prompts and not any("question 0 " in p or "question 1 " in p for p in prompts), "finished chats were redone"
    ids = [json.loads(line)["id"] for line in journal.read_text().splitlines()]
    assert sorted(ids) == [f"c{i}" for i in range(5)], "journal has duplicates or gaps"


def test_long_prompt_ends_chat_and_corrupt_journal_is_named(tiny_chat_target, tmp_path):
    cfg = RegenerateConfig(batch_size=4, max_new_tokens=4, max_turns=1, max_prompt_tokens=40)
    long = [Conversation("long", [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "a"}])]
    assert regenerate(tiny_chat_target, long, tmp_path / "j.jsonl", cfg) == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": []}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_journal(bad)


def test_prepare_counts_chats_that_regeneration_left_without_an_answer(tiny_chat_target, tmp_path):
    from specheads.data.prepare import NO_REGENERATED_ANSWER, PrepareConfig, prepare

    rows = [{"messages": [{"role": "user", "content": f"x{i} " * (200 if i == 1 else 3)},  # three prompts, no duplicate
                          {"role": "assistant", "content": "a"}]} for i in range(3)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    regen = RegenerateConfig(batch_size=4, max_new_tokens=3, max_turns=1, max_prompt_tokens=40)
    meta = prepare(tiny_chat_target, PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_samples=None,
                                                   regenerate=regen), tmp_path / "out")
    assert meta["num_samples"] == 2
    assert meta["skipped"][NO_REGENERATED_ANSWER] == 1


# --------------------------------------------------------------------------- the target's own tokens, exactly


@pytest.fixture
def echo_target(smollm2_tokenizer):
    """A tiny Llama on SmolLM2's tokenizer that greedily answers any ChatML prompt with 'he' 'llo' and then
    its end-of-turn token: each layer's output projections are zero, so the logits depend only on the
    last token (newline -> 'he' -> 'llo' -> <|im_end|>). 'he'+'llo' decodes to 'hello', which re-tokenizes
    as another token: decode -> strip -> re-tokenize cannot give the generated ids back."""
    import copy

    import torch

    tok = copy.deepcopy(smollm2_tokenizer)
    model = make_tiny_model("llama", vocab=len(tok), hidden=32, layers=2)
    newline, he, llo = tok.convert_tokens_to_ids(["Ċ", "he", "llo"])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        for d, (tok_in, tok_out) in enumerate([(newline, he), (he, llo), (llo, tok.eos_token_id)]):
            emb[tok_in, d] = 1.0
            head[tok_out, d] = 10.0
    return Target(model, tok, name="echo")


def chat_rows(path, n_turns=1):
    turns = []
    for t in range(n_turns):
        turns += [{"role": "user", "content": f"Say hello {t}"}, {"role": "assistant", "content": "Hello there!"}]
    path.write_text(json.dumps({"id": "a", "messages": turns}) + "\n")
    return path


@pytest.mark.parametrize("n_turns", [1, 2])
def test_regenerated_answers_are_the_generated_token_ids(echo_target, tmp_path, n_turns):
    from specheads.data.prepare import PrepareConfig, load_prepared, prepare

    tok = echo_target.tokenizer
    he, llo = tok.convert_tokens_to_ids(["he", "llo"])
    assert tok(tok.decode([he, llo]).strip(), add_special_tokens=False)["input_ids"] != [he, llo]
    regen = RegenerateConfig(batch_size=2, max_new_tokens=8, max_turns=n_turns)
    meta = prepare(echo_target, PrepareConfig(source="jsonl", path=str(chat_rows(tmp_path / "c.jsonl", n_turns)),
                                              num_samples=None, regenerate=regen), tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    row, mask = ds[0]["input_ids"], ds[0]["loss_mask"]
    # exactly: the template's prompt, the generated ids, the end-of-turn token (then the template's newline)
    want = []
    msgs = []
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"Say hello {t}"})
        prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        done = tok.decode(want) if want else ""
        want += tok(prompt[len(done):], add_special_tokens=False)["input_ids"] + [he, llo, tok.eos_token_id]
        msgs.append({"role": "assistant", "content": "hello"})  # the next prompt continues after this turn
    want += tok("\n", add_special_tokens=False)["input_ids"]
    assert row == want
    assert [t for t, m in zip(row, mask) if m] == [he, llo, tok.eos_token_id] * n_turns
    assert meta["regenerated_truncated"] == 0


def test_an_answer_cut_at_max_new_tokens_is_kept_open_and_counted(echo_target, tmp_path, caplog):
    import logging

    from specheads.data.prepare import PrepareConfig, load_prepared, prepare

    tok = echo_target.tokenizer
    he = tok.convert_tokens_to_ids("he")
    regen = RegenerateConfig(batch_size=2, max_new_tokens=1, max_turns=2)  # 'he' and no end-of-turn token
    with caplog.at_level(logging.INFO):
        meta = prepare(echo_target, PrepareConfig(source="jsonl", path=str(chat_rows(tmp_path / "c.jsonl", 2)),
                                                  num_samples=None, regenerate=regen), tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    row, mask = ds[0]["input_ids"], ds[0]["loss_mask"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hello 0"}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
    assert row == prompt + [he], "a cut answer must end the chat, not be closed with the end-of-turn token"
    assert mask == [0] * len(prompt) + [1]
    assert meta["regenerated_truncated"] == 1 and meta["num_samples"] == 1
    assert "cut at regenerate.max_new_tokens" in caplog.text
    journal = [json.loads(x) for x in (tmp_path / "out.regen.jsonl").read_text().splitlines()]
    assert journal[0]["messages"][-1] == {"role": "assistant", "content": "he", "token_ids": [he], "truncated": True}


def test_journal_records_of_other_settings_are_redone(echo_target, tmp_path):
    cfg = RegenerateConfig(batch_size=2, max_new_tokens=1)
    conv = [Conversation("a", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}])]
    cut = regenerate(echo_target, conv, tmp_path / "j.jsonl", cfg)
    assert cut[0].messages[-1].get("truncated")
    full = regenerate(echo_target, conv, tmp_path / "j.jsonl", RegenerateConfig(batch_size=2, max_new_tokens=8))
    assert not full[0].messages[-1].get("truncated") and len(full[0].messages[-1]["token_ids"]) == 2


def test_thinking_template_regenerated_turns_are_per_turn_samples_of_the_exact_prompt_and_ids(echo_target, tmp_path):
    """A Qwen3-style template shows the final turn with a think block the echo target never wrote at that
    point: each turn is its own sample, the prompt the target was given followed by what it generated."""
    from specheads.data.prepare import PrepareConfig, load_prepared, prepare
    from tests.data.chat_templates import QWEN3_STYLE

    tok = echo_target.tokenizer
    tok.chat_template = QWEN3_STYLE
    he, llo, end = tok.convert_tokens_to_ids(["he", "llo", "<|im_end|>"])
    regen = RegenerateConfig(batch_size=2, max_new_tokens=8, max_turns=2)
    meta = prepare(echo_target, PrepareConfig(source="jsonl", path=str(chat_rows(tmp_path / "c.jsonl", 2)),
                                              num_samples=None, regenerate=regen), tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    assert ds["id"] == ["a@turn1", "a@turn3"] and meta["per_turn_samples"]["samples"] == 2
    msgs = [{"role": "user", "content": "Say hello 0"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "Say hello 1"}]
    for row, context in zip(ds, (msgs[:1], msgs)):
        ids, mask = row["input_ids"], row["loss_mask"]
        assert ids[-3:] == [he, llo, end] and mask == [0] * (len(ids) - 3) + [1, 1, 1]
        assert tok.decode(ids[:-3]) == tok.apply_chat_template(context, add_generation_prompt=True, tokenize=False)
    # the second prompt holds the first answer as the ids the target generated, not re-tokenized text
    second = ds[1]["input_ids"]
    assert any(second[k:k + 3] == [he, llo, end] for k in range(len(second) - 6))
