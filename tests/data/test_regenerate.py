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
    monkeypatch.setattr(regen_mod, "_generate", lambda t, p, c, s: prompts.extend(p) or real(t, p, c, s))
    resumed = regenerate(tiny_chat_target, convs(5), journal, cfg)
    assert [(c.id, c.messages) for c in resumed] == [(c.id, c.messages) for c in full]
    assert not any("question 0 " in p or "question 1 " in p for p in prompts), "finished chats were redone"
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

    rows = [{"messages": [{"role": "user", "content": "x " * (200 if i == 1 else 3)},
                          {"role": "assistant", "content": "a"}]} for i in range(3)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    regen = RegenerateConfig(batch_size=4, max_new_tokens=3, max_turns=1, max_prompt_tokens=40)
    meta = prepare(tiny_chat_target, PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_samples=None,
                                                   regenerate=regen), tmp_path / "out")
    assert meta["num_samples"] == 2
    assert meta["skipped"][NO_REGENERATED_ANSWER] == 1
