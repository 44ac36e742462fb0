"""Every precision a user can ask for trains on a CPU: the target in float32, bfloat16 or float16, training's
autocast on or off, online or from a feature store, for each method (a bfloat16 target under float32 training
crashed EAGLE-3's loss: float != BFloat16)."""

from __future__ import annotations

import math

import datasets
import pytest
import torch

from specheads.data.features import CollectOptions, FeatureDataset, TokenDataset, collect_hidden_states
from specheads.methods.dflash import DFlashMethod
from specheads.methods.dspark import DSparkMethod
from specheads.methods.domino import DominoMethod
from specheads.methods.eagle1 import Eagle1Method
from specheads.methods.eagle3 import Eagle3Method
from specheads.methods.medusa import Medusa1Method, Medusa2Method
from specheads.methods.peagle import PEagleMethod
from specheads.training.batches import DatasetBatches
from specheads.training.config import OptimConfig, TrainConfig
from specheads.training.engine import train
from tests.conftest import make_tiny_target
from tests.training.engine_helpers import progression_rows

ROWS = progression_rows(40, length=20)
METHODS = {
    "medusa1": lambda: Medusa1Method(num_heads=2),
    "medusa2": lambda: Medusa2Method(num_heads=2, lora_r=2),
    "eagle1": lambda: Eagle1Method(),
    "eagle3": lambda: Eagle3Method(draft_vocab_size=64, ttt_steps=2, vocab_data=[
        {"input_ids": i, "loss_mask": m} for i, m in zip(ROWS["input_ids"], ROWS["loss_mask"])]),
    "dflash": lambda: DFlashMethod(block_size=4, anchors=4),
    "dspark": lambda: DSparkMethod(block_size=4, anchors=4),
    "domino": lambda: DominoMethod(block_size=4, anchors=4, lambda_base_start=0.5),
    "peagle": lambda: PEagleMethod(draft_vocab_size=64, num_depths=3, vocab_data=[
        {"input_ids": i, "loss_mask": m} for i, m in zip(ROWS["input_ids"], ROWS["loss_mask"])]),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sources(method, target, offline: bool, root):
    rows = datasets.Dataset.from_dict(ROWS)
    data = TokenDataset(rows)
    if offline:
        spec = method.feature_spec
        collect_hidden_states(target, rows, spec, root, CollectOptions(shard_bytes=2**20, batch_tokens=256,
                                                                      check_disk=False, estimate_time=False,
                                                                      progress=False))
        data = FeatureDataset(root, spec, target)
    return (DatasetBatches(data, max_tokens=160, seed=0, indices=range(32)),
            DatasetBatches(data, max_tokens=512, shuffle=False, indices=range(32, 40)))


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state whose mixed precision cannot change: reset it around each run."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


# EAGLE-3 (the main job's head) over the whole grid; every other method where a mismatch can hide: a
# bfloat16 target under float32 training, online and from a store, and a float16 target under bf16 autocast.
GRID = [("eagle3", d, m, o) for d in DTYPES for m in ("no", "bf16") for o in (False, True)]
GRID += [(n, d, m, o) for n in METHODS if n != "eagle3"
         for d, m, o in (("bfloat16", "no", False), ("bfloat16", "no", True), ("float16", "bf16", False))
         if not (n == "medusa2" and o)]  # Medusa-2 trains the target itself: online only


@pytest.mark.parametrize("name,dtype,mixed,offline", GRID,
                         ids=[f"{n}-{d}-{m}-{'offline' if o else 'online'}" for n, d, m, o in GRID])
def test_every_precision_trains(name, dtype, mixed, offline, tmp_path):
    method = METHODS[name]()
    target = make_tiny_target("llama", hidden=32, layers=4, heads=4, kv_heads=2, vocab=256, dtype=DTYPES[dtype])
    if hasattr(method, "bind"):
        method.bind(target)
    train_src, held = _sources(method, target, offline, tmp_path / "store")
    cfg = TrainConfig(output_dir=str(tmp_path / "out"), max_steps=2, save_every=0, eval_every=0, wandb_mode="disabled",
                      progress=False, mixed_precision=mixed, measure_prompts=0)
    s = train(method, target, train_src, cfg, OptimConfig(lr=1e-3, warmup_steps=1), held)
    assert s["steps"] == 2 and math.isfinite(s["final_loss"])
    assert (tmp_path / "out" / "head").is_dir()
