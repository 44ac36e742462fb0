import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.data.prepare import (DataMismatchError, PrepareConfig, check_prepared_matches, load_prepared,
                                    prepare)
from specheads.targets import Target

ROOT = Path(__file__).resolve().parents[2]


def write_chats(path, n=6):
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Say {i}"},
                                         {"role": "assistant", "content": f"{i} " * (3 + i)}]} for i in range(n)]
    rows.append({"id": "noans", "messages": [{"role": "user", "content": "hm"}]})
    path.write_text("\n".join(json.dumps(r) for r in rows))


def test_prepare_writes_dataset_and_meta(smollm2_tokenizer, tmp_path):
    write_chats(tmp_path / "c.jsonl")
    target = Target.tokenizer_only(smollm2_tokenizer, "smollm2")
    meta = prepare(target, PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_samples=None,
                                         max_length=64), tmp_path / "out")
    ds, meta2 = load_prepared(tmp_path / "out")
    assert meta2 == meta and len(ds) == 6 and meta["skipped"] == {"no assistant turn": 1}
    assert meta["num_loss_tokens"] == sum(sum(r) for r in ds["loss_mask"])
    assert (meta["dedup"]["conversations_read"], meta["dedup"]["duplicates_within"],
            meta["dedup"]["duplicates_of_evaluation_prompts"]) == (6, 0, 0)
    assert all(len(a) == len(b) <= 64 for a, b in zip(ds["input_ids"], ds["loss_mask"]))
    check_prepared_matches(meta, target)
    with pytest.raises(DataMismatchError, match="another tokenizer"):
        check_prepared_matches({**meta, "tokenizer_fingerprint": "0000"}, target)


def test_chat_longer_than_max_length_without_answer_is_skipped(smollm2_tokenizer, tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "long " * 300}, {"role": "assistant", "content": "short"}]}) + "\n" +
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}))
    meta = prepare(Target.tokenizer_only(smollm2_tokenizer, "smollm2"),
                   PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), max_length=100), tmp_path / "o")
    assert meta["num_samples"] == 1 and meta["skipped"] == {"no assistant token within max_length": 1}


def run_recipe(*overrides, env_extra=None):
    env = {**os.environ, **env_extra} if env_extra else None
    return subprocess.run([sys.executable, str(ROOT / "recipes" / "prepare_data.py"), *overrides],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)


@pytest.mark.slow
def test_recipe_composes_real_config_and_skips_finished_stage(tmp_path):
    out = tmp_path / "prepared"
    first = run_recipe("data.num_samples=12", f"output_dir={out}")
    assert first.returncode == 0, first.stderr[-2000:]
    ds, meta = load_prepared(out)
    assert len(ds) == 12 and meta["source"]["source"] == "sharegpt"
    again = run_recipe("data.num_samples=12", f"output_dir={out}")
    assert again.returncode == 0 and "already prepared" in again.stderr + again.stdout


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", [
    (["data.max_lenght=3"], "max_lenght"),
    (["data=jsonl", "data.path=/nonexistent.jsonl"], "conversation file not found"),
])
def test_recipe_bad_input_is_a_clear_error(tmp_path, overrides, message):
    res = run_recipe(*overrides, f"output_dir={tmp_path / 'o'}")
    assert res.returncode != 0 and message in res.stderr + res.stdout
    assert not (tmp_path / "o").exists()


def test_tool_turns_are_kept_or_skipped_and_counted_by_what_the_template_renders(smollm2_tokenizer, tmp_path):
    import copy

    from specheads.data.prepare import TOOL_TURN_NOT_RENDERED
    from tests.data.test_render import DROPS_TOOLS, TOOL_CHAT

    rows = [{"id": "tool", "messages": TOOL_CHAT},
            {"id": "plain", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg = PrepareConfig(source="jsonl", path=str(tmp_path / "c.jsonl"), num_samples=None)
    meta = prepare(Target.tokenizer_only(smollm2_tokenizer, "smollm2"), cfg, tmp_path / "chatml")
    ds, _ = load_prepared(tmp_path / "chatml")
    assert ds["id"] == ["tool", "plain"] and meta["skipped"] == {}
    assert '{"temp": 21}' in smollm2_tokenizer.decode(ds[0]["input_ids"])

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = DROPS_TOOLS
    meta = prepare(Target.tokenizer_only(tok, "drops-tools"), cfg, tmp_path / "drops")
    assert meta["num_samples"] == 1 and meta["skipped"] == {TOOL_TURN_NOT_RENDERED: 1}


ENGINE_CASES = [
    (["regenerate.engine.capture_layers=[1,99]"], ["regenerate.engine.capture_layers", "99", "out of range"]),
    (["data.max_length=8192", "regenerate.engine.max_model_len=4096"], ["data.max_length=8192",
                                                                     "regenerate.engine.max_model_len=4096"]),
    (["regenerate.engine.max_model_len=0"], ["max_model_len", "positive"]),
    (["regenerate.engine.max_model_len=1024", "data.max_length=512"], ["regenerate.max_prompt_tokens=1024",
                                                                       "no room for an answer"]),
]


def run_in_process(*overrides, env_extra=None):
    """The recipe's own steps in this process (tests/test_cli_errors.py's ``in_process``), from ROOT as run_recipe."""
    from tests.test_cli_errors import in_process

    return in_process("prepare", *overrides, cwd=ROOT, **(env_extra or {}))


# one real run of the recipe proves its wiring (exit 2, the last stderr line); every case runs in process as well
@pytest.mark.parametrize("run, overrides, words",
                         [pytest.param(run_recipe, *ENGINE_CASES[0], id="script-0")]
                         + [pytest.param(run_in_process, *c, id=f"in_process-{i}") for i, c in enumerate(ENGINE_CASES)])
def test_a_bad_engine_regeneration_setting_is_one_line_before_any_engine_starts(tmp_path, run, overrides, words):
    """Refused before the engine is looked for (no engine python here: these fail the same without one)."""
    res = run("regenerate=engine", *overrides, f"output_dir={tmp_path / 'o'}",
              env_extra={"SPECHEADS_ENGINE_PYTHON": "/nonexistent"})
    err = (res.stderr.strip().splitlines() or [""])[-1]
    assert res.returncode == 2 and err.startswith("specheads prepare: error:"), res.stderr[-2000:]
    assert all(w in err for w in words), err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.capture").exists()


def test_answers_come_from_a_server_or_from_the_engine_here_not_both():
    from specheads.data.regenerate import RegenerateConfig
    from specheads.errors import UserError

    with pytest.raises(UserError, match="not both"):
        RegenerateConfig(endpoint={"url": "http://127.0.0.1:1/v1"}, engine={})
