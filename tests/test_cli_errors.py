"""Command-line mistakes end in one line on stderr (exit status 2, no traceback) that says what is wrong and
what to do, before any time is spent: run through the `specheads` CLI on a tiny Llama folder, tiny prepared
sets, a tiny feature store and tiny saved heads. "Before any time is spent" is checked on what a stage
leaves behind: no output folder (evaluate wrote a partial report.json before it looked at the head)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specheads.errors import ConfigError
from tests.conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab=256, hidden=64, layers=4)
TRAIN_QUICK = ["train.max_steps=2", "train.progress=false", "train.measure_prompts=0", "data.eval_samples=0",
               "wandb.mode=disabled"]


def specheads(*args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(ROOT), **env_extra)
    return subprocess.run([sys.executable, "-m", "specheads.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def in_process(verb: str, *args: str, cwd: Path, **env_extra: str) -> subprocess.CompletedProcess:
    """``specheads <verb> <args>`` run in this process, for the cases that share the wiring a real CLI run of the
    same verb proves: the steps of ``specheads.cli.main`` and of the recipe's ``__main__`` block (the group
    check, ``check_command_line``), then the recipe's own ``main`` body (``main.__wrapped__``: what
    ``@hydra.main`` calls) on the settings ``specheads.overrides.compose`` composes as ``@hydra.main`` does,
    logging to stdout as the recipes' ``hydra/job_logging: stdout`` does. Only the interpreter's start (seconds
    of imports) is left out; the exit status is the ``SystemExit`` code, stdout and stderr what was written. An
    exception other than ``SystemExit`` propagates (the CLI would print a traceback)."""
    import contextlib
    import importlib
    import io
    import logging

    from omegaconf import open_dict

    from specheads import cli, paths
    from specheads.overrides import check_command_line, compose

    config = Path(cli.VERBS[verb]).stem
    recipe = importlib.import_module(paths.recipe_module(config))  # registers its schemas, as its run does
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handler, level = logging.StreamHandler(out), root.level
    handler.setLevel(logging.INFO)
    saved_env = {k: os.environ.get(k) for k in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR", *env_extra)}
    here = os.getcwd()
    code = 0
    try:
        for k in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR"):
            os.environ.pop(k, None)
        os.environ.update(env_extra)
        os.chdir(cwd)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.check_group_choices(verb, list(args))
            check_command_line(verb, config, list(args))
            cfg = compose(config, list(args), verb)
            with open_dict(cfg):
                del cfg["hydra"]  # @hydra.main hands the task its settings without Hydra's own
            recipe.main.__wrapped__(cfg)
    except SystemExit as e:
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, (int, type(None))):  # SystemExit("message"): Python prints it, exit status 1
            err.write(f"{e.code}\n")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        os.chdir(here)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess([verb, *args], code, out.getvalue(), err.getvalue())


def one_line(proc: subprocess.CompletedProcess, stage: str) -> str:
    """The single error line of a run that must have failed as a user error (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"specheads {stage}: error:")]
    assert len(errors) == 1 and proc.stderr.rstrip().endswith(errors[0]), proc.stderr[-3000:]
    return errors[0]


def write_rows(path: Path, ids: list[str], fingerprint: str, seed: int) -> Path:
    from specheads.data.prepare import write_prepared

    g = torch.Generator().manual_seed(seed)
    rows = {"id": [], "input_ids": [], "loss_mask": [], "domain": []}
    for i in ids:
        t = int(torch.randint(3, 21, (1,), generator=g))
        rows["id"].append(i)
        rows["input_ids"].append(torch.randint(0, TINY["vocab"], (t,), generator=g).tolist())
        rows["loss_mask"].append([0] * (t // 3) + [1] * (t - t // 3))
        rows["domain"].append("chat")
    write_prepared(rows, {"target": "tiny", "tokenizer_fingerprint": fingerprint, "max_length": 32}, path)
    return path


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """A tiny Llama folder (word-level tokenizer with a chat template, so the evaluator can render prompts),
    prepared sets A and B (other sample ids), a feature store collected from B, and saved heads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from specheads.data.features import CollectOptions, collect_hidden_states
    from specheads.data.prepare import load_prepared
    from specheads.methods.base import FeatureSpec
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model
    from specheads.models.medusa import medusa_for_target
    from specheads.targets import Target, load_target, tokenizer_fingerprint

    root = tmp_path_factory.mktemp("cli_errors")
    model_dir = root / "tiny-llama"
    model = make_tiny_model("llama", **TINY)
    model.save_pretrained(model_dir)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(TINY["vocab"])}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant {% endif %}")
    tok.save_pretrained(model_dir)
    fp = tokenizer_fingerprint(tok)
    prepared_a = write_rows(root / "A" / "prepared", [f"conv-{i}" for i in range(30)], fp, seed=0)
    prepared_b = write_rows(root / "B" / "prepared", [f"other-{i}" for i in range(30)], fp, seed=1)
    store_b = root / "features_b"
    collect_hidden_states(load_target(str(model_dir), "float32", "cpu"), load_prepared(prepared_b)[0],
                          FeatureSpec(aux_layers=(), need_last=True), store_b, CollectOptions(dtype="float32"),
                          source={"prepared_dir": str(prepared_b.resolve()), "method": "medusa1"})
    target = Target(model, tok, name="tiny")
    medusa_for_target(target, num_heads=2).save_pretrained(root / "medusa" / "head")
    Eagle3Model(Eagle3Config.from_target(target, 64, aux_layers=(0, 1, 2))).save_pretrained(root / "eagle3" / "head")
    return {"root": root, "model": model_dir, "A": prepared_a, "B": prepared_b, "store_b": store_b,
            "medusa": root / "medusa", "eagle3": root / "eagle3",
            "target": [f"target.name_or_path={model_dir}", "target.dtype=float32", "target.device=cpu"]}


# --------------------------------------------------------------------------- 1, 2: evaluate reads the head folder first


@pytest.mark.parametrize("run, head", [pytest.param(specheads, "missing", id="cli-missing"),
                                       pytest.param(in_process, "missing", id="in_process-missing"),
                                       pytest.param(in_process, "no_head", id="in_process-no_head")])
def test_evaluate_refuses_a_head_folder_before_loading_the_target(fx, tmp_path, run, head):
    head_dir = {"missing": tmp_path / "nonexistent", "no_head": fx["root"] / "A"}[head]
    out = tmp_path / "eval"
    line = one_line(run("evaluate", "head_method=eagle3", f"head_dir={head_dir}", *fx["target"], "eval=tiny",
                        f"output_dir={out}", cwd=tmp_path), "evaluate")
    assert f"head_dir={head_dir}" in line and "specheads train" in line
    assert ("no such folder" if head == "missing" else "holds no head checkpoint") in line
    assert not out.exists()  # nothing decoded: the plain baselines used to run (and write a report) first


def test_evaluate_refuses_a_head_method_the_folder_contradicts(fx, tmp_path):
    """In process: the evaluate recipe's CLI wiring is proven by the real run of the test above."""
    line = one_line(in_process("evaluate", "head_method=eagle1", f"head_dir={fx['eagle3']}", *fx["target"],
                               f"output_dir={tmp_path / 'eval'}", cwd=tmp_path), "evaluate")
    assert "holds a head of kind eagle3" in line and "leave head_method out" in line
    line = one_line(in_process("evaluate", "head_method=nonsense", f"head_dir={fx['eagle3']}", *fx["target"],
                               f"output_dir={tmp_path / 'eval'}", cwd=tmp_path), "evaluate")
    assert "head_method=nonsense" in line and "medusa1" in line and "read from head_dir" in line
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
@pytest.mark.parametrize("override", ["head_method=medusa1", None])
def test_evaluate_takes_train_method_names_and_reads_the_kind_from_the_folder(fx, tmp_path, override):
    out = tmp_path / "eval"
    proc = specheads("evaluate", *([override] if override else []), f"head_dir={fx['medusa']}", *fx["target"],
                     "eval=tiny", "temperatures=[0.0]", "batch_sizes=[1]", "baselines=[]", "serving.engines=[]",
                     f"output_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert [m["name"] for m in report["methods"]] == ["medusa-tree"]


# --------------------------------------------------------------------------- 3: a target that is nowhere


# real CLI runs for prepare and collect; train's and evaluate's CLI wiring is proven by their real runs below and
# above (the range test, the head folder test): each stage runs in process as well
@pytest.mark.parametrize("run, stage", [pytest.param(specheads, s, id=f"cli-{s}") for s in ("prepare", "collect")]
                         + [pytest.param(in_process, s, id=f"in_process-{s}")
                            for s in ("prepare", "collect", "train", "evaluate")])
def test_a_target_that_is_neither_a_folder_nor_a_hub_id_is_one_line_in_every_stage(fx, tmp_path, run, stage):
    extra = {"collect": [f"prepared_dir={fx['A']}", f"out_dir={tmp_path / 'out'}"],
             "train": [f"prepared_dir={fx['A']}", f"output_dir={tmp_path / 'out'}", *TRAIN_QUICK]}
    proc = run(stage, "target=hf", "target.name_or_path=/nonexistent/model", "target.device=cpu",
               *extra.get(stage, [f"output_dir={tmp_path / 'out'}"]), cwd=tmp_path)
    line = one_line(proc, stage)
    assert "target '/nonexistent/model': no such folder, and not a hub id" in line
    assert "set target.name_or_path to a local model folder" in line
    assert not (tmp_path / "out").exists()


def test_a_hub_id_outside_the_cache_while_offline_is_one_line(tmp_path):
    proc = specheads("prepare", "target=hf", "target.name_or_path=someorg/no-such-model",
                     f"output_dir={tmp_path / 'out'}", cwd=tmp_path, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    line = one_line(proc, "prepare")
    assert "'someorg/no-such-model'" in line and "not in the Hugging Face cache" in line and "HF_HUB_OFFLINE" in line


def test_a_folder_without_config_json_is_not_a_target(fx, tmp_path):
    """In process: prepare's CLI wiring is proven by the real runs of the tests above."""
    line = one_line(in_process("prepare", "target=hf", f"target.name_or_path={fx['root'] / 'A'}",
                               f"output_dir={tmp_path / 'out'}", cwd=tmp_path), "prepare")
    assert "holds no config.json, so it is not a model folder" in line


# --------------------------------------------------------------------------- 4: value ranges


RANGE_CASES = [
    ("optim.lr=-1", "optim.lr=-1.0 is out of range: give a finite number > 0"),
    ("optim.lr=inf", "optim.lr=inf is out of range: give a finite number > 0"),  # inf > 0 passed the old check
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 is out of range: give a finite number >= 0"),
    ("optim.warmup_steps=-5", "optim.warmup_steps=-5 is out of range"),
    ("train.max_steps=0", "train.max_steps=0 is out of range: give an integer >= 1"),
    ("data.batch_size=0", "data.batch_size=0 is out of range: give an integer >= 1 (or null)"),
    ("data.epochs=-1", "data.epochs=-1.0 is out of range: give a finite number > 0 (or null)"),
    ("method.num_heads=0", "method.num_heads=0 is out of range: give an integer >= 1"),
    ("train.resume=/no/such/step", "train.resume=/no/such/step: no such checkpoint folder"),
]
# A real CLI run for one value of the range checks (check_config) and for the resume check (check_resume): they
# prove the wiring (exit 2, one line, no traceback, no output folder); every value runs in process as well.
RANGE_CLI = ("optim.lr=inf", "train.resume=/no/such/step")


@pytest.mark.parametrize("run, override, message",
                         [pytest.param(specheads, o, m, id=f"cli-{o}") for o, m in RANGE_CASES if o in RANGE_CLI]
                         + [pytest.param(in_process, o, m, id=f"in_process-{o}") for o, m in RANGE_CASES])
def test_out_of_range_training_settings_are_one_line_before_work(fx, tmp_path, run, override, message):
    out = tmp_path / "train"
    line = one_line(run("train", "method=medusa1", *fx["target"], f"prepared_dir={fx['A']}",
                        f"output_dir={out}", *TRAIN_QUICK, override, cwd=tmp_path), "train")
    assert message in line
    assert not out.exists()


def test_a_float_count_of_a_method_without_a_schema_is_one_line_before_work(fx, tmp_path):
    """EAGLE-3's settings have no typed schema, so method.ttt_steps=2.5 reached range(ttt_steps) mid-training."""
    out = tmp_path / "train"  # in process: train's CLI wiring is proven by the real runs of the range test
    line = one_line(in_process("train", "method=eagle3", "method.draft_vocab_size=64", *fx["target"],
                               f"prepared_dir={fx['A']}", f"output_dir={out}", *TRAIN_QUICK, "method.ttt_steps=2.5",
                               cwd=tmp_path), "train")
    assert line.endswith("method.ttt_steps=2.5 is out of range: give an integer >= 1")
    assert not out.exists()


def load_train_recipe():
    from tests.training.test_train_recipe import load_recipe

    return load_recipe()


@pytest.mark.parametrize("method", sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml")))
@pytest.mark.parametrize("optim", ["adamw", "adamw_lowlr"])
def test_the_shipped_settings_pass_the_checks(method, optim):
    """Every method config shipped in conf/method/ (a new family's included) passes the range checks as shipped."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from specheads.training.config import check_settings

    recipe = load_train_recipe()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", [f"method={method}", f"optim={optim}"])
    tcfg, ocfg, mcfg = recipe.to_configs(cfg)
    check_settings(tcfg, ocfg, mcfg, OmegaConf.to_container(cfg.data, resolve=True))


@pytest.mark.parametrize("where, setting, bad", [
    ("optim", "eps", 0.0), ("optim", "min_lr_ratio", 1.5), ("optim", "betas", (0.9, 1.0)), ("optim", "schedule", "cos"),
    ("train", "grad_accum", 0), ("train", "max_grad_norm", 0.0), ("train", "eval_every", -1),
    ("train", "max_minutes", 0.0), ("train", "measure_k", 0), ("train", "measure_fans", (2, 0)),
    ("train", "mixed_precision", "fp8"), ("train", "wandb_mode", "loud"),
    ("data", "max_tokens", 0), ("data", "eval_samples", -1), ("data", "max_length", 1), ("data", "pad_to_multiple_of", 0),
    ("method", "ttt_steps", 0), ("method", "draft_vocab_size", 0), ("method", "block_size", 1),
    ("method", "lk_weight", 2.0), ("method", "lora_dropout", 1.0), ("method", "step_decay", -0.5),
    ("method", "num_heads", "five"),
])
def test_each_checked_setting_refuses_a_bad_value(where, setting, bad, tmp_path):
    from specheads.training.config import OptimConfig, TrainConfig, check_settings

    parts = {"train": TrainConfig(output_dir=str(tmp_path)), "optim": OptimConfig(), "method": {}, "data": {}}
    if where in ("train", "optim"):
        setattr(parts[where], setting, bad)
    else:
        parts[where][setting] = bad
    check_settings(TrainConfig(output_dir=str(tmp_path)), OptimConfig(), {}, {})  # the defaults pass
    with pytest.raises(ConfigError) as e:
        check_settings(parts["train"], parts["optim"], parts["method"], parts["data"])
    shown = {"wandb_mode": "wandb.mode"}.get(setting, f"{where}.{setting}")
    assert str(e.value).startswith(shown + "=")


# --------------------------------------------------------------------------- 5: a store collected from other data


def test_a_store_collected_from_another_prepared_set_is_one_line(fx, tmp_path):
    out = tmp_path / "train"  # in process (as in the tests below): train's CLI wiring is proven by the range test
    line = one_line(in_process("train", "method=eagle3", "method.draft_vocab_size=64", *fx["target"],
                               f"prepared_dir={fx['A']}", f"features_dir={fx['store_b']}", f"output_dir={out}",
                               *TRAIN_QUICK, cwd=tmp_path), "train")
    assert f"features_dir={fx['store_b']} was collected from other data than prepared_dir={fx['A']}" in line
    assert "30 of the store's samples missing there" in line
    assert f"pass prepared_dir={fx['B'].resolve()}" in line and f"specheads collect prepared_dir={fx['A']}" in line
    assert not out.exists()


def test_a_store_and_its_own_prepared_set_pass(fx):
    from specheads.data.store import StoreMismatchError
    from specheads.training.config import check_store_source

    check_store_source(str(fx["store_b"]), str(fx["B"]))
    check_store_source(str(fx["store_b"]), None)
    with pytest.raises(StoreMismatchError):
        check_store_source(str(fx["store_b"]), str(fx["A"]))


def test_a_features_dir_without_a_store_is_one_line(fx, tmp_path):
    line = one_line(in_process("train", "method=medusa1", *fx["target"], f"features_dir={fx['root'] / 'A'}",
                               f"output_dir={tmp_path / 'train'}", *TRAIN_QUICK, cwd=tmp_path), "train")
    assert f"features_dir={fx['root'] / 'A'}" in line and "specheads collect" in line


def test_a_store_for_a_method_that_trains_the_target_is_one_line_before_work(fx, tmp_path):
    out = tmp_path / "train"
    line = one_line(in_process("train", "method=medusa2", *fx["target"], f"features_dir={fx['store_b']}",
                               f"output_dir={out}", *TRAIN_QUICK, cwd=tmp_path), "train")
    assert "method medusa2 trains the target, so it needs online features: unset features_dir" in line
    assert not out.exists()


# --------------------------------------------------------------------------- 6: config group choices


@pytest.mark.parametrize("verb, group", [("train", "method"), ("train", "optim"), ("collect", "method"),
                                         ("prepare", "data"), ("prepare", "regenerate"), ("evaluate", "eval"),
                                         ("train", "target")])
def test_an_unknown_group_option_lists_only_the_real_ones(tmp_path, verb, group):
    line = one_line(specheads(verb, f"{group}=nonsense", cwd=tmp_path), verb)
    real = sorted(p.stem for p in (ROOT / "conf" / group).glob("*.yaml"))
    assert f"{group}=nonsense: no {group} named 'nonsense'; choose one of: {', '.join(real)} " in line
    assert "schema" not in line


# --------------------------------------------------------------------------- 7: export of a folder that is no head


def test_export_of_a_folder_that_is_no_head_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    line = one_line(specheads("export", f"head_dir={tmp_path / 'empty'}", f"output_dir={tmp_path / 'out'}",
                              cwd=tmp_path), "export")
    assert f"{tmp_path / 'empty'} holds no config.json: not a saved head folder" in line
    assert not (tmp_path / "out").exists()


def test_a_required_setting_left_out_is_one_line(tmp_path):
    """In process: export's CLI wiring is proven by the real run of the test above."""
    line = one_line(in_process("export", f"head_dir={tmp_path}", cwd=tmp_path), "export")
    assert "output_dir is required and has no default: give output_dir=..." in line


# --------------------------------------------------------------------------- 8: library log lines


@pytest.mark.slow
def test_checkpoint_saves_keep_accelerate_lines_off_the_console_unless_asked(fx, tmp_path):
    def run(*extra):
        out = tmp_path / f"train{len(extra)}"
        proc = specheads("train", "method=medusa1", "method.num_heads=2", *fx["target"], f"prepared_dir={fx['A']}",
                         f"output_dir={out}", *TRAIN_QUICK, "train.save_every=1", *extra, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    quiet = run()
    assert quiet.count("saved checkpoint") == 2  # specheads' own line per checkpoint stays
    assert "Saving current state" not in quiet and "Model weights saved" not in quiet and "[RANK 0]" not in quiet
    verbose = run("hydra.verbose=accelerate")
    assert verbose.count("Saving current state") == 2 and verbose.count("Model weights saved") == 2


# --------------------------------------------------------------------------- 9: one name for a stage's output folder


@pytest.mark.slow  # two CLI runs (collect, export) per spelling: ~20 s each on one thread
@pytest.mark.parametrize("spelling", ["output_dir", "out_dir"])
def test_collect_and_export_write_to_output_dir_and_the_former_out_dir_still_works_with_a_warning(fx, tmp_path,
                                                                                               spelling):
    """Every stage names its output folder output_dir=; collect's and export's former out_dir= still works and
    says, in one line, to use output_dir=."""
    store, export = tmp_path / "features", tmp_path / "export"
    runs = [specheads("collect", *fx["target"], "method=medusa1", "collect.dtype=float32", f"prepared_dir={fx['A']}",
                      f"{spelling}={store}", cwd=tmp_path),
            specheads("export", f"head_dir={fx['medusa'] / 'head'}", *fx["target"], "engine=medusa",
                      f"{spelling}={export}", cwd=tmp_path)]
    for stage, proc in zip(("collect", "export"), runs):
        assert proc.returncode == 0, proc.stderr[-3000:]
        warned = [line for line in proc.stderr.splitlines() if "deprecated" in line]
        assert warned == ([f"specheads {stage}: warning: out_dir= is deprecated; use output_dir= (it names the "
                           "same folder)"] if spelling == "out_dir" else [])
    assert (store / "manifest.json").is_file() and (export / "config.json").is_file()


# --------------------------------------------------------------------------- 10: train's folders, before its target


def _checkpoint(out: Path, settings: dict | None, corrupt: bool = False) -> None:
    """A checkpoint under out/checkpoints, as a run with ``settings`` wrote it (a tiny module: the refusals below
    come before any module is built)."""
    from accelerate import Accelerator

    from specheads.training.checkpoint import save_checkpoint

    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(torch.nn.Linear(2, 2), torch.optim.AdamW(torch.nn.Linear(1, 1).parameters()))
    folder = save_checkpoint(acc, out / "checkpoints", 2, {"settings": settings} if settings else {})
    if corrupt:
        victim = folder / "model.safetensors"
        victim.write_bytes(victim.read_bytes()[:-10])


FOLDER_CASES = ["other_settings", "corrupt_checkpoint", "output_in_a_file", "no_prepared_dir",
                "store_of_another_target"]


@pytest.mark.parametrize("run, case", [pytest.param(specheads, "other_settings", id="cli-other_settings")]
                         + [pytest.param(in_process, c, id=f"in_process-{c}") for c in FOLDER_CASES])
def test_train_refuses_its_folders_in_one_line_before_the_target_loads(fx, tmp_path, monkeypatch, run, case):
    """One real CLI run proves the wiring; every case runs in process too, where the precision probe and the
    target's load are replaced by ones that fail the test if they are reached."""
    out, extra = tmp_path / "train", [f"prepared_dir={fx['A']}"]
    if case == "other_settings":
        _checkpoint(out, {"method": {"name": "medusa1", "num_heads": 2}})
    elif case == "corrupt_checkpoint":
        _checkpoint(out, None, corrupt=True)
    elif case == "output_in_a_file":
        (tmp_path / "a_file").write_text("x")
        out = tmp_path / "a_file" / "train"
    elif case == "no_prepared_dir":
        extra = [f"prepared_dir={tmp_path / 'nonexistent'}"]
    else:
        from specheads.data.store import MANIFEST, STORE_FORMAT

        store = tmp_path / "store"
        store.mkdir()
        (store / MANIFEST).write_text(json.dumps({"format": STORE_FORMAT, "target": "/models/other", "hidden_size": 32,
                                                  "num_layers": 2, "shards": []}))
        extra = [f"features_dir={store}"]
    before = sorted(p.name for p in out.rglob("*")) if out.is_dir() else None
    if run is in_process:
        import importlib

        from specheads import targets as target_lib

        def reached(*args, **kwargs):
            raise AssertionError("the refusal came after the precision probe or the target's load")

        monkeypatch.setattr(importlib.import_module("specheads.recipes.train"), "training_precision", reached)
        monkeypatch.setattr(target_lib, "load_target", reached)
    proc = run("train", "method=medusa1", "method.num_heads=3", *fx["target"], *extra, f"output_dir={out}",
               *TRAIN_QUICK, cwd=tmp_path)
    line = one_line(proc, "train")
    assert "training precision" not in proc.stdout  # refused before the precision probe and the target's load
    assert (sorted(p.name for p in out.rglob("*")) if out.is_dir() else None) == before  # nothing written or removed
    want = {"other_settings": [f"output_dir={out}: checkpoint step_0000002 was written by a run with other settings "
                               "(method.num_heads=2 there, 3 now)", "give a new output_dir, or train.resume=never"],
            "corrupt_checkpoint": ["corrupt checkpoint", "model.safetensors has", "no earlier checkpoint",
                                   "train.resume=never"],
            "output_in_a_file": [f"output_dir={out} is inside {tmp_path / 'a_file'}, which is a file"],
            "no_prepared_dir": [f"prepared_dir={tmp_path / 'nonexistent'}: no such folder", "specheads prepare"],
            "store_of_another_target": ["collected from target '/models/other' (hidden size 32, 2 layers), not from "
                                        f"target.name_or_path={fx['model']} (hidden size 64, 4 layers)",
                                        "specheads collect"]}[case]
    for part in want:
        assert part in line
