"""`specheads run` re-runs a stage when anything it reads changed, and skips it only when nothing did.

No recipe runs: the stage launcher (``subprocess.run`` inside recipes/pipeline.py) is replaced by a fake
that records the stages launched and writes a file into each stage's output folder.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("prepare", "collect", "train", "evaluate", "export")


def load_pipeline():
    spec = importlib.util.spec_from_file_location("recipe_pipeline_markers", ROOT / "recipes" / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


pipeline = load_pipeline()


@pytest.fixture
def launches(monkeypatch):
    """Launched stages (in order); each launch records what its output folder held, then writes to it."""
    log = []

    def fake_run(cmd, *a, **kw):
        module, overrides = cmd[2], cmd[3:]
        out = pipeline.stage_output(overrides)
        held = sorted(p.name for p in out.iterdir()) if out is not None and out.is_dir() else []
        log.append(SimpleNamespace(stage=module.rsplit(".", 1)[-1], held=held))
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"written{len(log)}").write_text("x")
        return subprocess.CompletedProcess(cmd, returncode=getattr(fake_run, "fail", {}).pop(module, 0))

    monkeypatch.setattr(pipeline.subprocess, "run", fake_run)
    return log


RECIPE = {"prepare": "prepare_data.py", "collect": "collect_hidden_states.py", "train": "train.py",
          "evaluate": "evaluate.py", "export": "export.py"}
OUT = {"prepare": "prepared", "collect": "features", "train": "train/eagle3", "evaluate": "eval/eagle3",
       "export": "export/eagle3"}


def stages(run: Path, head: str = "eagle3", **extra: list[str]):
    out = {k: v.replace("eagle3", head) for k, v in OUT.items()}
    return [(s, RECIPE[s], [f"{'out_dir' if s in ('collect', 'export') else 'output_dir'}={run / out[s]}",
                            *extra.get(s, [])]) for s in STAGES]


def test_unchanged_rerun_skips_every_stage(tmp_path, launches):
    assert pipeline.run_stages(stages(tmp_path), tmp_path) == list(STAGES)
    assert pipeline.run_stages(stages(tmp_path), tmp_path) == []
    assert len(launches) == 5


@pytest.mark.parametrize("changed", STAGES)
def test_changing_a_stage_reruns_it_and_every_later_stage(tmp_path, launches, changed):
    pipeline.run_stages(stages(tmp_path), tmp_path)
    ran = pipeline.run_stages(stages(tmp_path, **{changed: ["some.setting=2"]}), tmp_path)
    assert ran == list(STAGES[STAGES.index(changed):])
    # and once re-run, the new settings are current everywhere
    assert pipeline.run_stages(stages(tmp_path, **{changed: ["some.setting=2"]}), tmp_path) == []


def test_a_rerun_upstream_stage_invalidates_later_ones_even_with_the_same_settings(tmp_path, launches):
    pipeline.run_stages(stages(tmp_path), tmp_path)
    (tmp_path / ".done" / "train.eagle3.json").unlink()  # e.g. the user forces a retrain
    assert pipeline.run_stages(stages(tmp_path), tmp_path) == ["train", "evaluate", "export"]


def test_stale_output_is_cleared_but_an_interrupted_run_resumes(tmp_path, launches):
    pipeline.run_stages(stages(tmp_path), tmp_path)
    launches.clear()
    # stages.train changed: training must not resume from the old checkpoints, evaluate not reuse the old report
    pipeline.run_stages(stages(tmp_path, train=["optim.lr=1e-4"]), tmp_path)
    held = {x.stage: x.held for x in launches}
    assert held["train"] == [] and held["evaluate"] == [] and held["export"] == []

    # an interrupted stage (launched, never finished) resumes from its folder with the same settings
    launches.clear()
    pipeline.subprocess.run.fail = {"specheads.recipes.train": 1}
    with pytest.raises(SystemExit, match="stage 'train' failed"):
        pipeline.run_stages(stages(tmp_path, train=["optim.lr=1e-5"]), tmp_path)
    assert launches[-1].held == []  # cleared: it held the lr=1e-4 run
    launches.clear()
    assert pipeline.run_stages(stages(tmp_path, train=["optim.lr=1e-5"]), tmp_path) == ["train", "evaluate", "export"]
    assert launches[0].held == ["written1"], "the interrupted run's output was not kept for resuming"


def test_prepare_keeps_its_folder_and_stale_folders_outside_run_dir_are_kept(tmp_path, launches):
    pipeline.run_stages(stages(tmp_path), tmp_path)
    launches.clear()
    pipeline.run_stages(stages(tmp_path, prepare=["data.num_samples=5"]), tmp_path)
    assert launches[0].stage == "prepare_data" and launches[0].held != []  # prepare decides itself (regen journal)

    elsewhere = tmp_path.parent / (tmp_path.name + "_elsewhere")
    st = stages(tmp_path)
    st[2] = ("train", "train.py", [f"output_dir={elsewhere}"])
    pipeline.run_stages(st, tmp_path)
    st[2] = ("train", "train.py", [f"output_dir={elsewhere}", "optim.lr=1"])
    launches.clear()
    pipeline.run_stages(st, tmp_path)
    assert launches[0].held != [], "a folder outside run_dir was deleted"


def test_switching_heads_keeps_each_heads_marker(tmp_path, launches):
    pipeline.run_stages(stages(tmp_path, "eagle3"), tmp_path)
    pipeline.run_stages(stages(tmp_path, "medusa1", collect=["method=medusa1"]), tmp_path)
    launches.clear()
    ran = pipeline.run_stages(stages(tmp_path, "eagle3"), tmp_path)
    # the shared feature store was recollected for medusa1, so eagle3's head retrains, from a cleared folder
    assert ran == ["collect", "train", "evaluate", "export"]
    assert {x.stage: x.held for x in launches}["train"] == []
    assert pipeline.run_stages(stages(tmp_path, "eagle3"), tmp_path) == []


def test_only_runs_one_stage_against_what_is_on_disk(tmp_path, launches):
    pipeline.run_stages(stages(tmp_path), tmp_path)
    # prepare's settings changed but prepare is not run: train's input (the prepared folder) is unchanged
    assert pipeline.run_stages(stages(tmp_path, prepare=["x=1"]), tmp_path, only="train") == []
    assert pipeline.run_stages(stages(tmp_path, prepare=["x=1"]), tmp_path, only="prepare") == ["prepare"]
    assert pipeline.run_stages(stages(tmp_path, prepare=["x=1"]), tmp_path, only="evaluate") == ["evaluate"]
    assert pipeline.run_stages(stages(tmp_path, prepare=["x=1"]), tmp_path) == ["collect", "train", "evaluate", "export"]


def test_markers_from_before_fingerprints_rerun_the_stage_without_clearing(tmp_path, launches):
    st = stages(tmp_path)
    done = tmp_path / ".done"
    done.mkdir()
    for name, _, overrides in st:  # the old format: {"overrides": [...]} per stage name
        (done / f"{name}.json").write_text(json.dumps({"overrides": overrides, "seconds": 1.0}))
        out = pipeline.stage_output(overrides)
        out.mkdir(parents=True)
        (out / "old").write_text("x")
    assert pipeline.run_stages(st, tmp_path) == list(STAGES)
    assert all(x.held == ["old"] for x in launches), "an old marker with the same settings must resume, not clear"
    assert pipeline.run_stages(st, tmp_path) == []


def real_commands(run_dir: Path, *overrides: str):
    """stage_commands of conf/pipeline.yaml with ``overrides``, under ``run_dir``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("pipeline", overrides=[f"run_dir={run_dir}", *overrides])
    return pipeline.stage_commands(cfg)


def test_the_real_pipeline_config_invalidates_evaluate_and_export_when_train_changes(tmp_path, launches):
    def commands(*overrides):
        return real_commands(tmp_path, *overrides)

    assert pipeline.run_stages(commands(), tmp_path) == list(STAGES)
    assert pipeline.run_stages(commands("stages.train=['train.max_steps=7']"), tmp_path) == ["train", "evaluate",
                                                                                             "export"]
    assert pipeline.run_stages(commands("stages.train=['train.max_steps=7']", "stages.prepare=['data.num_samples=3']"),
                               tmp_path) == list(STAGES)
    assert pipeline.run_stages(commands("stages.train=['train.max_steps=7']", "stages.prepare=['data.num_samples=3']"),
                               tmp_path) == []


def test_dflash_after_eagle3_reuses_its_feature_store(tmp_path, launches):
    def commands(*overrides):
        return real_commands(tmp_path, *overrides)

    assert pipeline.run_stages(commands(), tmp_path) == list(STAGES)
    dflash = commands("head=dflash")
    assert "method=eagle3" in dict((n, o) for n, _, o in dflash)["collect"]
    assert "method=dflash" in dict((n, o) for n, _, o in dflash)["train"]
    assert pipeline.run_stages(dflash, tmp_path) == ["train", "evaluate", "export"]  # no second collection
    peagle = commands("head=peagle")  # P-EAGLE fuses EAGLE-3's layers too
    assert "method=eagle3" in dict((n, o) for n, _, o in peagle)["collect"]
    assert "method=peagle" in dict((n, o) for n, _, o in peagle)["train"]
    assert "head_method=peagle" in dict((n, o) for n, _, o in peagle)["evaluate"]
    assert pipeline.run_stages(peagle, tmp_path) == ["train", "evaluate", "export"]
    dspark = commands("head=dspark")  # DSpark too
    assert "method=eagle3" in dict((n, o) for n, _, o in dspark)["collect"]
    assert "method=dspark" in dict((n, o) for n, _, o in dspark)["train"]
    assert pipeline.run_stages(dspark, tmp_path) == ["train", "evaluate", "export"]


def test_end_summary_lists_the_outputs_the_table_and_the_serve_lines(tmp_path):
    """The end of `specheads run`: the evaluation table, where each output is, and the exported head's serve
    commands (built by specheads.export.serve from the export's own record)."""
    from specheads.export import export_head
    from tests.conftest import make_tiny_target
    from tests.export.test_export import make_head, save_head
    from tests.export.test_serve import write_report

    target = make_tiny_target("llama", vocab=256, hidden=64, layers=4)
    target.model.save_pretrained(tmp_path / "tiny-target")
    run = tmp_path / "run"
    head = save_head(make_head("eagle3", target), run / "train" / "eagle3")
    (run / "eval" / "eagle3").mkdir(parents=True)
    (run / "eval" / "eagle3" / "report.md").write_text("| domain | tau |\n|---|---|\n| all | 2.30 |\n")
    export_head(head, run / "export" / "eagle3", "all", str(tmp_path / "tiny-target"),
                eval_report=write_report(run / "eval" / "eagle3" / "report.json"))
    text = pipeline.end_summary(run, "eagle3", offline=True, target_here=str(tmp_path / "tiny-target"))
    assert text.startswith("| domain | tau |") and "| all | 2.30 |" in text
    assert f"trained head       {run / 'train' / 'eagle3' / 'head'}" in text
    assert f"feature store      {run / 'features'}   (not written)" in text
    assert f"export             {run / 'export' / 'eagle3'}" in text
    vllm = (f"""vllm serve {tmp_path / 'tiny-target'} --speculative-config '{{"method": "eagle3", "model": """
            f""""{run / 'export' / 'eagle3' / 'vllm'}", "num_speculative_tokens": 2}}'""")
    assert vllm in text and text.rstrip().splitlines()[-1].lstrip().startswith("vllm serve ")  # speculators/
    assert "--speculative-draft-model-path " + str(run / "export" / "eagle3" / "sglang") in text
    assert pipeline.local_target_folder("smollm2") is None


def test_the_serve_stage_ends_the_run_on_the_evaluations_prompts(tmp_path, launches):
    """With vLLM's venv, the run ends by serving the vllm/ export beside the evaluation report, with the
    evaluation's eval.* settings (its stage list's and the command line's) and nothing else of its list."""
    plain = real_commands(tmp_path)
    assert [n for n, _, _ in plain] == list(STAGES)
    served = pipeline.stage_commands(*_composed(tmp_path, 'extra.evaluate=["eval.max_new_tokens=8"]',
                                                'extra.serve=["num_speculative_tokens=5"]'), serve=True)
    assert [n for n, _, _ in served] == [*STAGES, "serve"] and served[:5] != plain[:5]  # extra.evaluate differs
    name, recipe, args = served[-1]
    assert recipe == "serve_eval.py"
    for item in (f"export_dir={tmp_path / 'export' / 'eagle3' / 'vllm'}",
                 f"eval_report={tmp_path / 'eval' / 'eagle3' / 'report.json'}",
                 f"output_dir={tmp_path / 'serve' / 'eagle3'}", f"eval.chat_dir={tmp_path / 'prepared'}",
                 "eval.humaneval=2", "eval.max_minutes=7", "eval.max_new_tokens=8", "num_speculative_tokens=5"):
        assert item in args, item
    assert args.index("eval.max_new_tokens=32") < args.index("eval.max_new_tokens=8")  # the command line's last
    assert not [a for a in args if a.startswith(("baselines", "head_", "serving."))]


def _composed(run_dir, *overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return (compose("pipeline", overrides=[f"run_dir={run_dir}", *overrides]),)


def test_a_failing_serve_stage_under_auto_leaves_the_run_standing(tmp_path, launches):
    """serve=auto: a failed serve stage is reported, left unmarked (a re-run tries it again), the run goes on;
    asked for (serve=true): it fails the run like any stage."""
    st = stages(tmp_path) + [("serve", "serve_eval.py", [f"output_dir={tmp_path / 'serve' / 'eagle3'}"])]
    launches_fail = pipeline.subprocess.run
    launches_fail.fail = {"specheads.recipes.serve_eval": 2}
    assert pipeline.run_stages(st, tmp_path, optional=("serve",)) == list(STAGES)
    assert not (tmp_path / ".done" / "serve.eagle3.json").exists()
    assert pipeline.run_stages(st, tmp_path, optional=("serve",)) == ["serve"]  # tried again, now it works
    launches_fail.fail = {"specheads.recipes.serve_eval": 2}
    with pytest.raises(SystemExit, match="stage 'serve' failed"):
        pipeline.run_stages(stages(tmp_path / "b") + [("serve", "serve_eval.py", [])], tmp_path / "b")


def test_serve_auto_follows_the_engine_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("SPECHEADS_ENGINE_VENV", str(tmp_path / "none"))
    assert pipeline.serve_stage_wanted("auto", "eagle3") is False
    assert pipeline.serve_stage_wanted(True, "eagle3") is True and pipeline.serve_stage_wanted(False, "x") is False
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(ROOT / "tests" / "serving" / "fake_python.sh")
    monkeypatch.setenv("SPECHEADS_ENGINE_VENV", str(tmp_path / "venv"))
    assert pipeline.serve_stage_wanted("auto", "eagle3") is True
    with pytest.raises(SystemExit, match="serve=maybe: use serve=auto"):
        pipeline.serve_stage_wanted("maybe", "eagle3")
