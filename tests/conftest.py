"""Shared fixtures: tiny random targets (seconds) and the real SmolLM2 (converted once, cached)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path as _Path

# Without a GPU, Triton kernels run in its CPU interpreter. The switch is read when triton is first
# imported, which any earlier test (or library) may do, so it is set here, before everything else.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# Under pytest-xdist (pyproject's addopts) each worker takes one core: one thread here and in what it launches.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# Tests that launch processes (torchrun, DeepSpeed, servers) or bind fixed ports run in one worker, one after
# another: the scheduler below puts them in one work unit. pytest-xdist 3.8's own `--dist loadgroup` reads the
# group from an "@group" suffix it writes into the item's `_nodeid`, which pytest 9.2 no longer reads (the node id
# is built from `item.id`), so grouping by the `xdist_group` marker alone groups nothing (docs/development.md).
PROCESS_GROUP = "processes"
PROCESS_DIRS = ("distributed", "parallel", "serving", "engine")
PROCESS_FILES = ("test_collect_recipe.py", "test_engine.py", "test_endpoint.py", "test_regenerate.py",
                 "test_train_recipe.py", "test_packaging.py")


def process_group(nodeid: str) -> str | None:
    """``PROCESS_GROUP`` for a test that launches processes (by its file or folder), else None. Reads only the
    node id (``tests/distributed/test_resume.py::test_x[...]``), which is all xdist's controller sees."""
    path = _Path(nodeid.split("::")[0])
    if path.name in PROCESS_FILES or any(part in PROCESS_DIRS for part in path.parts[-3:-1]):
        return PROCESS_GROUP
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if process_group(item.nodeid):  # for the record (and for an xdist that reads it again)
            item.add_marker(pytest.mark.xdist_group(PROCESS_GROUP))


@pytest.hookimpl(optionalhook=True)  # known only while xdist is loaded
def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadgroup``: xdist's LoadGroupScheduling, whose work unit (a "scope": all its tests run on
    one worker, in order) is ``process_group``'s group where there is one. A documented xdist hook, called in the
    controller, so the grouping holds whatever pytest does with node ids."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ProcessGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return process_group(nodeid) or super()._split_scope(nodeid)

    return ProcessGroupScheduling(config, log)


from specheads.targets import Target


def load_script(relpath: str, name: str | None = None):
    """A script of the repository (``scripts/bench/bench_train.py``, ...) as a module, for its functions."""
    import importlib.util

    path = _Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tiny_model(family: str = "llama", vocab: int = 256, hidden: int = 64, layers: int = 4,
                    heads: int = 4, kv_heads: int = 2, seed: int = 0, dtype=torch.float32):
    """A randomly initialised causal LM of the given family, small enough for unit tests."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=512, tie_word_embeddings=False)
    if family in ("qwen3", "gemma"):
        kwargs["head_dim"] = hidden // heads
    config = AutoConfig.for_model(family, **kwargs)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def make_tiny_target(family: str = "llama", **kw) -> Target:
    return Target(make_tiny_model(family, **kw), tokenizer=None, name=f"tiny-{family}")


@pytest.fixture
def tiny_target() -> Target:
    return make_tiny_target("llama")


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """The real embedded target (float32, CPU). First use converts the GGUF (~40 s), then cached."""
    from specheads.targets import load_target

    return load_target("smollm2")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from specheads.targets import load_tokenizer

    return load_tokenizer("smollm2")


# --------------------------------------------------------------------------- support log (docs/support_matrix.md)
# A test that takes the ``support`` fixture and names what it covers (``support(family, stage)``) logs its
# outcome when SPECHEADS_SUPPORT_LOG is set (tests/families/support_log.py; scripts/support_matrix.py); without it,
# a passing one fails unless the doc's cell for its (family, stage) shows that outcome.
import sys as _sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

_sys.path.insert(0, str(_Path(__file__).resolve().parent / "families"))
from support_log import ENV as _SUPPORT_LOG, SupportRecord, doc_disagreement, write_line  # noqa: E402


@pytest.fixture
def support(request) -> SupportRecord:
    record = SupportRecord()
    record.family = getattr(getattr(request.node, "callspec", None), "params", {}).get("family")
    request.node._support_record = record
    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    record = getattr(item, "_support_record", None)
    if record is None or record.family is None or record.stage is None or report.skipped:
        return
    if report.when == "call" or (report.when == "setup" and report.failed):
        write_line(record, report.passed, item.nodeid)
        if report.passed and not os.environ.get(_SUPPORT_LOG):  # rendering: the doc is about to be rewritten
            wrong = doc_disagreement(record)
            if wrong:
                report.outcome, report.longrepr = "failed", wrong
