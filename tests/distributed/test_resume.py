"""SIGKILL of one rank mid-run, then the same command: every rank resumes and reaches the losses (and
head) of the uninterrupted run.

    SPECHEADS_TEST_SLEEP=0.3 accelerate launch --config_file conf/launcher/cpu_ddp.yaml --num_processes 2 \\
        tests/distributed/train_entry.py method=medusa1 ...        # killed: rank 1 gets SIGKILL after step 2's checkpoint
    (the same command again)                                       # resumes from the last complete checkpoint

``train_entry.py`` is ``recipes/train.py`` plus a sleep per micro-batch (numbers unchanged), so that the
kill lands inside a step. The uninterrupted reference is the plain recipe launch of ``ddp_medusa1``.
When rank 1 dies the launcher (torchrun's agent) stops rank 0, so the whole job ends as on a cluster.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dist_launch import (ENTRY, EQUIV_ARGS, EQUIV_STEPS, LAUNCH_TIMEOUT, Run, accelerate_cmd, launch_env, run_cmd,
                         train_args)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(1800)]


def _worker_pid(tag: str, rank: int) -> int | None:
    """PID of the training process of ``rank`` in the launch tagged ``tag`` (read from /proc environ)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except OSError:
            continue
        if env.get("SPECHEADS_TEST_RUN") == tag and env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
            return int(d.name)
    return None


@pytest.fixture(scope="module")
def killed_then_resumed(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    out = root / "run"
    tag = f"resume-{os.getpid()}-{time.time_ns()}"
    env = launch_env(SPECHEADS_TEST_SLEEP="0.3", SPECHEADS_TEST_RUN=tag)
    cmd = accelerate_cmd("cpu_ddp.yaml", 2, ENTRY, train_args(assets, out, "medusa1", *EQUIV_ARGS))
    log = (root / "killed.log").open("w")
    victim = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    ckpt = out / "checkpoints" / "step_0000002" / "manifest.json"
    deadline = time.time() + LAUNCH_TIMEOUT
    while not ckpt.exists():
        assert victim.poll() is None, (root / "killed.log").read_text()[-4000:]
        assert time.time() < deadline, "no checkpoint at step 2 in time"
        time.sleep(0.05)
    time.sleep(0.4)  # inside step 3 (each step sleeps 2 x 0.3 s)
    pid = _worker_pid(tag, 1)
    assert pid is not None, "rank 1's process not found"
    os.kill(pid, signal.SIGKILL)
    killed_rc = victim.wait(timeout=300)
    log.close()
    killed_log = (root / "killed.log").read_text()
    killed_losses = Run(out, cmd, killed_rc, killed_log, 0).losses()
    resumed = run_cmd(cmd, out, env)  # the same command
    return killed_rc, killed_log, killed_losses, resumed


def test_the_killed_run_stopped_mid_run(killed_then_resumed):
    killed_rc, killed_log, killed_losses, resumed = killed_then_resumed
    assert killed_rc != 0, killed_log[-3000:]
    assert "Signal 9 (SIGKILL)" in killed_log or "exitcode  : -9" in killed_log, killed_log[-3000:]
    assert 2 <= max(killed_losses) < EQUIV_STEPS, killed_losses


def test_same_command_resumes_every_rank_to_the_uninterrupted_losses(killed_then_resumed, ddp_medusa1):
    killed_rc, killed_log, killed_losses, resumed = killed_then_resumed
    resumed.check()
    s = resumed.summary
    assert s["num_processes"] == 2 and s["steps"] == EQUIV_STEPS
    assert s["resumed_from"] and Path(s["resumed_from"]).name.startswith("step_")
    assert resumed.log.count("resumed from") == 2, resumed.log[-3000:]  # both ranks loaded the checkpoint
    want = ddp_medusa1.check().losses()
    assert resumed.losses() == want  # every step, floats compared exactly
    ref_head, got_head = ddp_medusa1.head_state(), resumed.head_state()
    assert ref_head.keys() == got_head.keys()
    for k in ref_head:
        assert bool((ref_head[k] == got_head[k]).all()), k


def test_a_ddp_checkpoint_without_the_frozen_target_resumes_to_the_uninterrupted_losses(assets, tmp_path):
    """Medusa-2 under LoRA, 2 processes: the checkpoint holds the adapters and heads, not the frozen target, and a
    run resumed from it (every rank rebuilds the target, then loads) takes the uninterrupted run's steps 3-6."""
    from safetensors import safe_open

    from dist_launch import launch

    ref = launch("cpu_ddp.yaml", tmp_path / "ref", train_args(assets, tmp_path / "ref", "medusa2", *EQUIV_ARGS)).check()
    ckpt = tmp_path / "ref" / "checkpoints" / "step_0000002"
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        held = list(f.keys())
    assert held and all("lora_" in k or ".heads." in k for k in held), held
    assert (ckpt / "frozen.json").is_file()
    out = tmp_path / "resumed"
    resumed = launch("cpu_ddp.yaml", out, train_args(assets, out, "medusa2", *EQUIV_ARGS, f"train.resume={ckpt}")).check()
    assert resumed.log.count("resumed from") == 2, resumed.log[-3000:]
    want = {s: v for s, v in ref.losses().items() if s > 2}
    assert resumed.losses() == want  # floats compared exactly
