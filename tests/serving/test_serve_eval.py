"""serve-eval without an engine: its figures and the comparison with the evaluator on made-up counters, the
recipe end to end through the CLI with a stand-in engine (tests/serving/fake_engine_worker.py), and every user
error as one line before an engine starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.data.benchmarks import EvalPrompt
from specheads.serving import serve_eval as se
from specheads.serving.counters import EngineCounters

ROOT = Path(__file__).resolve().parents[2]
FAKE_PYTHON = Path(__file__).with_name("fake_python.sh")


class Tokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kw):
        return " ".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


class FakeDecoder:
    """Decodes ``n`` tokens; speculative: the chain's first draft accepted ``hit`` of the steps."""

    def __init__(self, k: int = 0, per_pos: tuple = (), steps: int = 0, seconds: float = 1.0, wrong: bool = False):
        self.k, self.per_pos, self.steps, self.seconds, self.wrong, self.prompts = k, per_pos, steps, seconds, wrong, []

    def generate(self, prompt_ids, max_tokens):
        self.prompts.append(list(prompt_ids))
        tokens = list(range(max_tokens))
        if self.wrong:
            tokens[-1] = -1
        c = EngineCounters(drafts=self.steps, draft_tokens=self.steps * self.k, accepted=sum(self.per_pos),
                           accepted_per_pos=list(self.per_pos), generation_tokens=max_tokens, requests=1,
                           decode_seconds=self.seconds)
        return se.Decoded(tokens, "", self.seconds, c)


PROMPTS = [EvalPrompt("mtbench/81/t1", "writing", ["Write a poem.", "Shorter."], 0),
           EvalPrompt("mtbench/81/t2", "writing", ["Write a poem.", "Shorter."], 1),
           EvalPrompt("HumanEval/0", "code", ["def f(): pass"], 0)]


def test_figures_per_domain_and_overall():
    plain = FakeDecoder(seconds=2.0)
    spec = FakeDecoder(k=3, per_pos=(6, 3, 1), steps=10, seconds=1.0)
    runs = se.decode_prompts(PROMPTS, Tokenizer(), spec, 21, plain)
    assert [r.id for r in runs] == [p.id for p in PROMPTS]
    # turn 2's prompt carries the plain answer to turn 1 (as the evaluator builds it): longer than turn 1's
    assert len(runs[1].spec.token_ids) == 21 and runs[1].prompt_tokens > runs[0].prompt_tokens
    assert plain.prompts == spec.prompts
    figures = se.by_domain(runs, 3)
    assert list(figures) == ["code", "writing", "all"]
    s = figures["all"]["spec"]
    assert s["tau"] == pytest.approx(2.0) and s["reach"] == pytest.approx([0.6, 0.3, 0.1])
    assert s["tokens_per_forward"] == pytest.approx(2.0)  # (21 - 1) new tokens after the prefill's, 10 steps
    assert s["alpha"] == pytest.approx(10 / 19) and s["draft_acceptance_rate"] == pytest.approx(1 / 3)
    assert s["tokens_per_s"] == pytest.approx(20.0) and figures["all"]["plain"]["tokens_per_s"] == pytest.approx(10.0)
    assert figures["all"]["speedup"] == pytest.approx(2.0) and figures["all"]["speedup_median_per_prompt"] == 2.0
    assert (figures["all"]["identical"], figures["all"]["compared"]) == (3, 3)
    assert figures["writing"]["prompts"] == 2 and figures["writing"]["spec"]["drafts"] == 20
    wrong = se.by_domain(se.decode_prompts(PROMPTS, Tokenizer(), FakeDecoder(3, (6, 3, 1), 10, wrong=True), 21,
                                           FakeDecoder()), 3)
    assert wrong["all"]["identical"] == 0


def eval_report(accepted: list[int], forwards: int, shape: str = "chain3", profile: str = "vllm") -> dict:
    row = {"target_forwards": forwards, "accepted": accepted, "tested": [forwards] + accepted[:-1]}
    return {"num_prompts": 3, "methods": [
        {"name": "eagle3-auto", "drafter": "eagle3", "shape": "fan2", "profile": None, "ngram_branch": 0,
         "by_temperature": {"0.0": {"all": row}}},
        {"name": "eagle3-vllm", "drafter": "eagle3", "shape": shape, "profile": profile, "ngram_branch": 0,
         "by_temperature": {"0.0": {"all": row, "code": row}}}]}


def test_comparison_with_the_evaluator_flags_only_beyond_noise():
    runs = se.decode_prompts(PROMPTS, Tokenizer(), FakeDecoder(3, (60, 30, 10), 100), 201, FakeDecoder())
    same = se.build_report(runs, 3, {}, eval_report([180, 90, 30], 300), "eagle3")["evaluator"]
    assert same["method"] == "eagle3-vllm" and same["report_prompts"] == 3
    row = same["domains"]["all"]
    assert row["tau_evaluator"] == pytest.approx(2.0) and row["tau_engine"] == pytest.approx(2.0)
    assert not row["tau_flagged"] and not any(p["flagged"] for p in row["positions"])
    # a head whose acceptance collapsed in the engine (a broken export): flagged
    broken = se.build_report(se.decode_prompts(PROMPTS, Tokenizer(), FakeDecoder(3, (5, 1, 0), 100), 201,
                                               FakeDecoder()), 3, {}, eval_report([180, 90, 30], 300), "eagle3")
    assert broken["evaluator"]["domains"]["all"]["tau_flagged"] is True
    assert broken["evaluator"]["domains"]["all"]["positions"][0]["flagged"] is True
    # a small difference on few steps is noise
    near = se.build_report(runs, 3, {}, eval_report([17, 9, 3], 30), "eagle3")["evaluator"]["domains"]["all"]
    assert not near["tau_flagged"]
    # a longer measured chain is cut to the engine's k; none measured: said so
    cut = se.build_report(runs, 2, {}, eval_report([180, 90, 30, 10], 300, "chain4"), "eagle3")["evaluator"]
    assert cut["domains"]["all"]["tau_evaluator"] == pytest.approx(1.9)
    none = se.build_report(runs, 3, {}, eval_report([180], 300, "chain1"), "eagle3")["evaluator"]
    assert none["method"] is None and "serving.vllm_num_speculative_tokens=3" in none["note"]


def with_shape_choice(report: dict, speedups: dict[int, float]) -> dict:
    """``report`` with the automatic shape choice of its ``eagle3-auto`` method: a prediction per chain length."""
    chains = [{"label": f"chain{k}", "kind": "chain", "k": k, "speedup": v} for k, v in speedups.items()]
    return {**report, "shape_choice": {"eagle3-auto": {"label": "fan2", "predictions": chains + [
        {"label": "fan2", "kind": "fan", "k": 2, "speedup": 9.0}]}}}


def test_auto_serves_the_chain_the_evaluation_predicts_fastest():
    report = with_shape_choice(eval_report([180, 90, 30], 300), {1: 1.17, 2: 1.05, 3: 1.01})
    k, why = se.chain_length("auto", report, "eagle3")
    assert k == 1 and "chain1 1.17x, chain2 1.05x, chain3 1.01x" in why and "eagle3-auto" in why  # the fan is no chain
    assert se.chain_length("auto", with_shape_choice(eval_report([180], 300), {1: 0.9, 2: 1.2, 3: 1.1}), "eagle3")[0] == 2
    assert se.chain_length("auto", report, "medusa")[0] == 3  # no prediction for this drafter: vLLM's profile
    assert se.chain_length("auto", eval_report([180], 300), "eagle3") == (3, se.chain_length("auto", {}, "eagle3")[1])
    assert "no evaluation report" in se.chain_length("auto", None, "eagle3")[1]
    assert se.chain_length(5, report, "eagle3") == (5, "num_speculative_tokens as given")
    # the comparison reads the evaluator's chain of 3 cut to the engine's 1
    runs = se.decode_prompts(PROMPTS, Tokenizer(), FakeDecoder(1, (60,), 100), 201, FakeDecoder())
    cut = se.build_report(runs, 1, {"chain_choice": why}, report, "eagle3")
    assert cut["evaluator"]["method"] == "eagle3-vllm" and cut["evaluator"]["domains"]["all"]["tau_evaluator"] == 1.6
    assert f"Chain of 1: {why}." in se.markdown(cut)


def test_report_is_written_atomically_with_markdown(tmp_path):
    runs = se.decode_prompts(PROMPTS, Tokenizer(), FakeDecoder(3, (6, 3, 1), 10), 21, FakeDecoder(seconds=2.0))
    report = se.build_report(runs, 3, {"engine": {"name": "vLLM", "version": "0.32.0", "env": {"LD_PRELOAD": "x"},
                                                  "load_s": {"plain": 50, "spec": 60}}, "method": "eagle3"},
                             eval_report([6, 3, 1], 10), "eagle3")
    paths = se.write_report(report, tmp_path)
    assert json.loads(Path(paths["json"]).read_text())["format"] == se.FORMAT
    md = Path(paths["markdown"]).read_text()
    assert "| all | 3 | 2.00 |" in md and "`LD_PRELOAD=x`" in md and "eagle3-vllm" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve_report.json", "serve_report.md"]


def test_read_eval_report_errors(tmp_path):
    with pytest.raises(se.UserError, match="no such file"):
        se.read_eval_report(tmp_path / "nope.json")
    (tmp_path / "report.json").write_text("{}")
    with pytest.raises(se.UserError, match="no evaluation report"):
        se.read_eval_report(tmp_path)


def test_the_engine_decodes_the_prompts_the_evaluation_scored():
    """An evaluation budget may score fewer prompts than the set: the engine decodes those, in the set's order."""
    report = {"prompt_ids": ["HumanEval/0", "mtbench/81/t1"]}
    assert [p.id for p in se.report_prompts(PROMPTS, report, "r.json")] == ["mtbench/81/t1", "HumanEval/0"]
    assert se.report_prompts(PROMPTS, {"methods": []}, "r.json") is None  # an older report: not listed
    with pytest.raises(se.UserError, match=r"r.json scored 1 prompt\(s\) these eval.\* settings do not load "
                                           r"\(chat/7\)"):
        se.report_prompts(PROMPTS, {"prompt_ids": ["chat/7", "HumanEval/0"]}, "r.json")


# ------------------------------------------------------------------ the recipe through the CLI


def make_export(root: Path, method: str = "eagle3", layout: str = "vllm", model_name: str = "vllm") -> Path:
    folder = root / "export" / model_name
    folder.mkdir(parents=True)
    (folder / "specheads_export.json").write_text(json.dumps(
        {"format": "specheads.export/1", "method": method, "engine": layout, "target": "smollm2",
         "weights": "model.safetensors"}))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text("{}")
    return folder


def serve_eval(*args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), FAKE_ENGINE_REAL_PYTHON=sys.executable, **env_extra)
    return subprocess.run([sys.executable, "-m", "specheads.cli", "serve-eval", "eval=tiny", "eval.humaneval=0",
                           "eval.mtbench_per_category=1", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("specheads serve-eval: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.mark.slow
def test_recipe_end_to_end_with_a_stand_in_engine(tmp_path):
    export = make_export(tmp_path)
    proc = serve_eval(f"export_dir={export}", f"vllm.python={FAKE_PYTHON}", f"output_dir={tmp_path / 'out'}",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "serve_report.json").read_text())
    assert report["num_prompts"] == 8 and report["engine"]["version"] == "0.32.0"
    assert report["engine"]["load_s"].keys() == {"plain", "spec"}
    assert report["speculative_config"] == {"method": "eagle3", "model": str(export.resolve()),
                                            "num_speculative_tokens": 3}
    every = report["domains"]["all"]
    assert every["identical"] == 8 and every["spec"]["tau"] == pytest.approx(2.0)
    assert every["spec"]["reach"] == [1.0, 0.0, 0.0] and every["speedup"] == pytest.approx(2.0)
    assert "fake engine log" in (tmp_path / "out" / "engine_spec.log").read_text()
    assert "| all | 8 | 2.00 |" in proc.stdout
    # beside an evaluation that scored 2 of these prompts: the engine decodes those 2
    ids = [p["id"] for p in report["per_prompt"]][2:4]
    (tmp_path / "report.json").write_text(json.dumps({"num_prompts": 2, "prompt_ids": ids, "methods": []}))
    proc = serve_eval(f"export_dir={export}", f"vllm.python={FAKE_PYTHON}", f"output_dir={tmp_path / 'two'}",
                      f"eval_report={tmp_path / 'report.json'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "serve_report.json").read_text())
    assert [p["id"] for p in two["per_prompt"]] == ids and "scored" not in proc.stderr
    assert two["num_speculative_tokens"] == 3 and "vLLM's serving profile" in two["chain_choice"]
    # beside one whose shape choice predicts a chain of 2 fastest: the engine drafts 2
    (tmp_path / "report.json").write_text(json.dumps(with_shape_choice(
        {"num_prompts": 2, "prompt_ids": ids, "methods": eval_report([180], 300)["methods"]}, {1: 1.1, 2: 1.3, 3: 1.2})))
    proc = serve_eval(f"export_dir={export}", f"vllm.python={FAKE_PYTHON}", f"output_dir={tmp_path / 'auto'}",
                      f"eval_report={tmp_path / 'report.json'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    auto = json.loads((tmp_path / "auto" / "serve_report.json").read_text())
    assert auto["num_speculative_tokens"] == 2 and auto["speculative_config"]["num_speculative_tokens"] == 2
    assert json.loads((tmp_path / "auto" / "engine_spec.json").read_text())["speculative_config"][
        "num_speculative_tokens"] == 2


@pytest.mark.slow
def test_user_errors_are_one_line_before_any_engine(tmp_path):
    export = make_export(tmp_path)
    nothing = dict(SPECHEADS_ENGINE_VENV=str(tmp_path / "no-venv"), PATH="/usr/bin:/bin")
    line = one_line(serve_eval(f"export_dir={export}", cwd=tmp_path, **nothing))
    assert "no vLLM engine found" in line and "bash scripts/setup_engine.sh" in line
    line = one_line(serve_eval(f"export_dir={export}", "vllm.python=/no/such/python", cwd=tmp_path))
    assert "vllm.python=/no/such/python: no such file" in line
    line = one_line(serve_eval(f"export_dir={export.parent}", cwd=tmp_path))
    assert "not an exported head" in line and f"export_dir={export}" in line
    line = one_line(serve_eval(f"export_dir={tmp_path / 'missing'}", cwd=tmp_path))
    assert "no such folder" in line
    line = one_line(serve_eval(cwd=tmp_path))
    assert "export_dir is required" in line
    sglang = make_export(tmp_path / "s", layout="sglang", model_name="sglang")
    assert "SGLang layout" in one_line(serve_eval(f"export_dir={sglang}", cwd=tmp_path))
    line = one_line(serve_eval(f"export_dir={export}", f"eval_report={tmp_path / 'none.json'}", cwd=tmp_path))
    assert "eval_report=" in line and "no such file" in line
    assert "engine=endpoint needs url=" in one_line(serve_eval("engine=endpoint", cwd=tmp_path))
    assert "engine=offline" in one_line(serve_eval("engine=remote", cwd=tmp_path))
    refused = make_export(tmp_path / "r", model_name="refuse")
    line = one_line(serve_eval(f"export_dir={refused}", f"vllm.python={FAKE_PYTHON}", "plain=false",
                               f"output_dir={tmp_path / 'r' / 'out'}", cwd=tmp_path))
    assert "vLLM did not start" in line and "Unsupported speculative method: 'medusa'" in line and "engine log:" in line
    kept = json.loads((tmp_path / "r" / "out" / "serve_report.json").read_text())  # the refusal is recorded
    assert "Unsupported speculative method: 'medusa'" in kept["refused"] and kept["method"] == "eagle3"
    assert "refused the eagle3 head" in (tmp_path / "r" / "out" / "serve_report.md").read_text()
    assert not (tmp_path / "out").exists()


def test_config_composes_for_both_engines_and_catches_typos():
    import importlib.util

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    spec = importlib.util.spec_from_file_location("recipe_serve_eval", ROOT / "recipes" / "serve_eval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)  # registers serve_eval_schema
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        offline = compose("serve_eval", ["export_dir=x", "vllm.python=/opt/vllm/bin/python"])
        endpoint = compose("serve_eval", ["engine=endpoint", "url=http://127.0.0.1:8000"])
        with pytest.raises(Exception, match="pythn"):
            compose("serve_eval", ["vllm.pythn=/x"])
    assert offline.engine == "offline" and offline.vllm.kv_cache_gib == 1
    assert endpoint.engine == "endpoint" and endpoint.url == "http://127.0.0.1:8000"
    OmegaConf.to_container(offline, resolve=True, throw_on_missing=True)
    assert [p.id for p in module.prompt_set(offline)][:2] == ["mtbench/121/t1", "mtbench/121/t2"]


def test_a_refusal_quotes_the_engines_root_cause_not_its_relay(tmp_path):
    """vLLM's own message for a worker that failed is "Engine core initialization failed. See root cause above.":
    the refusal quotes the cause its log holds (the first one logged as an ERROR, else the last printed)."""
    from specheads.serving.engine import root_cause

    log = tmp_path / "engine.log"
    log.write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
        "RecursionError: maximum recursion depth exceeded while calling a Python object\n"  # recovered from, earlier
        "(EngineCore pid=7) INFO 12-03 [core.py:1] loading\n"
        "(Worker pid=8) ERROR 12-03 13:35:25 [multiproc_executor.py:953]     raise RuntimeError(\n"
        "(Worker pid=8) ERROR 12-03 13:35:25 [multiproc_executor.py:953] RuntimeError: Model does not support "
        "EAGLE3 interface but aux_hidden_state_outputs was requested\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert root_cause(log) == ("RuntimeError: Model does not support EAGLE3 interface but aux_hidden_state_outputs "
                               "was requested")
    log.write_text("ValueError: first\nvllm.v1.engine.exceptions.EngineDeadError: the engine died\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")
    assert root_cause(log) == "EngineDeadError: the engine died"
    log.write_text("INFO all fine\n")
    assert root_cause(log) is None and root_cause(tmp_path / "missing.log") is None


@pytest.mark.parametrize("config, fmt, method, parallel", [
    ({"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"]}, "speculators", "eagle3", False),
    ({"speculators_model_type": "peagle", "architectures": ["PEagleDraftModel"]}, "speculators", "peagle", True),
    ({"architectures": ["LlamaForCausalLMEagle3"]}, "eagle3", "eagle3", False),
    ({"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"use_last_layernorm": True}}, "modelopt", "eagle3",
     False),
])
def test_a_head_folder_another_trainer_wrote_is_served_as_written(tmp_path, config, fmt, method, parallel):
    """serve-eval takes the folder speculators, SpecForge or ModelOpt wrote (what their users give vLLM): the head
    kind from its config, the folder itself as the drafter, the format in the report."""
    from specheads.serving.engine import read_export, speculative_config

    folder = tmp_path / "theirs"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(se.UserError, match="holds no weights"):
        read_export(folder)
    (folder / "model.safetensors").write_bytes(b"")
    head = read_export(folder)
    assert (head.method, head.layout, head.info) == (method, fmt, {"foreign": fmt}) and head.adapted_target is None
    spec = speculative_config(head, 3)
    assert spec["method"] == "eagle3" and spec["model"] == str(folder.resolve())
    assert spec.get("parallel_drafting", False) is parallel
    report = se.build_report([], 3, {"method": method, "export_dir": str(folder), "head_source": fmt})
    assert f"(in {fmt}'s format, served as that trainer wrote it)" in se.markdown(report)


def test_a_folder_of_no_known_format_is_still_not_an_exported_head(tmp_path):
    from specheads.serving.engine import read_export

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(se.UserError, match="not an exported head"):
        read_export(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "mlp"}))
    with pytest.raises(se.UserError, match="speculators_model_type 'mlp'"):
        read_export(tmp_path)


def test_a_context_length_over_the_targets_is_refused_before_the_engine_starts(tmp_path):
    from specheads.errors import ConfigError
    from specheads.recipes.serve_eval import check_context_length

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    check_context_length(512, tmp_path)
    check_context_length(None, tmp_path)  # null: the engine takes the target's own
    with pytest.raises(ConfigError, match=r"vllm.max_model_len=2048 is over the target's context length \(512"):
        check_context_length(2048, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 1024}}))
    with pytest.raises(ConfigError, match="1024"):
        check_context_length(2048, tmp_path)


@pytest.mark.parametrize("override, words", [("url=localhost:8000", "url=localhost:8000: give the server's base url"),
                                             ("vllm.max_model_len=0", "vllm.max_model_len=0 is out of range"),
                                             ("vllm.dtype=int8", "vllm.dtype=int8: use one of"),
                                             ("num_speculative_tokens=0", "num_speculative_tokens=0 is out of range"),
                                             ("num_speculative_tokens=long", "or auto: the chain")])
def test_serve_eval_settings_are_checked_without_reading_a_file(override, words):
    from specheads.errors import ConfigError
    from specheads.overrides import compose
    from specheads.recipes.serve_eval import check_config

    with pytest.raises(ConfigError, match=words):
        check_config(compose("serve_eval", [override], "serve-eval"))


def test_an_engine_worker_ends_with_the_run_that_started_it(tmp_path):
    """A run killed while its engine loads or decodes (timeout, SIGKILL) leaves no vLLM process behind: the worker,
    in its own session, ends its whole group once its parent is gone. A worker in its parent's group never does."""
    import time

    from specheads.serving import engine_worker

    child = ("import sys, time; sys.path.insert(0, sys.argv[1]); from specheads.serving.engine_worker import "
             "die_with_parent; die_with_parent(int(sys.argv[2]), 0.05); time.sleep(60)")
    parent = ("import os, subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], "
              "str(os.getpid())], "
              "start_new_session=sys.argv[3] == '1', stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
              "print(p.pid, flush=True); os._exit(0)")
    root = str(Path(engine_worker.__file__).resolve().parents[2])
    pids = {}
    for session in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", parent, child, root, session], capture_output=True, text=True,
                             timeout=60)
        pids[session] = int(out.stdout.split()[0])

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone but not yet reaped

    deadline = time.time() + 20
    while alive(pids["1"]) and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert not alive(pids["1"]), "the worker outlived its parent"
        assert alive(pids["0"]), "a worker outside its own group ended a group that is not its own"
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, 9)


@pytest.mark.slow
def test_serve_eval_loads_its_two_engines_side_by_side_and_a_refusal_closes_both(tmp_path):
    """The plain and the speculative engine start together (the second before the first is ready); the report
    keeps each worker's own load seconds and the wall time. One refused: named, and no engine process is left."""
    from tests.serving.test_engine_start import alive, starts

    export = make_export(tmp_path)
    proc = serve_eval(f"export_dir={export}", f"vllm.python={FAKE_PYTHON}", f"output_dir={tmp_path / 'out'}",
                      cwd=tmp_path, FAKE_ENGINE_LOAD_S="2", FAKE_ENGINE_STARTS=str(tmp_path / "starts.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = starts(tmp_path / "starts.jsonl")
    assert seen["spec", "start"]["t"] < seen["plain", "ready"]["t"]
    assert seen["plain", "start"]["t"] < seen["spec", "ready"]["t"]
    engine = json.loads((tmp_path / "out" / "serve_report.json").read_text())["engine"]
    assert "side by side" in engine["mode"] and engine["load_s"] == {"plain": 0.1, "spec": 0.1}
    assert min(engine["load_wall_s"].values()) >= 2 and engine["start_wall_s"] >= 2
    assert engine["logs"].keys() == {"plain", "spec"}
    refused = make_export(tmp_path / "r", model_name="refuse")
    proc = serve_eval(f"export_dir={refused}", f"vllm.python={FAKE_PYTHON}", f"output_dir={tmp_path / 'r' / 'out'}",
                      cwd=tmp_path, FAKE_ENGINE_PLAIN_LOAD_S="60", FAKE_ENGINE_STARTS=str(tmp_path / "r.jsonl"),
                      FAKE_ENGINE_REFUSE_AFTER="plain")
    line = one_line(proc)
    assert "Unsupported speculative method: 'medusa'" in line and "engine_spec.log" in line
    seen = starts(tmp_path / "r.jsonl")
    assert ("plain", "start") in seen and ("plain", "ready") not in seen
    assert not any(alive(r["pid"]) for r in seen.values())
