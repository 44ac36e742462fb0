"""`specheads evaluate`'s inputs refused before the target loads (or, where its config cannot be read cheaply,
before the plain pass), each with one line naming the setting; and no report written before the first method row,
so an evaluation that stops early leaves an earlier complete report in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specheads.data.benchmarks import EvalPrompt, PromptFileError, load_jsonl
from specheads.decoding.drafters import TreeShape
from specheads.errors import ConfigError, InputNotFoundError, UserError
from specheads.evaluation.inputs import (TargetFacts, check_auto_shape, check_draft_model, check_early_exit,
                                         check_head_fits, check_medusa_choices, check_methods_fit, check_ngram_table,
                                         target_facts_from_config)
from specheads.evaluation.prompts import BenchmarkSpec, check_benchmark_files
from specheads.evaluation.suite import EvalConfig, MethodSpec, plan_methods

FACTS = TargetFacts("tiny2", hidden_size=32, vocab_size=256, num_layers=4)


def _head(folder: Path, **config) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_head_for_another_target_names_both_sizes(tmp_path):
    medusa = _head(tmp_path / "m", model_type="medusa", hidden_size=64, vocab_size=256, num_heads=2, target_name="tiny")
    with pytest.raises(UserError, match=r"^head_dir=.*/m was trained for another target \(tiny\): hidden size 64 "
                                        r"\(its hidden_size\) vs the target's 32 \(target.name_or_path=tiny2\)"):
        check_head_fits("head_dir", medusa, FACTS)
    check_head_fits("head_dir", medusa, TargetFacts("tiny", 64, 256, 4))
    eagle = _head(tmp_path / "e", model_type="specheads_eagle3", hidden_size=32, target_hidden_size=32,
                  vocab_size=256, aux_layers=[0, 2, 5])
    with pytest.raises(UserError, match=r"heads.eagle3=.*aux_layers \[0, 2, 5\] vs the target's 4 layers"):
        check_methods_fit([MethodSpec("e", "eagle3", head_dir=eagle)], FACTS, {eagle: "heads.eagle3"})


def test_target_sizes_read_from_config_alone(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=32, vocab_size=256, num_hidden_layers=3, intermediate_size=64,
                num_attention_heads=4).save_pretrained(tmp_path)
    assert target_facts_from_config(str(tmp_path)) == TargetFacts(str(tmp_path), 32, 256, 3)
    assert target_facts_from_config("smollm2") is None  # converted when it loads: checked then
    assert target_facts_from_config(str(tmp_path / "nope")) is None


def test_early_exit_layers_against_the_target():
    with pytest.raises(ConfigError, match=r"^early_exit_layers=99: .* has 4; give early_exit_layers=1..3"):
        check_early_exit(99, FACTS)
    with pytest.raises(ConfigError, match=r"^early_exit_layers=8: .* has 8; give early_exit_layers=1..7"):
        check_early_exit(8, TargetFacts("t", 32, 256, 8))
    check_early_exit(3, FACTS)
    methods = plan_methods(None, None, ["early_exit"], early_exit_layers=4)
    with pytest.raises(ConfigError, match="^early_exit_layers=4"):
        check_methods_fit(methods, FACTS)


def test_medusa_choices_against_the_head(tmp_path):
    with pytest.raises(ConfigError, match=r"medusa_choices: the path \[7, 7\] lacks its parent \[7\]"):
        plan_methods(None, None, ["ngram"], medusa_choices=[[0], [7, 7]])
    head = _head(tmp_path / "m", model_type="medusa", hidden_size=32, vocab_size=256, num_heads=2)
    with pytest.raises(ConfigError, match=r"the path \[0, 0, 0\] is 3 ranks deep, but the Medusa head in "
                                          r"head_dir=.* has 2 heads"):
        check_medusa_choices("head_dir", head, [(0,), (0, 0), (0, 0, 0)])
    with pytest.raises(ConfigError, match="rank 300 is past the 256 tokens"):
        check_medusa_choices("head_dir", head, [(300,)])
    check_medusa_choices("head_dir", head, [(0,), (1,), (0, 0)])


def test_method_files_named_by_their_setting(tmp_path):
    head = _head(tmp_path / "e", model_type="specheads_eagle3")
    with pytest.raises(UserError, match=r"^head_shape=auto needs .*measured_reach1.* head_dir=.*/e.*"
                                        r"train.measure_prompts"):
        check_auto_shape("head_dir", head, [])
    with pytest.raises(InputNotFoundError, match=r"^two_model=/nope: no such folder"):
        check_draft_model("/nope")
    with pytest.raises(InputNotFoundError, match=r"^head_ngram_table=/nope: no such folder"):
        check_ngram_table("/nope")
    with pytest.raises(InputNotFoundError, match=r"head_ngram_table=.* is neither a feature store"):
        check_ngram_table(str(tmp_path))


def test_prompt_files(tmp_path):
    with pytest.raises(InputNotFoundError, match=r"^eval.jsonl=/nope.jsonl: no such file"):
        check_benchmark_files(BenchmarkSpec(jsonl="/nope.jsonl"))
    text = tmp_path / "notes.txt"
    text.write_text('{"prompt": "hi", "domain": "d"}\n\nhello world\n')
    with pytest.raises(PromptFileError, match=r"notes.txt:3: not valid JSON"):
        load_jsonl(text)
    text.write_text('[1, 2]\n')
    with pytest.raises(PromptFileError, match=r"notes.txt:1: a JSON list, not an object"):
        load_jsonl(text)
    text.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PromptFileError, match=r"notes.txt: not a text file"):
        load_jsonl(text)


def test_no_report_before_the_first_method_row(tiny_target, monkeypatch):
    import specheads.evaluation.suite as suite

    monkeypatch.setattr(suite, "load_benchmarks", lambda spec: [EvalPrompt("p", "d", input_ids=[5, 6, 7])])
    written = []

    def run(*methods):
        cfg = EvalConfig(list(methods), max_new_tokens=3, temperatures=(0.0,), batch_sizes=(1,), repeats=1,
                         exact_forward="off", cpu_linears="plain", cpu_threads=1)
        with pytest.raises(InputNotFoundError):
            suite.evaluate(tiny_target, cfg, checkpoint=lambda r: written.append([m["name"] for m in r["methods"]]))

    broken = MethodSpec("two", "two_model", TreeShape("chain", k=2), draft_model="/nope")
    run(broken)  # fails in its first drafter, after the plain pass
    assert written == []
    run(MethodSpec("ngram", "ngram", TreeShape("chain", k=2)), broken)
    assert written and all(names == ["ngram"] for names in written)


def test_recipe_refuses_before_the_target_loads_and_keeps_the_report(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from transformers import LlamaConfig

    from tests.evaluation.test_conf import ROOT, _load_recipe

    recipe = _load_recipe()
    monkeypatch.setattr(recipe, "load_target", lambda *a, **k: pytest.fail("the target loaded before the check"))
    target = tmp_path / "target"  # its config alone: what the check reads
    LlamaConfig(hidden_size=32, vocab_size=256, num_hidden_layers=4, intermediate_size=64,
                num_attention_heads=4).save_pretrained(target)
    out = tmp_path / "eval"
    out.mkdir()
    (out / "report.json").write_text('{"complete": true}')
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("evaluate", ["target=hf", f"target.name_or_path={target}", "eval=tiny", "temperatures=[0.0]",
                                   "batch_sizes=[1]", "serving.engines=[]", f"output_dir={out}"])
    with pytest.raises(ConfigError, match=r"^early_exit_layers=8: .* has 4"):
        recipe.run(cfg)
    assert (out / "report.json").read_text() == '{"complete": true}'
    cfg.output_dir = str(out / "report.json")  # a file: refused before anything else
    with pytest.raises(ConfigError, match=r"^output_dir=.*report.json is a file"):
        recipe.run(cfg)
