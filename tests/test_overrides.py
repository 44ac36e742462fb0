"""A mistyped setting, a value of the wrong type or an override Hydra cannot parse is one line naming the override
(exit status 2), in every recipe and before any work; `specheads run` checks every stage's settings, and their
ranges, before its first stage. The shipped settings of every head and target preset pass the same check."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.errors import ConfigError
from specheads.overrides import compose
from tests.test_cli_errors import one_line, specheads

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def schemas():
    for recipe in ("evaluate", "train"):  # their schemas in Hydra's ConfigStore, as when they run
        importlib.import_module(f"specheads.recipes.{recipe}")


def refusal(config_name: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        compose(config_name, overrides, config_name)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("config_name, override, meant", [
    ("evaluate", "temperature=-1", "did you mean temperatures?"),
    ("evaluate", "eval.chatdir=x", "did you mean eval.chat_dir"),
    ("train", "train.max_step=3", "did you mean train.max_steps"),
    ("train", "optim.learning_rate=1e-3", "optim"),
])
def test_a_mistyped_setting_names_the_settings_it_may_have_meant(config_name, override, meant):
    message = refusal(config_name, [override])
    assert message.startswith(f"{override}: no setting {override.partition('=')[0]}") and meant in message


def test_a_new_key_is_offered_with_a_plus_only_where_the_config_takes_new_keys():
    assert refusal("evaluate", ["heads.medusa=runs/m1"]).endswith("to add it, write +heads.medusa=runs/m1")
    refused = refusal("train", ["method.nonexist=1"])  # a schema's node: + would only fail later
    assert "+method" not in refused and "specheads train --cfg job" in refused


def test_a_value_of_the_wrong_type_names_the_last_override_of_the_key():
    message = refusal("train", ["train.max_steps=3", "train.max_steps=abc"])
    assert message.startswith("train.max_steps=abc:") and "Integer" in message


@pytest.mark.parametrize("override", ["eval.chat_dir=runs/x(1)", "chain_k==3"])
def test_an_override_hydra_cannot_parse_is_named(override):
    message = refusal("evaluate", ["chain_k=3", override])
    assert message.startswith(f"cannot parse {override!r}") and "expecting {" not in message


def test_good_overrides_compose():
    cfg = compose("evaluate", ["temperatures=[0]", "+heads.medusa=runs/m1", "eval.chat_dir='a b'"], "evaluate")
    assert list(cfg.temperatures) == [0] and cfg.heads.medusa == "runs/m1" and cfg.eval.chat_dir == "a b"


def cli_main_in_process(verb: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``specheads <verb> <args>`` as ``specheads.cli.main`` runs it, in this process: the recipe module runs as
    ``__main__`` (its own ``check_command_line`` call), only the interpreter's start is left out. For a command
    line the recipe refuses before ``@hydra.main`` starts: a recipe that let it through ends with Hydra's own lines
    and exit status 1 (``one_line`` refuses them), or fails here if Hydra started a job."""
    import contextlib
    import io
    import os
    import warnings

    from hydra.core.global_hydra import GlobalHydra

    from specheads import cli

    out, err, argv, here, code = io.StringIO(), io.StringIO(), list(sys.argv), os.getcwd(), 0
    saved_env = {k: os.environ.pop(k, None) for k in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR")}  # as specheads()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # runpy's note that the recipe module was imported before (by this test session): no CLI run sees it
            warnings.filterwarnings("ignore", "'specheads.recipes.", RuntimeWarning)
            cli.main([verb, *args])
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv[:] = argv
        os.chdir(here)
        os.environ.update({k: v for k, v in saved_env.items() if v is not None})
        started = GlobalHydra.instance().is_initialized()
        GlobalHydra.instance().clear()
    assert not started, "Hydra started a job: the recipe did not refuse the command line first"
    return subprocess.CompletedProcess([verb, *args], code, out.getvalue(), err.getvalue())


# a real CLI run for train proves the wiring (exit 2, one line, no traceback); every recipe runs its own
# check_command_line (its module run as __main__, as the CLI runs it) in process as well
@pytest.mark.parametrize("run, verb, override, said", [
    pytest.param(specheads, "train", "train.max_steps=abc", "could not be converted to Integer", id="cli-train"),
    *[pytest.param(cli_main_in_process, verb, override, said, id=f"in_process-{verb}") for verb, override, said in [
        ("evaluate", "temperature=-1", "did you mean temperatures?"),
        ("train", "train.max_steps=abc", "could not be converted to Integer"),
        ("prepare", "data.num_sample=3", "did you mean data.num_samples?"),
    ]],
])
def test_every_recipe_refuses_a_bad_override_in_one_line(tmp_path, run, verb, override, said):
    line = one_line(run(verb, override, f"output_dir={tmp_path / 'out'}", cwd=tmp_path), verb)
    assert override in line and said in line
    assert not (tmp_path / "out").exists()


def test_hydra_options_are_left_to_hydra(tmp_path):
    proc = specheads("train", "--cfg", "job", "train.max_steps=7", cwd=tmp_path)
    assert proc.returncode == 0 and "max_steps: 7" in proc.stdout, proc.stderr[-2000:]


def pipeline():
    return importlib.import_module("specheads.recipes.pipeline")


@pytest.mark.parametrize("args, said", [
    (["evaluate.temperaturs=[0]"], "the evaluate stage: temperaturs=[0]: no setting temperaturs; did you mean "
                                   "temperatures?"),
    (["train.train.max_steps=abc"], "the train stage: train.max_steps=abc: Value 'abc'"),
    (["train.optim.lr=-1"], "the train stage: optim.lr=-1.0 is out of range"),
    (["evaluate.tree.depth=0"], "the evaluate stage: tree.depth=0 is out of range"),
    (["serve.export_dirr=x"], "the serve stage: export_dirr=x: no setting export_dirr; did you mean export_dir?"),
    (["prepare.data=nonsense"], "the prepare stage: data=nonsense: no data named 'nonsense'"),
    (["evaluate.baselines=[two_model]"], "baselines=[two_model] needs two_model="),
    (["head=nonsense"], "head=nonsense: no head named 'nonsense'"),
    (["headd=eagle3"], "headd=eagle3: no setting headd; did you mean head?"),
    (["only=foo"], "only=foo: give one stage of prepare"),
    (["serve=maybe"], "serve=maybe: use serve=auto"),
    (["offline=maybe"], "offline=maybe: use offline=true"),
    (["head=medusa2"], "head=medusa2 trains the target itself, so its features cannot be stored: run it with "
                       "offline=false"),
    (["export.engine=foo"], "the export stage: engine=foo: use one of vllm"),
    (["export.spec_tokens=0"], "the export stage: spec_tokens=0: give an integer >= 1"),
    (["serve.vllm.max_model_len=0"], "the serve stage: vllm.max_model_len=0 is out of range"),
    (["serve.url=localhost:8000"], "the serve stage: url=localhost:8000: give the server's base url"),
])
def test_the_run_checks_every_stage_before_its_first(capsys, args, said):
    p = pipeline()
    with pytest.raises(SystemExit) as e:
        p.check_stages(p.stage_arguments(args))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specheads run: error: ") and said in err and "\n" not in err, err


@pytest.mark.parametrize("args", [[f"head={p.stem}"] + (["offline=false"] if p.stem == "medusa2" else [])
                                  for p in sorted((ROOT / "conf" / "method").glob("*.yaml"))]
                         + [[f"target={p.stem}"] for p in sorted((ROOT / "conf" / "target").glob("*.yaml"))]
                         + [["prepare.data=jsonl", "prepare.data.path=c.jsonl"],
                            ["evaluate.baselines=[two_model]", "evaluate.two_model=small"]])
def test_the_shipped_heads_and_targets_pass_the_run_check(monkeypatch, capsys, args):
    import yaml

    p = pipeline()
    preset = ROOT / "conf" / "target" / f"{args[0].removeprefix('target=')}.yaml"
    size = (yaml.safe_load(preset.read_text()).get("train_preset") or {}).get("sequence_parallel", 1) \
        if args[0].startswith("target=") else 1
    if size > 1:  # a preset whose rows are split across processes: refused in one process, whole in a group's launch
        with pytest.raises(SystemExit):
            p.check_stages(p.stage_arguments(args))
        assert f"train.sequence_parallel={size} does not divide the 1 launched processes" in capsys.readouterr().err
        monkeypatch.setenv("WORLD_SIZE", str(size))
    p.check_stages(p.stage_arguments(args))


def test_a_refused_stage_setting_ends_the_run_before_any_stage(tmp_path):
    proc = specheads("run", "evaluate.temperaturs=[0]", "serve=false", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    line = one_line(proc, "run")
    assert "did you mean temperatures?" in line and not (tmp_path / "run").exists()
    assert "[prepare]" not in proc.stdout + proc.stderr


def test_a_run_dir_that_is_a_file_is_refused_before_any_stage(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    p = pipeline()
    with pytest.raises(SystemExit) as e:
        p.check_stages([f"run_dir={tmp_path / 'f'}"])
    assert e.value.code == 2 and "run_dir=" in capsys.readouterr().err


@pytest.mark.parametrize("returncode, code", [(2, 2), (1, 1), (-9, 1)])
def test_a_failed_stage_ends_the_run_with_its_user_error_status(monkeypatch, returncode, code):
    p = pipeline()
    monkeypatch.setattr(p.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, returncode))
    with pytest.raises(SystemExit) as e:
        p.run_stage("prepare", "prepare_data.py", [])
    assert e.value.code == code and str(e.value).startswith("specheads run: stage 'prepare' failed")


def test_an_unknown_verb_is_one_line_with_the_verb_it_may_mean(tmp_path):
    proc = specheads("trian", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "specheads: error: unknown verb 'trian'; did you mean train? (the verbs: prepare, collect, train, evaluate, "
        "export, run, plan, serve-eval, record)")
