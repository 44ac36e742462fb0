import pytest
import torch

from specheads.training.config import TrainConfig
from specheads.training.checkpoint import (CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint,
                                           remove_partial, save_checkpoint, verify_checkpoint)


def _setup(seed=0):
    from accelerate import Accelerator

    torch.manual_seed(seed)
    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return acc, model, opt


def test_save_load_round_trip_restores_model_optimizer_rng_and_state(tmp_path):
    acc, model, opt = _setup()
    path = save_checkpoint(acc, tmp_path, 7, {"epoch": 1, "pos": 3})
    want_w = model.weight.detach().clone()
    want_rand = torch.rand(3)
    with torch.no_grad():
        model.weight.zero_()
    state = load_checkpoint(acc, path)
    assert state["step"] == 7 and state["pos"] == 3
    torch.testing.assert_close(model.weight, want_w)
    torch.testing.assert_close(torch.rand(3), want_rand)  # RNG restored to the save point
    assert opt.state_dict()["state"][0]["step"] == 1


def test_keeps_newest_and_ignores_partial_saves(tmp_path):
    acc, _, _ = _setup()
    for s in (2, 4, 6):
        save_checkpoint(acc, tmp_path, s, {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000004", "step_0000006"]
    (tmp_path / ".tmp_step_0000008").mkdir()  # a save killed half way
    (tmp_path / "step_0000010").mkdir()  # a folder without manifest is not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step_0000006"
    remove_partial(tmp_path)
    assert not (tmp_path / ".tmp_step_0000008").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_corrupt_checkpoint_is_detected(tmp_path, damage):
    acc, _, _ = _setup()
    path = save_checkpoint(acc, tmp_path, 1, {})
    verify_checkpoint(path)
    victim = path / "model.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-10]))
    elif damage == "delete":
        victim.unlink()
    else:
        (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt|missing|unreadable"):
        load_checkpoint(acc, path)


def test_a_second_training_in_the_same_process_may_take_another_mixed_precision():
    """Accelerate's process-wide state refuses a new mixed precision once set ("AcceleratorState has already been
    initialized"): a bfloat16 training after a float32 one in one Python process (a notebook, a test session)
    failed so; each single-process training now starts from a fresh state."""
    from specheads.training.accelerator import make_accelerator

    _setup()  # an Accelerator already made in this process, mixed precision "no"
    acc = make_accelerator(TrainConfig(output_dir="unused", mixed_precision="bf16"))
    assert acc.mixed_precision == "bf16"
    acc = make_accelerator(TrainConfig(output_dir="unused", mixed_precision="no"))
    assert acc.mixed_precision == "no"
