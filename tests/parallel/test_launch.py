"""Collection and training under `accelerate launch` on CPU: 2 processes on one node, and 2 nodes of one
process each on 127.0.0.1 (static rendezvous, what a cluster runs), against one process.

The store must be the one-process store byte for byte (same shard plan, same SHA-256s), and training
on it from two nodes must log the losses one node with two processes logs.
"""

from __future__ import annotations

import json
import re

import pytest

from specheads.data.features import CollectOptions, collect_hidden_states, spec_for_method
from specheads.data.prepare import load_prepared
from specheads.targets import load_target
from specheads.training.run_log import read_losses

from parallel_helpers import ACCELERATE, CPU_LAUNCH_CONFIG, free_port, prepared_dir, run, shard_digests, start, \
    tiny_model_dir, wait_all

pytestmark = pytest.mark.slow

COLLECT = ["collect.shard_bytes=20000", "collect.batch_tokens=64", "method=eagle3"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root, model folder, prepared folder, launcher config, the one-process store)."""
    root = tmp_path_factory.mktemp("launch")
    model = tiny_model_dir(root)
    prepared = prepared_dir(root, model, n=40)
    config = root / "cpu_launch.yaml"
    config.write_text(CPU_LAUNCH_CONFIG)
    target = load_target(str(model))  # one process, the library call the recipe makes (same options)
    rows, _ = load_prepared(prepared)
    opts = CollectOptions(shard_bytes=20000, batch_tokens=64, estimate_time=False)
    collect_hidden_states(target, rows, spec_for_method("eagle3", target.num_layers), root / "one", opts)
    return root, model, prepared, config, root / "one"


def target_args(model, prepared) -> list[str]:
    return [f"target.name_or_path={model}", "target.dtype=float32", "target.device=cpu", f"prepared_dir={prepared}"]


def assert_same_store(store, reference) -> None:
    got, want = json.loads((store / "manifest.json").read_text()), json.loads((reference / "manifest.json").read_text())
    assert got["num_shards"] > 2 and got["shards"] == want["shards"]
    assert shard_digests(store) == shard_digests(reference)


def test_accelerate_launch_runs_two_processes_and_writes_the_one_process_store(setup):
    root, model, prepared, config, one = setup
    proc = run([*ACCELERATE, "--config_file", str(config), "--num_processes", "2", "--main_process_port",
                str(free_port()), "recipes/collect_hidden_states.py", *target_args(model, prepared), *COLLECT,
                f"out_dir={root / 'acc2'}"])
    ranks = re.findall(r"^rank (\d+)/(\d+): wrote (\d+) shards", proc.stdout, re.M)
    # World size 2, really: two processes each reporting its rank of 2, each writing its share.
    assert sorted((r, w) for r, w, _ in ranks) == [("0", "2"), ("1", "2")], proc.stdout[-2000:]
    assert all(int(n) > 0 for _, _, n in ranks) and "store complete" in proc.stdout
    assert_same_store(root / "acc2", one)


def two_node_launch(config, port: int, script: str, args: list[str], logs) -> list[str]:
    """The same launch command on two 'machines' (ranks 0 and 1) of one process each, on 127.0.0.1."""
    procs = []
    for node in (0, 1):
        cmd = [*ACCELERATE, "--config_file", str(config), "--num_machines", "2", "--machine_rank", str(node),
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_processes", "2",
               script, *args]
        procs.append((start(cmd, logs / f"{script.split('/')[-1]}.node{node}.log"), logs / f"{script.split('/')[-1]}.node{node}.log"))
    return wait_all(procs)


def test_two_nodes_collect_the_same_store_and_train_to_the_same_losses(setup):
    root, model, prepared, config, one = setup
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    outs = two_node_launch(config, free_port(), "recipes/collect_hidden_states.py",
                           [*target_args(model, prepared), *COLLECT, f"out_dir={root / 'nodes2'}"], logs)
    for node, out in enumerate(outs):
        assert re.search(rf"^rank {node}/2: wrote [1-9]\d* shards", out, re.M), out[-2000:]
    assert_same_store(root / "nodes2", one)

    train = [*target_args(model, prepared), "method=eagle3", "method.draft_vocab_size=64", "method.ttt_steps=2",
             "data.max_tokens=96", "data.eval_samples=4", "train.max_steps=4", "train.eval_every=0",
             "train.save_every=0", "train.progress=false", "train.measure_prompts=0", "train.mixed_precision=no",
             "wandb.mode=disabled"]
    run([*ACCELERATE, "--config_file", str(config), "--num_processes", "2", "--main_process_port", str(free_port()),
         "recipes/train.py", *train, f"features_dir={one}", f"output_dir={root / 'train_one_node'}"])
    two_node_launch(config, free_port(), "recipes/train.py",
                    [*train, f"features_dir={root / 'nodes2'}", f"output_dir={root / 'train_two_nodes'}"], logs)
    one_node, two_nodes = read_losses(root / "train_one_node"), read_losses(root / "train_two_nodes")
    assert sorted(one_node) == [1, 2, 3, 4] and one_node == two_nodes
    summaries = [json.loads((root / d / "train_summary.json").read_text()) for d in ("train_one_node", "train_two_nodes")]
    assert [s["num_processes"] for s in summaries] == [2, 2]
    assert summaries[0]["eval"] == summaries[1]["eval"]
