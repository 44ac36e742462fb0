"""Split-target bookkeeping in one process: layouts, the data-parallel share, device_map placement."""

from __future__ import annotations

import pytest
import torch

import specheads.targets.parallel as parallel
from specheads.data.features import CollectOptions, collect_hidden_states, spec_for_method
from specheads.targets import ParallelLayout, data_parallel_share, device_map_devices, load_target
from specheads.training.batches import IterableSource, micro_batches

from parallel_helpers import prepared_dir, tiny_model_dir


def test_layout_groups_consecutive_ranks_and_shards_data_over_groups():
    layouts = [ParallelLayout("tp", 8, r, 4) for r in range(8)]
    assert [(x.dp_rank, x.tp_rank) for x in layouts] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert {x.dp_size for x in layouts} == {2} and [x.writes for x in layouts] == [True, False, False, False] * 2
    plain = ParallelLayout("none", 2, 1)
    assert (plain.dp_size, plain.dp_rank, plain.tp_rank, plain.writes) == (2, 1, 0, True)
    for bad in ((8, 0, 3), (2, 2, 1), (4, 0, 0)):
        with pytest.raises(ValueError):
            ParallelLayout("tp", *bad)


def test_tensor_parallel_peers_read_the_same_batches(monkeypatch):
    """4 ranks in 2 tensor-parallel groups read what 2 data-parallel ranks read, each group one share."""
    source = IterableSource(lambda epoch: range(10 * epoch, 10 * epoch + 10))

    def first(world, rank, n=6):
        stream = micro_batches(source, 0, 0, world, rank)
        return [next(stream)[1:] for _ in range(n)]

    plain = [first(2, r) for r in range(2)]
    assert data_parallel_share(4, 3) == (4, 3)  # no tensor-parallel target: unchanged
    got = {}
    for rank in range(4):
        monkeypatch.setattr(parallel, "_TP_LAYOUT", ParallelLayout("tp", 4, rank, 2))
        assert data_parallel_share(4, rank) == (2, rank // 2)
        got[rank] = first(4, rank)
    assert got[0] == got[1] == plain[0] and got[2] == got[3] == plain[1]
    assert [b for _, b in plain[0]][:3] == [0, 2, 4] and [p for p, _ in plain[0]][:3] == [2, 4, 6]
    with pytest.raises(RuntimeError, match="tensor-parallel target was loaded"):
        data_parallel_share(2, 0)  # sharding as another world than the target was loaded in


def test_device_map_devices_interleave_so_each_process_starts_on_its_local_rank():
    assert device_map_devices(8) == list(range(8))
    assert device_map_devices(8, 0, 2) == [0, 2, 4, 6] and device_map_devices(8, 1, 2) == [1, 3, 5, 7]
    assert device_map_devices(4, 3, 4) == [3]
    with pytest.raises(ValueError, match="at least one device per process"):
        device_map_devices(2, 3, 4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    model = tiny_model_dir(root)
    return model, prepared_dir(root, model, n=12)


def test_device_map_target_on_cpu_gives_the_whole_targets_features(tiny):
    model, _ = tiny
    whole, placed = load_target(str(model)), load_target(str(model), parallel="device_map")
    assert placed.layout.mode == "device_map" and placed.layout.tp_size == 1 and placed.device.type == "cpu"
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    a = whole.forward_features(ids, aux_layers=(1, 3, 5))
    b = placed.forward_features(ids, aux_layers=(1, 3, 5))
    assert all(torch.equal(x, y) for x, y in zip(a.aux + (a.last,), b.aux + (b.last,)))
    assert placed.config_hash() == whole.config_hash()


def test_bad_parallel_settings_are_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="use one of none, tp, device_map"):
        load_target(str(model), parallel="pipeline")
    with pytest.raises(ValueError, match="needs several processes"):
        load_target(str(model), parallel="tp")  # one process: nothing to split over


def test_a_tensor_parallel_peer_computes_but_writes_nothing(tiny, tmp_path):
    from specheads.data.prepare import load_prepared

    model, prepared = tiny
    rows, _ = load_prepared(prepared)
    target = load_target(str(model))
    spec = spec_for_method("eagle1", target.num_layers)
    opts = dict(shard_bytes=4000, batch_tokens=64, check_disk=False, estimate_time=False)
    peer = collect_hidden_states(target, rows, spec, tmp_path, CollectOptions(**opts, write=False))
    assert peer["shards_written"] == 0 and peer["manifest"] is None
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())
    writer = collect_hidden_states(target, rows, spec, tmp_path, CollectOptions(**opts))
    assert writer["manifest"] is not None and writer["samples"] == 12


@pytest.mark.parametrize("env, tears_down", [({"RANK": "1", "WORLD_SIZE": "2"}, False),
                                             ({"RANK": "0", "WORLD_SIZE": "2"}, True), ({}, True)])
def test_a_launched_rank_other_than_0_leaves_without_the_interpreters_teardown(env, tears_down):
    """Rank 1 of a launch ends at once (its teardown once aborted a CPU rank after its work was done); rank 0 and
    a process not launched as a rank end normally (their exit handlers run)."""
    import os
    import subprocess
    import sys

    code = ("import atexit; atexit.register(lambda: print('teardown')); "
            "from specheads.targets.parallel import leave_unless_first_rank; print('work done'); "
            "leave_unless_first_rank(); print('reported')")
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split()
    assert lines[:2] == ["work", "done"]
    assert ("reported" in lines) == tears_down and ("teardown" in lines) == tears_down
