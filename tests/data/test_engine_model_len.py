"""vLLM's context for ``regenerate=engine`` (``engine_answers.model_len``): unset, room for the longest prepared row
and for the longest prompt plus its answer, at most the target's context, so a long thinking answer is not cut by
the engine; set, as given, refused past the target's context. The settings handed to the engine are read from the
run's ``engine_regenerate.json`` (what ``EngineProcess`` passes to the worker), with the stand-in engine of
tests/data/fake_answer_engine.py (no vLLM)."""

from __future__ import annotations

import json
import sys

import pytest

from specheads.data.engine_answers import EngineRegenConfig, model_len
from specheads.errors import ConfigError
from specheads.targets.context import ContextLimit
from tests.data.test_capture_resume import FAKE

CONTEXT = ContextLimit(40960, "max_position_embeddings 40960 in its config")


@pytest.mark.parametrize("max_length, prompt, new, limit, expected", [
    (2048, 1024, 256, CONTEXT, 2048),        # the longest row wins: capture needs it whole
    (16384, 2048, 30000, CONTEXT, 32048),    # a long thinking answer: prompt plus answer
    (16384, 2048, 60000, CONTEXT, 40960),    # never past the target's context
    (4096, 1024, 8192, None, 9216),          # no context known: what the rows and answers need
])
def test_an_unset_context_fits_the_longest_row_and_answer(max_length, prompt, new, limit, expected):
    assert model_len(EngineRegenConfig(), max_length, prompt, new, limit, "t") == expected


def test_a_set_context_is_kept_and_refused_past_the_targets():
    assert model_len(EngineRegenConfig(max_model_len=8192), 16384, 2048, 30000, CONTEXT, "t") == 8192
    with pytest.raises(ConfigError, match=r"regenerate.engine.max_model_len=50000 is longer than target 't'.*40960"):
        model_len(EngineRegenConfig(max_model_len=50000), 2048, 1024, 256, CONTEXT, "t")


def test_the_engine_is_started_with_room_for_the_thinking_answers(tmp_path, monkeypatch, smollm2_tokenizer):
    """prepare regenerate=engine as the recipe runs it (the target's config and tokenizer, no weights): the context
    the engine gets is the prompt cap plus the answer cap, not a fixed 4096; and the target's context caps it."""
    from specheads.data.engine_features import meta_target
    from specheads.data.prepare import PrepareConfig, load_prepared, prepare, prepared_is_current
    from specheads.data.regenerate import RegenerateConfig
    from tests.conftest import make_tiny_model

    monkeypatch.setenv("FAKE_ENGINE_REAL_PYTHON", sys.executable)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Think about {w}."},
                                                      {"role": "assistant", "content": "Old."}]}) + "\n"
                             for w in ("tides", "lamps")))
    for context, expected in ((65536, 2048 + 30000), (16384, 16384)):
        target = tmp_path / f"target{context}"
        config = make_tiny_model("llama", vocab=len(smollm2_tokenizer), hidden=32, layers=4).config
        config.max_position_embeddings = context
        config.save_pretrained(target)
        smollm2_tokenizer.save_pretrained(target)
        regen = RegenerateConfig(batch_size=2, max_new_tokens=30000, max_prompt_tokens=2048,
                                 engine=EngineRegenConfig(python=str(FAKE), dtype="float32"))
        out = tmp_path / f"out{context}" / "prepared"
        cfg = PrepareConfig(source="jsonl", path=str(chats), num_samples=None, max_length=8192, num_proc=1,
                            regenerate=regen)
        prepare(meta_target(str(target)), cfg, out)
        started = json.loads((out.parent / "engine_regenerate.json").read_text())
        assert started["max_model_len"] == expected, started
        ds, meta = load_prepared(out)
        assert len(ds) == 2 and meta["regenerate"]["engine"]["max_model_len"] == expected
        # the setting as given is what a re-run compares: the same command finds the folder current
        assert meta["config"]["regenerate"]["engine"]["max_model_len"] is None
        assert prepared_is_current(out, cfg, meta_target(str(target)))
