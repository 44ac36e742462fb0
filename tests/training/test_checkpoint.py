import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import specheads.training.checkpoint as ckpt
from specheads.errors import ConfigError
from specheads.training.config import TrainConfig
from specheads.training.checkpoint import (CheckpointError, Checkpointer, async_blocker, latest_checkpoint,
                                           list_checkpoints, load_checkpoint, remove_partial, save_checkpoint,
                                           verify_checkpoint)


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


# --------------------------------------------------------------------------- what the model file holds


class _PartlyFrozen(torch.nn.Module):
    """A frozen layer (as a Medusa head's LM-head copy), a trained one and a buffer set at build (as EAGLE-3's d2t)."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
        self.head = torch.nn.Linear(4, 3)
        self.register_buffer("table", torch.arange(3))

    def forward(self, x):
        return self.head(self.frozen(x))


def _frozen_setup(seed=0):
    from accelerate import Accelerator

    torch.manual_seed(seed)
    acc = Accelerator(cpu=True)
    model = _PartlyFrozen()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, opt = acc.prepare(model, opt)
    _step(model, opt)
    return acc, model, opt


def _edit_model_file(folder, edit):
    """Change ``model.safetensors`` with ``edit(tensors)`` and re-hash the folder (a well-formed checkpoint)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ckpt.write_manifest(folder)


@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_checkpoint_holds_the_trained_weights_and_buffers_not_the_frozen_ones(tmp_path, mode):
    from safetensors import safe_open

    acc, model, opt = _frozen_setup()
    saver = Checkpointer(acc, tmp_path, mode=mode)
    path = saver.save(1, {})
    saver.wait()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {"head.weight", "head.bias", "table"}
    assert set(json.loads((path / "frozen.json").read_text())["model.safetensors"]) == {"frozen.weight", "frozen.bias"}
    want = {k: v.clone() for k, v in model.state_dict().items()}
    _step(model, opt)
    with torch.no_grad():
        model.table.zero_()
    load_checkpoint(acc, path)
    for k, v in want.items():  # trained weights and the buffer from the file, frozen ones as built
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("edit,error", [
    (lambda t: t.pop("head.bias"), r"model.safetensors lacks the trained weight 'head.bias' \(a checkpoint of another"),
    (lambda t: t.pop("table"), r"lacks the trained weight 'table'"),
    (lambda t: t.update(extra=torch.ones(2)), r"model.safetensors holds 'extra', which the module this run built does "
                                              r"not have"),
], ids=["trained-weight-missing", "buffer-missing", "unknown-name"])
def test_a_model_file_short_of_a_trained_weight_or_with_an_unknown_name_is_refused(tmp_path, edit, error):
    acc, model, _ = _frozen_setup()
    path = save_checkpoint(acc, tmp_path, 1, {})
    _edit_model_file(path, edit)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.head.weight.add_(1.0)
    want["head.weight"] += 1.0
    with pytest.raises(CheckpointError, match=error) as e:
        load_checkpoint(acc, path)
    assert "\n" not in str(e.value)
    for k, v in want.items():  # refused before anything was loaded
        assert torch.equal(model.state_dict()[k], v), k


def test_a_resume_whose_build_made_other_frozen_weights_is_refused(tmp_path):
    acc, model, _ = _frozen_setup()
    path = save_checkpoint(acc, tmp_path, 1, {})
    with torch.no_grad():
        model.frozen.weight[0, 0] += 0.01  # as another target's (or seed's) LM head would be
    with pytest.raises(CheckpointError, match=r"frozen weight 'frozen.weight' is not the one this checkpoint was "
                                              r"trained with .*same target, seed and method settings"):
        load_checkpoint(acc, path)


@pytest.mark.parametrize("name", ["medusa1", "medusa2", "eagle1", "eagle3", "peagle", "dspark", "domino"])
def test_each_familys_checkpoint_holds_its_trained_weights_and_buffers(tmp_path, name):
    """EAGLE-3's and P-EAGLE's d2t/t2d (buffers set at build) are kept; only Medusa-2's (LoRA: the target) frozen
    weights live in these modules at their defaults, the other families lend the target's outside the state dict."""
    from accelerate import Accelerator
    from safetensors import safe_open

    from specheads.methods import TrainingModule
    from tests.conftest import make_tiny_target
    from tests.methods.test_training_module import _method

    torch.manual_seed(0)
    method = _method(name)
    module = TrainingModule(method, method.build(make_tiny_target("llama", hidden=32, layers=4, vocab=256)), None)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])
    acc = Accelerator(cpu=True)
    module, opt = acc.prepare(module, opt)
    path = save_checkpoint(acc, tmp_path, 1, {})
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        held = set(f.keys())
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    buffers = {n for n, _ in module.named_buffers()} & set(module.state_dict())
    assert held == trained | buffers
    frozen = set(json.loads((path / "frozen.json").read_text())["model.safetensors"])
    assert frozen == set(module.state_dict()) - held
    assert bool(frozen) == (name == "medusa2")
    assert ({"model.d2t", "model.t2d"} <= held) == (name in ("eagle3", "peagle"))
    load_checkpoint(acc, path)


def test_a_checkpoint_written_with_the_frozen_weights_still_loads(tmp_path):
    """Checkpoints written before frozen weights were left out: the whole state dict, no frozen.json."""
    acc, model, _ = _frozen_setup()
    tmp, final = ckpt._begin(acc, tmp_path, 1)
    acc.save_state(str(tmp))  # what save_checkpoint wrote then
    ckpt._publish(tmp, final, 1, {"pos": 2}, keep=2)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert load_checkpoint(acc, final)["pos"] == 2
    for k, v in want.items():  # the frozen weights too, from the file
        assert torch.equal(model.state_dict()[k], v), k


# --------------------------------------------------------------------------- written in the background


def _files_equal(a, b, clock=()):
    """Every file of checkpoint ``a`` holds what the same file of ``b`` holds, tensors bit for bit (JSON keys in
    ``clock``, wall-clock readings, aside)."""
    from safetensors.torch import load_file

    names = sorted(p.name for p in a.iterdir() if p.name != "manifest.json")
    assert names == sorted(p.name for p in b.iterdir() if p.name != "manifest.json")
    for name in names:
        if name.endswith(".safetensors"):
            x, y = load_file(a / name), load_file(b / name)
        elif name.endswith(".json"):
            x, y = ({k: v for k, v in json.loads((d / name).read_text()).items() if k not in clock} for d in (a, b))
        else:
            x, y = torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False)
        _assert_same(x, y, name)


def _assert_same(x, y, where):
    if isinstance(x, torch.Tensor):  # a GPU's tensors are written from their host copies: loading maps them back
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), where
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_same(x[k], y[k], f"{where}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same(u, v, f"{where}/{i}")
    elif isinstance(x, np.ndarray):
        assert np.array_equal(x, y), where
    else:
        assert x == y, where


def _blocked_writer(monkeypatch):
    """Make the background writer stop before its first file until ``release`` is set; ``started`` says it got there."""
    started, release = threading.Event(), threading.Event()
    write = ckpt._write_file

    def held(path, obj, safetensors):
        started.set()
        assert release.wait(60), "the test never released the writer"
        write(path, obj, safetensors)

    monkeypatch.setattr(ckpt, "_write_file", held)
    return started, release


def _step(model, opt):
    w = next(model.parameters())
    model(torch.randn(2, w.shape[1], device=w.device)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_training_goes_on_while_the_checkpoint_is_written_and_the_copy_is_of_the_save_point(tmp_path, monkeypatch):
    acc, model, opt = _setup()
    saver = Checkpointer(acc, tmp_path, mode="always")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_adam = opt.state_dict()["state"][0]["exp_avg"].clone()
    started, release = _blocked_writer(monkeypatch)
    path = saver.save(1, {"pos": 1})
    assert started.wait(30)  # the writer is inside its first file ...
    _step(model, opt)  # ... and training goes on: the next optimizer step changes the live tensors
    assert not path.exists() and latest_checkpoint(tmp_path) is None  # nothing published before the write ends
    release.set()
    saver.wait()
    assert latest_checkpoint(tmp_path) == path
    live = {k: v.clone() for k, v in model.state_dict().items()}
    load_checkpoint(acc, path)
    for k, v in want.items():  # the save point's tensors, not the step's after it
        assert torch.equal(model.state_dict()[k], v) and not torch.equal(live[k], v)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], want_adam)


def test_a_background_checkpoint_holds_what_a_synchronous_one_holds(tmp_path):
    acc, model, opt = _setup()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc.register_for_checkpointing(sched)
    _step(model, opt)
    sched.step()
    sync = save_checkpoint(acc, tmp_path / "sync", 3, {"pos": 5})
    saver = Checkpointer(acc, tmp_path / "async", mode="always")
    assert saver.asynchronous
    background = saver.save(3, {"pos": 5})
    saver.wait()
    verify_checkpoint(background)
    _files_equal(sync, background)
    # and it resumes: a fresh model, optimizer and scheduler get the save point's state bit for bit
    want_w, want_adam = model.weight.detach().clone(), opt.state_dict()["state"][0]["exp_avg_sq"].clone()
    want_rand, want_lr = torch.rand(5), sched.get_last_lr()
    _step(model, opt)
    sched.step()
    assert load_checkpoint(acc, background)["pos"] == 5
    assert torch.equal(model.weight, want_w)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg_sq"], want_adam)
    assert sched.get_last_lr() == want_lr
    assert torch.equal(torch.rand(5), want_rand)


def test_a_failed_background_write_raises_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    acc, _, _ = _setup()
    saver = Checkpointer(acc, tmp_path, mode="always")
    first = saver.save(1, {})
    saver.wait()

    def full_disk(path, obj, safetensors):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "_write_file", full_disk)
    saver.save(2, {})
    with pytest.raises(CheckpointError, match="step_0000002 failed in the background: OSError.*No space left"):
        saver.wait()
    saver.check()  # raised once, not again
    assert latest_checkpoint(tmp_path) == first
    assert not (tmp_path / ".tmp_step_0000002").exists()


def test_the_next_save_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    acc, model, opt = _setup()
    saver = Checkpointer(acc, tmp_path, mode="always")
    started, release = _blocked_writer(monkeypatch)
    saver.save(1, {})
    assert started.wait(30)
    second = threading.Thread(target=saver.save, args=(2, {}))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # blocked on the first write
    release.set()
    second.join(30)
    saver.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_0000001", "step_0000002"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_copy_goes_to_reused_pinned_buffers_and_holds_the_save_point(tmp_path, monkeypatch):
    from accelerate import Accelerator

    torch.manual_seed(0)
    acc = Accelerator()
    model = torch.nn.Linear(256, 512)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    _step(model, opt)
    saver = Checkpointer(acc, tmp_path / "background")
    assert saver.asynchronous  # auto, on a GPU
    want = model.weight.detach().cpu().clone()
    started, release = _blocked_writer(monkeypatch)
    first = saver.save(1, {})
    assert started.wait(30)
    _step(model, opt)  # queued behind the device-to-host copies on the same stream
    release.set()
    saver.wait()
    assert saver._pinned and all(b.is_pinned() for b in saver._pinned.values())
    where = {k: b.data_ptr() for k, b in saver._pinned.items()}
    second = saver.save(2, {})
    saver.wait()
    assert {k: b.data_ptr() for k, b in saver._pinned.items()} == where  # reused, not pinned again
    _files_equal(save_checkpoint(acc, tmp_path / "sync", 2, {}), second)
    load_checkpoint(acc, first)
    assert torch.equal(model.weight.detach().cpu(), want)


_KILLED_CHILD = """
import sys, time, torch
sys.path.insert(0, {tests!r})
from test_checkpoint import _setup, _step
import specheads.training.checkpoint as ckpt

acc, model, opt = _setup()
saver = ckpt.Checkpointer(acc, {root!r}, mode="always")
saver.save(1, {{}})
saver.wait()
write = ckpt._write_file
def write_then_hang(path, obj, safetensors):
    write(path, obj, safetensors)
    open({marker!r}, "w").close()  # one file written, the rest never will be
    time.sleep(600)
ckpt._write_file = write_then_hang
_step(model, opt)
saver.save(2, {{}})
while True:
    _step(model, opt)  # training goes on until the kill
"""


def test_sigkill_while_the_background_writer_writes_leaves_the_previous_checkpoint(tmp_path):
    marker, root = tmp_path / "written_one_file", tmp_path / "ckpt"
    code = _KILLED_CHILD.format(tests=str(Path(__file__).parent), root=str(root), marker=str(marker))
    child = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not marker.exists():
        assert child.poll() is None and time.time() < deadline, child.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    partial = root / ".tmp_step_0000002"
    assert (partial / "model.safetensors").is_file()  # killed mid-write
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(partial)
    assert latest_checkpoint(root).name == "step_0000001"
    remove_partial(root)
    assert not partial.exists()
    acc, _, _ = _setup(seed=1)
    load_checkpoint(acc, latest_checkpoint(root))  # resumes from the previous one


def test_auto_writes_in_the_background_on_a_gpu_but_not_on_a_cpu_nor_under_sharded_launchers():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    def fake(kind, device="cuda"):
        return SimpleNamespace(distributed_type=kind, _save_model_state_pre_hook={}, is_main_process=True,
                               device=torch.device(device), project_configuration=SimpleNamespace(save_on_each_node=False))

    assert async_blocker(fake(DistributedType.MULTI_GPU)) is None
    assert Checkpointer(fake(DistributedType.MULTI_GPU), "unused").asynchronous
    assert not Checkpointer(fake(DistributedType.NO, "cpu"), "unused").asynchronous  # the writer would share the cores
    assert Checkpointer(fake(DistributedType.MULTI_CPU, "cpu"), "unused", mode="always").asynchronous
    assert not Checkpointer(fake(DistributedType.MULTI_GPU), "unused", mode="never").asynchronous
    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        assert "collective" in async_blocker(fake(kind))
        assert not Checkpointer(fake(kind), "unused").asynchronous  # auto: synchronous, said in a log line
        with pytest.raises(ConfigError, match="train.async_checkpoint=always: .*collective.*use auto or never"):
            Checkpointer(fake(kind), "unused", mode="always")
    with pytest.raises(ConfigError, match="train.async_checkpoint=on: use one of auto, always, never"):
        Checkpointer(fake(DistributedType.NO), "unused", mode="on")


def test_the_setting_is_checked_before_any_work():
    from specheads.training.config import OptimConfig, check_settings

    check_settings(TrainConfig(output_dir="unused", async_checkpoint="always"), OptimConfig(), {}, {})
    with pytest.raises(ConfigError, match=r"^train.async_checkpoint=True: use one of auto, always, never$"):
        check_settings(TrainConfig(output_dir="unused", async_checkpoint="True"), OptimConfig(), {}, {})
