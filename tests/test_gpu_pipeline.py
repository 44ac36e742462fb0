"""scripts/gpu_pipeline.py: what it carries to the GPU machine, how it repacks wheels, and (``gpu``) the devices
each stage's own loading code puts the target, the heads and the trained module on.

The ``gpu`` tests read the target and heads a ``scripts/gpu_pipeline.sh`` run made (``SPECHEADS_GPU_PIPELINE_WORK``,
set by the script) and skip without CUDA or outside that run.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
gp = load_script("scripts/gpu_pipeline.py", "gpu_pipeline")


def requirement_names(dist: str) -> set[str]:
    """The distributions ``dist`` requires here (markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    out = set()
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.add(gp.canonical(req.name))
    return out


def closure(roots) -> set[str]:
    seen, todo = set(), [gp.canonical(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += requirement_names(name)
        except md.PackageNotFoundError:
            pass
    return seen


def test_every_dependency_is_carried_on_the_gpu_machine_or_left_out_with_a_reason():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {gp.canonical(re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0]) for d in deps}
    decided = set(map(gp.canonical, gp.CARRY)) | set(gp.ON_THE_GPU_MACHINE) | set(gp.NOT_CARRIED)
    assert names <= decided, f"pyproject dependencies with no decision in gpu_pipeline.py: {sorted(names - decided)}"
    assert set(gp.NOT_CARRIED) <= names, "NOT_CARRIED names a distribution pyproject no longer needs"


def test_carried_distributions_bring_everything_they_require():
    """What a carried distribution requires (as installed in this venv, the versions gpu_wheels.sh downloads) is
    carried too, or comes with torch, transformers or pytest (what the GPU machine has)."""
    machine = closure(("torch", "transformers", "pytest"))
    carried = set(map(gp.canonical, gp.CARRY))
    for dist in gp.CARRY:
        missing = requirement_names(dist) - carried - machine
        assert not missing, f"{dist} requires {sorted(missing)}: neither carried nor on the GPU machine"


def test_repack_drops_the_trimmed_files_stores_the_rest_and_keeps_record_true(tmp_path):
    wheel = tmp_path / "pyarrow-1.0-cp311-cp311-linux_x86_64.whl"
    files = {"pyarrow/lib.py": b"x = 1\n", "pyarrow/tests/test_a.py": b"assert 1\n",
             "pyarrow/libarrow_flight.so.1": b"\0" * 100, "pyarrow/include/a.h": b"int a;\n"}
    record = "".join(f"{n},sha256=x,{len(b)}\n" for n, b in files.items()) + "pyarrow-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr("pyarrow-1.0.dist-info/RECORD", record)
    out = tmp_path / "out" / wheel.name
    out.parent.mkdir()
    assert gp.repack(wheel, out) == (3, 100 + 9 + 7)
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == ["pyarrow-1.0.dist-info/RECORD", "pyarrow/lib.py"]
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.read("pyarrow-1.0.dist-info/RECORD").decode().splitlines() == [
            "pyarrow/lib.py,sha256=x,6", "pyarrow-1.0.dist-info/RECORD,,"]


# ------------------------------------------------------------------ on the GPU, inside a gpu_pipeline.sh run

WORK = os.environ.get("SPECHEADS_GPU_PIPELINE_WORK")


def on_the_gpu(test):
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
                 pytest.mark.skipif(not WORK, reason="reads a scripts/gpu_pipeline.sh run's target and heads")):
        test = mark(test)
    return test


def off_cuda(module: torch.nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``module`` that are not on a CUDA device."""
    return [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.device.type != "cuda"]


@pytest.fixture(scope="module")
def target():
    from specheads.targets import load_target

    return load_target(str(Path(WORK) / "target"), "auto", "auto")  # as collect and evaluate load it


@on_the_gpu
def test_the_target_loads_whole_on_the_gpu_in_bfloat16(target):
    assert target.device.type == "cuda" and target.dtype == torch.bfloat16
    assert not off_cuda(target.model)


@on_the_gpu
def test_the_evaluator_puts_the_trained_eagle3_head_on_the_gpu(target):
    from specheads.decoding.drafters import TreeShape
    from specheads.evaluation.suite import MethodSpec, build_drafter

    head = Path(WORK) / "train" / "eagle3" / "head"
    drafter = build_drafter(MethodSpec("eagle3", "eagle3", TreeShape(), head_dir=str(head)), target)
    assert not off_cuda(drafter.model)


@on_the_gpu
def test_the_trained_module_is_on_the_gpu_after_the_accelerator_prepares_it(target, tmp_path):
    from specheads.methods import build_method
    from specheads.methods.base import TrainingModule
    from specheads.training.accelerator import make_accelerator, make_optimizer
    from specheads.training.config import OptimConfig, TrainConfig

    method = build_method("dflash", block_size=4, anchors=4)
    acc = make_accelerator(TrainConfig(output_dir=str(tmp_path), mixed_precision="auto"), method)
    assert acc.device.type == "cuda" and acc.mixed_precision == "bf16"
    model = TrainingModule(method, method.build(target), target)
    model, _ = acc.prepare(model, make_optimizer(model, OptimConfig()))
    assert not off_cuda(model)


def test_a_stage_that_ran_on_the_cpu_of_a_gpu_machine_is_caught(tmp_path):
    """The records of a run that fell back to the CPU (the summary's devices, the machine, fp32) fail the check when
    the GPU was asked for, and pass it when the CPU was (the smoke run)."""
    import json

    summary = {"steps": 3, "num_processes": 1, "final_loss": 1.0, "precision": {"mixed_precision": "no"},
               "device": {"accelerator": "cpu", "target": "cpu", "distributed_type": "NO", "machine": "Some CPU"}}
    (tmp_path / "train_summary.json").write_text(json.dumps(summary))
    pipe = object.__new__(gp.Pipeline)
    pipe.device, pipe.machine, pipe.bf16 = "cuda", "NVIDIA H200", True
    wrong, _ = pipe.train_evidence(tmp_path)
    assert len(wrong) == 4 and any("accelerator device is 'cpu'" in w for w in wrong), wrong
    pipe.device, pipe.machine, pipe.bf16 = "cpu", "Some CPU", False
    assert pipe.train_evidence(tmp_path)[0] == []
    assert pipe.train_evidence(tmp_path, distributed="DEEPSPEED")[0] == ["distributed_type is 'NO', expected 'DEEPSPEED'"]
