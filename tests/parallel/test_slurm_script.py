"""scripts/slurm_train.sh under a stand-in Slurm (srun runs the task once per node id, scontrol names
the nodes) and `echo` for the launcher: the commands each node would run."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest

from parallel_helpers import REPO

FAKE_SRUN = """#!/usr/bin/env bash
# srun --opt=value ... CMD ARGS: CMD once per node (SLURM_NODEID 0..n-1), n from --nodes=n.
n=1
while [[ "$1" == --* ]]; do
  case "$1" in --nodes=*) n=${1#--nodes=} ;; esac
  shift
done
for ((id = 0; id < n; id++)); do SLURM_NODEID=$id "$@" || exit 1; done
"""


@pytest.fixture
def slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nprintf "gpu-node-7\\ngpu-node-8\\n"\n')
    for name in ("LAUNCH", "PYTHON"):  # stand-ins for the venv's accelerate and python: print the command
        (bin_dir / f"fake-{name.lower()}").write_text(f'#!/usr/bin/env bash\necho {name} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)

    def run(*args: str, **env: str) -> list[list[str]]:
        environ = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_NNODES": "2",
                   "SLURM_JOB_NODELIST": "gpu-node-[7-8]", "SLURM_SUBMIT_DIR": str(REPO),
                   "ACCELERATE": str(bin_dir / "fake-launch"), "PYTHON": str(bin_dir / "fake-python"), "GPUS_PER_NODE": "4", **env}
        proc = subprocess.run(["bash", "scripts/slurm_train.sh", *args], cwd=REPO, env=environ,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [shlex.split(line) for line in proc.stdout.splitlines()]

    return run


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_one_launcher_per_node_for_collection_then_training(slurm, tmp_path):
    lines = slurm("/models/m", str(tmp_path / "run"), "train.max_steps=50")
    prepare = [c for c in lines if c[0] == "PYTHON"]
    assert prepare == [["PYTHON", "recipes/prepare_data.py", "target=hf", "target.name_or_path=/models/m",
                        f"output_dir={tmp_path / 'run' / 'prepared'}"]]
    launches = [c for c in lines if c[0] == "LAUNCH"]
    assert len(launches) == 4
    collect, train = launches[:2], launches[2:]
    for stage, port, script in ((collect, "29500", "recipes/collect_hidden_states.py"), (train, "29501", "recipes/train.py")):
        assert [option(c, "--machine_rank") for c in stage] == ["0", "1"]
        for c in stage:
            assert c[1] == "launch" and option(c, "--config_file") == "conf/launcher/accelerate.yaml"
            assert option(c, "--num_machines") == "2" and option(c, "--num_processes") == "8"
            assert option(c, "--main_process_ip") == "gpu-node-7" and option(c, "--main_process_port") == port
            assert script in c and "target.name_or_path=/models/m" in c and "method=eagle3" in c
    assert "target.parallel=tp" in collect[0] and f"output_dir={tmp_path / 'run' / 'features'}" in collect[0]
    assert train[0][-1] == "train.max_steps=50" and f"features_dir={tmp_path / 'run' / 'features'}" in train[0]


def test_device_map_collects_with_one_process_per_node(slurm, tmp_path):
    (tmp_path / "run" / "prepared").mkdir(parents=True)
    (tmp_path / "run" / "prepared" / "specheads_meta.json").write_text("{}")
    lines = slurm("/models/m", str(tmp_path / "run"), TARGET_PARALLEL="device_map", METHOD="medusa1")
    assert [c[0] for c in lines] == ["LAUNCH"] * 4  # the prepared set exists: no prepare step
    assert [option(c, "--num_processes") for c in lines] == ["2", "2", "8", "8"]
    assert "target.parallel=device_map" in lines[0] and "method=medusa1" in lines[3]
