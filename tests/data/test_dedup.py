"""Duplicate conversations: the normalised key, the counts, and the prepare stage dropping a repeated
chat (with all its per-turn samples) and a chat that repeats an evaluation prompt."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specheads.data.dedup import DEDUP_VERSION, DedupReport, benchmark_keys, drop_duplicates, prompt_key
from specheads.data.prepare import PrepareConfig, PrepareError, load_prepared, prepare, prepared_is_current
from specheads.data.benchmarks import load_humaneval, load_mtbench
from specheads.targets import Target


def test_prompt_key_normalises_case_whitespace_and_end_punctuation():
    assert prompt_key("  Explain   quantum\ncomputing!! ") == prompt_key("explain quantum computing") \
        == "explain quantum computing"
    assert prompt_key("«Ｈｉ»") == prompt_key("hi")  # NFKC folds full-width letters; guillemets are punctuation
    assert prompt_key("Explain X briefly") != prompt_key("Explain X")  # near-exact only: no similarity
    assert prompt_key("a.b") == "a.b"  # inner punctuation stays


def _conv(cid, first, answer="ok"):
    return SimpleNamespace(id=cid, messages=[{"role": "system", "content": "be brief"},
                                             {"role": "user", "content": first},
                                             {"role": "assistant", "content": answer}])


def test_drop_duplicates_keeps_the_first_of_a_prompt_and_counts_each_kind():
    convs = [_conv("a", "Say hi"), _conv("b", "say  HI."), _conv("c", "Say bye"), _conv("d", "Say hi", "other"),
             _conv("e", "What is 2+2?")]
    report = DedupReport()
    kept = drop_duplicates(convs, {"what is 2+2": "mtbench/1/t1"}, report)
    assert [c.id for c in kept] == ["a", "c"]
    assert report.to_dict() == {
        "version": DEDUP_VERSION, "key": report.to_dict()["key"], "conversations_read": 5, "conversations_kept": 2,
        "duplicates_within": 2, "duplicates_of_evaluation_prompts": 1, "evaluation_prompts_checked": 1,
        "examples": {"within": [["b", "a"], ["d", "a"]], "of_evaluation": [["e", "mtbench/1/t1"]]}}


def test_benchmark_keys_cover_every_mtbench_question_and_humaneval_prompt():
    keys = benchmark_keys()
    mt, he = load_mtbench(per_category=None, turns=(1,)), load_humaneval(limit=None)
    assert all(prompt_key(p.turns[0]) in keys for p in mt + he)
    stub = he[0].turns[0].split("```python\n", 1)[1].removesuffix("```")  # the raw function stub as a chat's prompt
    assert keys[prompt_key(stub)] == he[0].id
    assert keys[prompt_key(mt[0].turns[0].upper() + "  ")] == mt[0].id


def test_prepare_drops_duplicate_chats_with_their_per_turn_samples_and_counts_them(smollm2_tokenizer, tmp_path):
    from tests.data.chat_templates import QWEN3_STYLE, with_template

    question = load_mtbench(per_category=1, turns=(1,))[0]
    two_turns = [{"role": "user", "content": "Plan a trip"},
                 {"role": "assistant", "content": "<think>where?</think>Paris."},
                 {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Lyon."}]
    rows = [{"id": "trip", "messages": two_turns},
            {"id": "trip-again", "messages": [{**two_turns[0], "content": "  plan a TRIP!"}] + two_turns[1:]},
            {"id": "other", "messages": [{"role": "user", "content": "Name a colour"},
                                         {"role": "assistant", "content": "Red."}]},
            {"id": "bench", "messages": [{"role": "user", "content": question.turns[0]},
                                         {"role": "assistant", "content": "An answer."}]}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    tok = with_template(smollm2_tokenizer, QWEN3_STYLE, think_tags=True)  # rewrites history: per-turn samples
    target = Target.tokenizer_only(tok, "qwen3-style")
    cfg = PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_samples=None, max_length=256)
    meta = prepare(target, cfg, tmp_path / "out")
    ds, _ = load_prepared(tmp_path / "out")
    assert list(ds["id"]) == ["trip@turn1", "trip", "other"]  # the repeated chat dropped whole, the first kept whole
    d = meta["dedup"]
    assert (d["conversations_read"], d["conversations_kept"], d["duplicates_within"],
            d["duplicates_of_evaluation_prompts"]) == (4, 2, 1, 1)
    assert d["examples"] == {"within": [["trip-again", "trip"]], "of_evaluation": [["bench", question.id]]}
    assert d["evaluation_prompts_checked"] == len(benchmark_keys()) and d["version"] == DEDUP_VERSION
    assert prepared_is_current(tmp_path / "out", cfg, target)
    # a set prepared before the dedup (no "dedup" in its metadata) is not current: the stage runs again
    meta_path = tmp_path / "out" / "specheads_meta.json"
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "dedup"}))
    assert not prepared_is_current(tmp_path / "out", cfg, target)
    # nothing but evaluation prompts: refused with what was dropped
    (tmp_path / "b.jsonl").write_text(json.dumps(rows[3]))
    with pytest.raises(PrepareError, match=r"MT-bench/HumanEval prompt \(1\)"):
        prepare(target, PrepareConfig(source="jsonl", path=str(tmp_path / "b.jsonl"), num_samples=None), tmp_path / "b")
