"""A target split by tensor parallelism (transformers' ``tp_plan="auto"``) on CPU processes over gloo.

Measured with transformers 5.24 / torch 2.13 (CPU): TP over gloo works, hidden states agree with the
whole target to ~1e-6 (float32; the sharded matmuls sum in another order, so not bitwise).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from specheads.data.features import CollectOptions, collect_hidden_states, spec_for_method
from specheads.data.prepare import load_prepared
from specheads.targets import load_target

from parallel_helpers import PYTHON, free_port, prepared_dir, run, store_features, tiny_model_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    model = tiny_model_dir(root)
    return model, prepared_dir(root, model, n=40)


def torchrun(n: int, *args: str):
    return run([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", str(free_port()),
                *args])


def test_split_target_features_and_online_training_equal_the_whole_targets(tiny, tmp_path):
    """2 processes, one tensor-parallel group: each rank holds half of every decoder layer, both read
    the same batches, and the features and EAGLE-3 losses are the whole target's (one process)."""
    from tp_worker import train_online

    model, prepared = tiny
    torchrun(2, "tests/parallel/tp_worker.py", str(model), str(prepared), str(tmp_path / "tp"), "eagle3")
    reports = [json.loads((tmp_path / "tp" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, rep in enumerate(reports):
        assert rep["layout"] == [2, r, 2, 1, 0]  # world, rank, tp_size, dp_size, dp_rank
        assert rep["q_proj_rows"] == 64 and rep["q_proj_local_rows"] == 32  # really split
        assert rep["borrowed_plain"] and rep["config_hash_equal"]
        assert rep["diff"]["embed"] == 0 and max(rep["diff"].values()) < 1e-5, rep["diff"]
    assert reports[0]["losses"] == reports[1]["losses"]

    torch.set_num_threads(1)
    whole = train_online(load_target(str(model)), str(prepared), str(tmp_path / "whole"), "eagle3")
    split = {int(k): v for k, v in reports[0]["losses"].items()}
    assert split.keys() == whole.keys() == {1, 2, 3}
    assert all(abs(split[k] - whole[k]) < 1e-4 * abs(whole[k]) for k in whole), (split, whole)
    # The held-out evaluation ran on both ranks of the group in lockstep (same batches) and scores as one process.
    sum_split = json.loads((tmp_path / "tp" / "train" / "train_summary.json").read_text())
    sum_whole = json.loads((tmp_path / "whole" / "train_summary.json").read_text())
    assert sum_split["train_tokens"] == sum_whole["train_tokens"]  # a TP group's shared batches count once
    ev_split, ev_whole = sum_split["eval"], sum_whole["eval"]
    accs = [k for k in ev_whole if k.startswith("step") and k.endswith("_acc")]
    assert accs and all(abs(ev_split[k] - ev_whole[k]) < 1e-6 for k in accs), (ev_split, ev_whole)


def test_collection_with_two_tensor_parallel_groups_writes_the_whole_targets_store(tiny, tmp_path):
    """4 processes as 2 groups of 2 (tp_size=2): a group shares one data-parallel rank, its first rank
    writes; the store holds the shards one whole-target process writes, with the same features."""
    model, prepared = tiny
    overrides = [f"target.name_or_path={model}", "target.dtype=float32", "target.device=cpu",
                 f"prepared_dir={prepared}", "method=eagle3", "collect.shard_bytes=20000",
                 "collect.batch_tokens=64", "collect.dtype=float32"]
    proc = torchrun(4, "recipes/collect_hidden_states.py", "target.parallel=tp", "target.tp_size=2",
                    f"out_dir={tmp_path / 'tp'}", *overrides)
    # Each rank's summary, also where two processes' prints share a line (no anchors: seen in CI).
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(
        r"rank (\d)/4: wrote (\d+) shards.*?\(rank \1/4, data-parallel \d/2, tensor-parallel \d/2\)", proc.stdout)}
    assert sorted(lines) == [0, 1, 2, 3], proc.stdout[-2000:]
    for r, line in lines.items():
        assert f"data-parallel {r // 2}/2, tensor-parallel {r % 2}/2" in line
        assert (" wrote 0 shards" in line) == (r % 2 == 1)  # only each group's first rank writes

    target = load_target(str(model))
    rows, _ = load_prepared(prepared)
    opts = CollectOptions(dtype="float32", shard_bytes=20000, batch_tokens=64, estimate_time=False)
    collect_hidden_states(target, rows, spec_for_method("eagle3", target.num_layers), tmp_path / "whole", opts)
    m_tp = json.loads((tmp_path / "tp" / "manifest.json").read_text())
    m_whole = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert m_tp["plan_hash"] == m_whole["plan_hash"] and m_tp["num_shards"] > 2
    assert [s["ids"] for s in m_tp["shards"]] == [s["ids"] for s in m_whole["shards"]]
    a, b = store_features(tmp_path / "tp"), store_features(tmp_path / "whole")
    assert a.keys() == b.keys() and len(a) == 40
    for i in a:
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["loss_mask"], b[i]["loss_mask"])
        for k in ("hidden_last", "hidden_aux"):
            assert torch.allclose(a[i][k], b[i][k], rtol=0, atol=1e-5), (i, k)
