"""Sequence parallel without processes: what ``train.sequence_parallel`` refuses before any work, the slice of a batch
each rank keeps, and which batch each rank reads. The 2-process loss and gradients are in
tests/distributed/test_sequence_parallel_processes.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from specheads.errors import ConfigError
from specheads.training import sequence_parallel as sp
from specheads.training.batches import IterableSource, micro_batches


@pytest.mark.parametrize("kwargs, words", [
    ({"size": 0, "method": "eagle3"}, "give a whole number of processes per row, >= 1"),
    ({"size": 2, "method": "medusa1"}, "method medusa1 does not split rows across processes yet"),
    ({"size": 2, "method": "dspark"}, "method dspark does not split rows"),
    ({"size": 2, "method": "eagle3", "world": 3}, "does not divide the 3 launched processes"),
    ({"size": 2, "method": "eagle3", "world": 4, "heads": 9, "kv_heads": 3}, "the drafter's 9 attention heads"),
    ({"size": 2, "method": "eagle3", "world": 2, "heads": 4, "kv_heads": 1}, "the drafter's 1 key/value heads"),
    ({"size": 2, "method": "eagle3", "world": 2, "target_parallel": "tp"}, "with target.parallel=tp"),
])
def test_a_size_the_run_cannot_take_is_refused_in_one_line(kwargs, words):
    with pytest.raises(ConfigError) as e:
        sp.check_settings(**kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_size_the_run_can_take_passes():
    sp.check_settings(1, "medusa1", world=3, heads=9, kv_heads=3)  # 1: nothing is split
    sp.check_settings(2, "eagle3", world=4, heads=4, kv_heads=2)
    sp.check_settings(3, "eagle3", world=3, heads=9, kv_heads=3)
    sp.check_settings(2, "dflash", world=4, heads=4, kv_heads=2)


def test_the_launch_check_reads_the_world_size_and_the_targets_heads(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    smollm2 = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    with pytest.raises(ConfigError, match="does not divide the drafter's 9 attention heads"):
        sp.check_launch(2, "eagle3", smollm2)
    sp.check_launch(2, "eagle3", LlamaConfig(num_attention_heads=4, num_key_value_heads=2))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="does not divide the 1 launched processes"):
        sp.check_launch(2, "eagle3", None)


def test_a_row_shorter_than_the_group_is_refused():
    sp.check_row_lengths(4, [4, 100])
    sp.check_row_lengths(1, [1])
    with pytest.raises(ConfigError, match="holds a row of 3 tokens, shorter than the 4 processes"):
        sp.check_row_lengths(4, [100, 3, 50])


def test_the_recipe_refuses_an_unsupported_method_before_any_work():
    from tests.training.test_train_recipe import compose, load_recipe

    cfg = compose("target.name_or_path=nowhere", "prepared_dir=nowhere", "output_dir=nowhere", "method=medusa1",
                  "train.sequence_parallel=2")
    with pytest.raises(ConfigError, match="method medusa1 does not split rows"):
        load_recipe().check_config(cfg)
    with pytest.raises(ConfigError, match="train.sequence_parallel"):
        load_recipe().check_config(compose("target.name_or_path=x", "output_dir=x", "train.sequence_parallel=0"))


def test_the_recipe_refuses_a_world_size_it_does_not_divide_before_the_target_loads(tmp_path, monkeypatch):
    from tests.training.engine_helpers import word_level_target
    from tests.training.test_train_recipe import compose, load_recipe

    model_dir, prepared = word_level_target(tmp_path, layers=2, rows=4)
    monkeypatch.setenv("WORLD_SIZE", "3")

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded before the refusal")

    monkeypatch.setattr("specheads.targets.load_target", no_load)
    cfg = compose(f"target.name_or_path={model_dir}", f"prepared_dir={prepared}", f"output_dir={tmp_path / 'run'}",
                  "method=eagle3", "train.sequence_parallel=2")
    with pytest.raises(ConfigError, match="train.sequence_parallel=2 does not divide the 3 launched processes"):
        load_recipe().run(cfg)


def _batch(T: int) -> dict:
    return {"input_ids": torch.arange(1, T + 1)[None], "attention_mask": torch.ones(1, T, dtype=torch.long),
            "hidden_aux": torch.arange(1, T + 1, dtype=torch.float32)[None, :, None].expand(1, T, 3), "steps": 7}


def test_each_rank_keeps_its_contiguous_slice_and_the_halo_after_it():
    T, halo = 11, 3  # 2 ranks own 6 positions each, the last one 5 of them and a padded one
    first, own = sp.SequenceShard(2, 0, None).local_batch(_batch(T), halo)
    last, _ = sp.SequenceShard(2, 1, None).local_batch(_batch(T), halo)
    assert own == 6
    assert first["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]  # positions 0-5 and the 3 after
    assert last["input_ids"].tolist() == [[7, 8, 9, 10, 11, 0, 0, 0, 0]]  # positions 6-10, then nothing
    assert last["attention_mask"].tolist() == [[1] * 5 + [0] * 4]
    assert last["hidden_aux"][0, :, 0].tolist() == [7, 8, 9, 10, 11, 0, 0, 0, 0]
    assert last["steps"] == 7  # what is not a (B, T, ...) tensor is kept as it is
    assert sp.SequenceShard(2, 1, None).positions(2, own, "cpu").tolist() == [list(range(6, 12))] * 2


def test_the_ranks_of_a_group_read_one_batch_and_the_groups_the_next():
    source = IterableSource(lambda epoch: ({"i": torch.tensor(i)} for i in range(8)))
    read = {rank: [int(next(stream)[2]["i"]) for _ in range(2)] for rank in range(4)
            for stream in [micro_batches(source, 0, 0, *sp.data_share(4, rank, 2))]}
    assert read == {0: [0, 2], 1: [0, 2], 2: [1, 3], 3: [1, 3]}


def test_dflash_blocks_are_dealt_in_order_and_each_share_padded_to_the_same_count():
    anchors = torch.tensor([[3, 8, 20, 31, 40], [5, 9, 1, 0, 0]])
    valid = torch.tensor([[True] * 5, [True, True, False, False, False]])
    shares = [sp.SequenceShard(2, r, None).deal(anchors, valid) for r in range(2)]
    (a0, v0, whole), (a1, v1, whole1) = shares
    assert a0.tolist() == [[3, 8, 20], [5, 9, 1]] and v0.tolist() == [[True] * 3, [True, True, False]]
    assert a1.tolist() == [[31, 40, 0], [0, 0, 0]] and v1.tolist() == [[True, True, False], [False] * 3]
    assert torch.equal(whole, whole1) and whole.tolist() == [[3, 8, 20, 31, 40, 0], [5, 9, 1, 0, 0, 0]]
    one, _, _ = sp.SequenceShard(2, 1, None).deal(anchors[:, :1], valid[:, :1])  # 1 block: rank 1's share is padding
    assert one.shape == (2, 1)


def test_the_recipe_takes_dflash_and_refuses_a_method_derived_from_it(monkeypatch):
    from tests.training.test_train_recipe import compose, load_recipe

    monkeypatch.setenv("WORLD_SIZE", "2")

    for name in ("dspark", "domino"):  # their losses read blocks their own way: not split yet
        cfg = compose("target.name_or_path=nowhere", "prepared_dir=nowhere", "output_dir=nowhere", f"method={name}",
                      "train.sequence_parallel=2")
        with pytest.raises(ConfigError, match=f"method {name} does not split rows"):
            load_recipe().check_config(cfg)
    load_recipe().check_config(compose("target.name_or_path=nowhere", "prepared_dir=nowhere", "output_dir=nowhere",
                                       "method=dflash", "train.sequence_parallel=2"))
