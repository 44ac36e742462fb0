"""serve-eval of a head for a vision-language target with an engine whose python lacks torchvision (vLLM's Qwen-VL
model classes import it; scripts/setup_engine.sh leaves it out): one line saying what is missing, why and what to do,
before any engine starts, recorded as a refusal in the serve report; a text target is not refused by that check, and
an engine process started elsewhere (collection, regeneration) does not make it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specheads import engine_process as ep
from specheads.engine_process import Engine

ROOT = Path(__file__).resolve().parents[2]
FAKE_WORKER = Path(__file__).with_name("fake_engine_worker.py")


def engine_python(root: Path, torchvision: bool) -> Path:
    """A stand-in for the engine venv's python: the version probe says vLLM 0.32.0, the torchvision probe runs
    this python with a ``torchvision`` that imports (or one that fails as a missing module does), an engine run
    runs the stand-in worker."""
    shim = root / f"shim_{torchvision}"
    (shim / "torchvision").mkdir(parents=True)
    (shim / "torchvision" / "__init__.py").write_text(
        "" if torchvision else "raise ModuleNotFoundError(\"No module named 'torchvision'\")\n")
    script = root / f"python_{torchvision}.sh"
    script.write_text(f"""#!/usr/bin/env bash
case "$2" in *torchvision*) PYTHONPATH={shim} exec {sys.executable} "$@";; esac
if [ "$1" = "-c" ]; then echo "0.32.0"; exit 0; fi
exec {sys.executable} {FAKE_WORKER} "${{@:2}}"
""")
    script.chmod(0o755)
    return script


@pytest.fixture(scope="module")
def vl_export(tmp_path_factory):
    """A tiny Qwen3-VL target folder and an EAGLE-3 head for it exported in vLLM's layout."""
    from specheads.export import export_head
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model
    from specheads.models.vocab import build_draft_vocab
    from specheads.targets import Target
    from tests.data.vision_targets import make_vision_model, save_vision_target, vision_tokenizer

    root = tmp_path_factory.mktemp("vl")
    folder = save_vision_target(root / "target", "qwen3_vl")
    torch.manual_seed(0)
    target = Target(make_vision_model("qwen3_vl", 0, vision_tokenizer()), name=str(folder))
    draft = Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=64, aux_layers=(0, 1, 2)))
    draft.set_draft_vocab(*build_draft_vocab(torch.randint(0, 1000, (target.vocab_size,)), 64))
    draft.save_pretrained(root / "head")
    return folder, export_head(root / "head", root / "export", "vllm", str(folder))


def test_a_vision_target_is_refused_to_an_engine_without_torchvision(vl_export, tmp_path):
    from specheads.recipes.serve_eval import vision_refusal

    folder, _ = vl_export
    lacking = Engine(str(engine_python(tmp_path, torchvision=False)), "0.32.0", "vllm.python")
    line = vision_refusal(lacking, folder)
    assert line and "\n" not in line
    assert "vision-language" in line and "No module named 'torchvision'" in line
    assert "torchvision==" in line and "whl/cpu" in line and "specheads evaluate" in line
    having = Engine(str(engine_python(tmp_path, torchvision=True)), "0.32.0", "vllm.python")
    assert vision_refusal(having, folder) is None


def test_an_engine_process_for_a_vision_target_does_not_make_serve_evals_check(vl_export, tmp_path, monkeypatch):
    """Collection and regeneration start an EngineProcess too: the process starts (here the stand-in worker) with
    no torchvision probe and none of serve-eval's refusal, which is serve-eval's alone."""
    folder, _ = vl_export
    asked, probe = [], ep.torchvision_missing
    monkeypatch.setattr(ep, "torchvision_missing", lambda python: asked.append(python) or probe(python))
    lacking = Engine(str(engine_python(tmp_path, torchvision=False)), "0.32.0", "vllm.python")
    with ep.EngineProcess(lacking, {"model": str(folder)}, tmp_path / "logs" / "engine.log", {}, 60) as process:
        assert process.version == "0.32.0"
    assert not asked
    assert "fake engine log: loading" in (tmp_path / "logs" / "engine.log").read_text()


def test_a_text_target_is_not_refused_by_the_check(tmp_path, monkeypatch):
    from specheads.recipes.serve_eval import vision_refusal

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                               "model_type": "llama"}))
    asked = []
    monkeypatch.setattr(ep, "torchvision_missing", lambda python: asked.append(python) or ("ModuleNotFoundError", None))
    lacking = Engine(str(engine_python(tmp_path, torchvision=False)), "0.32.0", "vllm.python")
    assert vision_refusal(lacking, tmp_path / "text") is None and not asked  # the engine is not even asked
    assert vision_refusal(lacking, "HuggingFaceTB/SmolLM2-135M") is None  # a hub id: the engine speaks for itself


@pytest.mark.slow
def test_serve_eval_says_it_in_one_line_and_records_the_refusal(vl_export, tmp_path):
    folder, export = vl_export
    env = {k: v for k, v in os.environ.items() if k not in ("SPECHEADS_TRACEBACK", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "specheads.cli", "serve-eval", "eval=tiny", "eval.humaneval=0",
                           "eval.mtbench_per_category=1", f"target.name_or_path={folder}", f"export_dir={export}",
                           f"vllm.python={engine_python(tmp_path, torchvision=False)}", "plain=false",
                           f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("specheads serve-eval: error:")]
    assert len(errors) == 1 and "cannot import torchvision" in errors[0], proc.stderr[-3000:]
    kept = json.loads((tmp_path / "out" / "serve_report.json").read_text())  # recorded as the engine's refusals are
    assert "cannot import torchvision" in kept["refused"] and kept["method"] == "eagle3"
    assert not (tmp_path / "out" / "engine_spec.log").exists()  # no engine started
