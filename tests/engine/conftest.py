"""The engine tier: a head trained here, served by the real vLLM CPU build (``bash scripts/engine_tests.sh``).

Skipped unless asked for (``-m engine`` or ``SPECHEADS_ENGINE_TESTS=1``) and an engine is found
(``bash scripts/setup_engine.sh``). The EAGLE-3 head served: ``SPECHEADS_ENGINE_HEAD=<train output_dir or head
folder>``, else the quickstart's (``runs/quickstart/train/eagle3``), else one trained here for
``SPECHEADS_ENGINE_TRAIN_MINUTES`` (15) minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Online training on 2 shared cores makes few steps (3 in 5 minutes, batches of 4096 tokens, one thread per xdist
# worker): give a head (SPECHEADS_ENGINE_HEAD, or the quickstart's) for a head that accepts enough to compare.
TRAIN_MINUTES = float(os.environ.get("SPECHEADS_ENGINE_TRAIN_MINUTES", "15"))


# CI sets SPECHEADS_ENGINE_CI=1 (.ci/run installs the engine first): its real-engine test must then run, not skip
CI_ENV = "SPECHEADS_ENGINE_CI"


def pytest_configure(config):
    config.addinivalue_line("markers", "engine_ci: CI's real-engine test: runs wherever an engine is installed, "
                                       f"fails instead of skipping without one when {CI_ENV}=1")


def _engine():
    from specheads.serving.engine import EngineNotFoundError, find_engine

    try:
        return find_engine(os.environ.get("SPECHEADS_ENGINE_PYTHON"))
    except EngineNotFoundError as e:
        if os.environ.get(CI_ENV) == "1":
            pytest.fail(f"{CI_ENV}=1 but {e}")
        pytest.skip(str(e))


def pytest_runtest_setup(item):
    """Decided before any fixture is built (a session fixture trains a head for minutes): the engine tier (marker
    ``engine``) runs when asked for and an engine is installed; CI's real-engine test (marker ``engine_ci``)
    wherever an engine is installed, and must find one under SPECHEADS_ENGINE_CI=1."""
    if item.get_closest_marker("engine_ci"):
        _engine()
        return
    asked = os.environ.get("SPECHEADS_ENGINE_TESTS") == "1" or "engine" in (item.config.getoption("-m") or "")
    if not asked:
        pytest.skip("the engine tier runs with -m engine or SPECHEADS_ENGINE_TESTS=1 (scripts/engine_tests.sh)")
    _engine()


def specheads(*args: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "specheads.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"specheads {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="session")
def trained_head(work) -> Path:
    """An EAGLE-3 head on the embedded SmolLM2: ``SPECHEADS_ENGINE_HEAD``, or trained online for a few minutes."""
    given = os.environ.get("SPECHEADS_ENGINE_HEAD")
    if given:
        return Path(given).resolve()
    quickstart = ROOT / "runs" / "quickstart" / "train" / "eagle3"
    if (quickstart / "head" / "config.json").is_file():
        return quickstart
    specheads("prepare", "data.num_samples=400", f"output_dir={work / 'prepared'}", cwd=work)
    specheads("train", "method=eagle3", f"prepared_dir={work / 'prepared'}", f"output_dir={work / 'train'}",
              "data.max_tokens=1024",
              f"train.max_minutes={TRAIN_MINUTES}", "train.max_steps=100000", "train.eval_every=0",
              "train.save_every=0", "train.measure_prompts=0", "train.progress=false", "data.eval_samples=0", cwd=work)
    return work / "train"


@pytest.fixture(scope="session")
def exported(trained_head, work) -> Path:
    specheads("export", f"head_dir={trained_head}", f"output_dir={work / 'export'}", "engine=vllm", "eval_report=null",
              cwd=work)
    return work / "export"


def shuffle_weights(export: Path, out: Path, seed: int = 0) -> Path:
    """A copy of the layout folder ``export`` at ``out`` with every floating weight tensor's values permuted (a
    planted broken head: same shapes, same draft vocabulary, it loads and serves, its drafts are noise)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(export, out)
    tensors = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if t.is_floating_point():
            flat = t.flatten()
            tensors[name] = flat[torch.randperm(flat.numel(), generator=g)].reshape(t.shape).contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def evaluator_comparison(report: dict) -> dict:
    """A serve report's comparison with the evaluator over all its prompts (serve-eval given ``eval_report=``:
    ``serve_eval.compare``, τ and the acceptance at each position, engine beside evaluator, each difference
    flagged beyond 3 standard errors of the difference, the errors from each side's counts)."""
    assert report["evaluator"].get("method"), report["evaluator"]
    return report["evaluator"]["domains"]["all"]


def assert_accepts_as_evaluated(row: dict) -> None:
    """No position's acceptance, nor τ, differs from the evaluator's beyond the comparison's noise."""
    for p in row["positions"]:
        assert not p["flagged"], row
    assert not row["tau_flagged"], row


@pytest.fixture(scope="session")
def shuffled(exported, work) -> Path:
    """The same export with every weight tensor's values shuffled (``shuffle_weights``)."""
    return shuffle_weights(exported, work / "export-shuffled")


@pytest.fixture(scope="session")
def eval_report(trained_head, work) -> Path:
    """The evaluator's own measurement of the head's chain of 3 (vLLM's profile) on the tiny prompt set."""
    specheads("evaluate", f"head_dir={trained_head}", "eval=tiny", "eval.max_new_tokens=32", "baselines=[]",
              "temperatures=[0.0]", "batch_sizes=[1]", "serving.engines=[vllm]", "serving.vllm_num_speculative_tokens=3",
              "tree.depth=2", "tree.topk=2", "tree.total_tokens=4", f"output_dir={work / 'eval'}", cwd=work)
    return work / "eval" / "report.json"


def serve_eval(work: Path, export: Path, name: str, *extra: str) -> dict:
    specheads("serve-eval", f"export_dir={export}", "eval=tiny", "eval.max_new_tokens=32", "num_speculative_tokens=3",
              f"output_dir={work / name}", *extra, cwd=work)
    return json.loads((work / name / "serve_report.json").read_text())
