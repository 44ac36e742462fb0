"""Every sampling and evaluation setting is checked before any work: one ConfigError naming the setting and
the values it takes, raised before the target loads (through the CLI: one line on stderr, exit 2, in seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specheads.decoding.drafters import TreeShape
from specheads.errors import ConfigError
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.suite import EvalConfig, MethodSpec, ServingProfiles, plan_methods

ROOT = Path(__file__).resolve().parents[2]
NGRAM = [MethodSpec("ngram-chain4", "ngram", TreeShape("chain", k=4))]


@pytest.mark.parametrize("settings,message", [
    ({"temperatures": (-1,)}, r"temperatures=\[-1\]: -1 is out of range: give a finite number >= 0"),
    ({"temperatures": (0.0, float("nan"))}, r"temperatures=\[0.0, nan\]: nan is out of range"),
    ({"temperatures": (float("inf"),)}, r"temperatures=\[inf\]: inf is out of range"),
    ({"temperatures": ()}, r"temperatures=\[\] is empty"),
    ({"temperatures": (0.0, 0.0)}, r"temperatures=\[0.0, 0.0\] repeats a value"),
    ({"temperatures": ("hot",)}, r"temperatures=\[hot\]: hot is out of range"),
    ({"max_new_tokens": 0}, r"eval.max_new_tokens=0 is out of range: give an integer >= 1"),
    ({"max_new_tokens": 2.5}, r"eval.max_new_tokens=2.5 is out of range: give an integer >= 1"),
    ({"batch_sizes": (1, 0)}, r"batch_sizes=\[1, 0\]: 0 is out of range: give an integer >= 1"),
    ({"batch_sizes": (1.5,)}, r"batch_sizes=\[1.5\]: 1.5 is out of range"),
    ({"batch_prompts": 0}, r"batch_prompts=0 is out of range: give an integer >= 1"),
    ({"repeats": 0}, r"eval.repeats=0 is out of range: give an integer >= 1"),
    ({"max_minutes": 0}, r"eval.max_minutes=0 is out of range: give a finite number > 0 \(or null\)"),
    ({"max_minutes": -3.0}, r"eval.max_minutes=-3.0 is out of range"),
    ({"max_minutes": float("inf")}, r"eval.max_minutes=inf is out of range"),
    ({"recommend_ks": (1, 0)}, r"recommend_ks=\[1, 0\]: 0 is out of range: give an integer >= 1"),
    ({"seed": 1.5}, r"seed=1.5: give an integer"),
    ({"cpu_threads": 0}, r"cpu_threads=0 is out of range: give an integer >= 1.*auto"),
    ({"exact_forward": "yes"}, r"exact_forward=yes: use one of auto, on, off"),
    ({"cpu_linears": "fast"}, r"cpu_linears=fast: use one of auto, packed, plain"),
    ({"benchmarks": BenchmarkSpec(humaneval=-1)}, r"eval.humaneval=-1 is out of range: give an integer >= 0 \(or null\)"),
    ({"benchmarks": BenchmarkSpec(mtbench_per_category=-2)}, r"eval.mtbench_per_category=-2"),
    ({"benchmarks": BenchmarkSpec(chat=1.5)}, r"eval.chat=1.5"),
    ({"benchmarks": BenchmarkSpec(jsonl_limit=-1)}, r"eval.jsonl_limit=-1"),
    ({"benchmarks": BenchmarkSpec(mtbench_turns=(3,))}, r"eval.mtbench_turns=\[3\]: give \[1\], \[2\] or \[1, 2\]"),
    ({"benchmarks": BenchmarkSpec(mtbench_turns=())}, r"eval.mtbench_turns=\[\]"),
])
def test_an_evaluation_setting_out_of_range_is_a_config_error_naming_it(settings, message):
    with pytest.raises(ConfigError, match=message) as e:
        EvalConfig(NGRAM, **settings)
    assert "\n" not in str(e.value)


def test_settings_in_range_pass_and_temperatures_become_floats():
    cfg = EvalConfig(NGRAM, temperatures=(0, 1), batch_sizes=(), max_minutes=7, cpu_threads=2,
                     benchmarks=BenchmarkSpec(humaneval=None, chat=0, mtbench_turns=(2,)))
    assert cfg.temperatures == (0.0, 1.0) and all(isinstance(T, float) for T in cfg.temperatures)
    EvalConfig(NGRAM, temperatures=(0.0, 0.7), max_minutes=0.5)


@pytest.mark.parametrize("settings,message", [
    ({"chain_k": 0}, r"chain_k=0 is out of range: give an integer >= 1"),
    ({"tree": TreeShape("dynamic", depth=0)}, r"tree.depth=0 is out of range: give an integer >= 1"),
    ({"tree": TreeShape("dynamic", topk=0)}, r"tree.topk=0"),
    ({"tree": TreeShape("dynamic", total_tokens=-1)}, r"tree.total_tokens=-1"),
    ({"serving": ServingProfiles(vllm_num_speculative_tokens=0)}, r"serving.vllm_num_speculative_tokens=0"),
    ({"serving": ServingProfiles(sglang_steps=0)}, r"serving.sglang_steps=0"),
    ({"serving": ServingProfiles(sglang_topk=0)}, r"serving.sglang_topk=0"),
    ({"serving": ServingProfiles(sglang_num_draft_tokens=1)}, r"serving.sglang_num_draft_tokens=1 .* >= 2"),
    ({"early_exit_layers": 0}, r"early_exit_layers=0"),
    ({"ngram_max": 0}, r"ngram_max=0"),
    ({"verify": "fast"}, r"verify=fast: use one of auto, chain, tree, typical"),
    ({"lookahead": {"window": 0}}, r"lookahead.window=0"),
    ({"lookahead": {"ngram": 1}}, r"lookahead.ngram=1 is out of range: give an integer >= 2"),
    ({"lookahead": {"guesses": 0}}, r"lookahead.guesses=0"),
    ({"medusa_choices": [[0], [-1]]}, r"medusa_choices: \[-1\] is no tree path"),
    ({"medusa_choices": [[]]}, r"medusa_choices: \[\] is no tree path"),
    ({"medusa_tree_nodes": 0}, r"medusa_tree_nodes=0"),
    ({"head_ngram": -1}, r"head_ngram=-1 is out of range: give an integer >= 0"),
    ({"head_ngram_extend": -1}, r"head_ngram_extend=-1"),
    ({"head_ngram_extend_len": 0}, r"head_ngram_extend_len=0"),
    ({"head_ngram_table_tokens": 0}, r"head_ngram_table_tokens=0"),
])
def test_a_drafting_setting_out_of_range_is_a_config_error_naming_it(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        plan_methods("eagle3", str(tmp_path), ["ngram", "lookahead"], **settings)


def _specheads(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "specheads.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


REFUSED = [
    ("temperatures=[-1]", "temperatures=[-1]: -1 is out of range: give a finite number >= 0"),
    ("eval.max_minutes=0", "eval.max_minutes=0.0 is out of range: give a finite number > 0 (or null)"),
    ("tree.depth=0", "tree.depth=0 is out of range: give an integer >= 1"),
    ("threads=0", "threads=0 is out of range: give an integer >= 1 (or null)"),
]


def test_the_cli_refuses_a_setting_in_one_line_before_the_target_loads(tmp_path):
    """The target named does not exist: a run that reached its loading would fail otherwise. One command through
    the CLI (its one line, exit status, no output folder); every refused setting through the recipe's own run below."""
    override, message = REFUSED[0]
    started = time.monotonic()
    proc = _specheads("evaluate", override, "target.name_or_path=/nonexistent/model", f"output_dir={tmp_path / 'eval'}",
                      cwd=tmp_path)
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"specheads evaluate: error: {message}"), proc.stderr[-3000:]
    assert sum("error:" in line for line in lines) == 1
    assert not (tmp_path / "eval").exists() and took < 60


@pytest.mark.parametrize("override,message", REFUSED)
def test_the_recipe_refuses_a_setting_before_the_target_loads(tmp_path, override, message):
    """The evaluate recipe's ``run`` (what the CLI runs) on the composed config: the setting's ConfigError, raised
    before the target (which does not exist) is looked for and before the output folder is made."""
    import importlib.util

    from hydra import compose, initialize_config_dir

    spec = importlib.util.spec_from_file_location("evaluate_recipe_settings", ROOT / "recipes" / "evaluate.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)  # registers the schema
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("evaluate", [override, "target.name_or_path=/nonexistent/model",
                                   f"output_dir={tmp_path / 'eval'}"])
    with pytest.raises(ConfigError) as e:
        recipe.run(cfg)
    assert str(e.value).startswith(message)
    assert not (tmp_path / "eval").exists()
