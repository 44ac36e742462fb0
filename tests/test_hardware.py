"""The machine's choices: device, bfloat16 support (forced either way), dtype and training precision by probe."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specheads.errors import ConfigError
from specheads.hardware import (BF16_ENV, Choice, choose_dtype, choose_mixed_precision, cpu_bf16_supported,
                                cpu_description, decoder_layer_shapes, linear_shapes, resolve_device)
from specheads.methods.losses import column_logits
from tests.conftest import make_tiny_model, make_tiny_target

NO_GPU = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_GPU, reason="the CPU side of auto")
def test_auto_device_is_the_cpu_without_a_gpu():
    assert resolve_device("auto") == "cpu" and resolve_device(None) == "cpu"
    assert resolve_device("cpu") == "cpu" and resolve_device(torch.device("cpu")) == "cpu"


@pytest.mark.skipif(not NO_GPU, reason="a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_cuda_device_without_cuda_is_one_line_naming_the_setting(device):
    with pytest.raises(ConfigError, match=rf"^target.device={device}: this machine has no CUDA device \(torch.cuda"
                                          r".is_available\(\) is False\); use auto or cpu$"):
        resolve_device(device)
    with pytest.raises(ConfigError, match=rf"^plan.device={device}: this machine has no CUDA device"):
        resolve_device(device, "plan.device")


@pytest.mark.parametrize("device", ["foo", "tpu", "meta", "cuda:x"])
def test_a_device_that_is_none_here_names_the_ones_taken(device):
    with pytest.raises(ConfigError, match=rf"^target.device={device}: not a device here; use auto .*cpu, cuda or "
                                          "cuda:N$"):
        resolve_device(device)


@pytest.mark.skipif(NO_GPU, reason="needs a GPU")
def test_a_cuda_index_past_the_machines_gpus_is_refused():
    assert resolve_device("cuda") == "cuda" and resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(ConfigError, match=r"^target.device=cuda:99: this machine has \d+ CUDA device"):
        resolve_device("cuda:99")


def test_the_bfloat16_check_can_be_forced_either_way(monkeypatch):
    monkeypatch.setenv(BF16_ENV, "0")
    assert cpu_bf16_supported() is False and "bf16 kernels no" in cpu_description()
    monkeypatch.setenv(BF16_ENV, "1")
    assert cpu_bf16_supported() is True and "bf16 kernels yes" in cpu_description()
    monkeypatch.delenv(BF16_ENV)
    assert cpu_bf16_supported() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert torch.backends.cpu.get_cpu_capability() in cpu_description()


@pytest.mark.skipif(not NO_GPU, reason="the CPU side of auto")
def test_auto_dtype_on_a_cpu_without_bfloat16_kernels_is_float32_untimed(monkeypatch):
    monkeypatch.setenv(BF16_ENV, "0")
    choice = choose_dtype("auto", "cpu", make_tiny_model())
    assert choice.value == "float32" and not choice.seconds and "no bfloat16 kernels" in choice.reason


@pytest.mark.skipif(not NO_GPU, reason="the CPU side of auto")
def test_auto_dtype_with_bfloat16_kernels_keeps_the_faster_of_a_probe(monkeypatch):
    monkeypatch.setenv(BF16_ENV, "1")
    model = make_tiny_model(hidden=128)
    choice = choose_dtype("auto", "cpu", model, rows=64, reps=1)
    assert set(choice.seconds) == {"float32", "bfloat16"} and all(v > 0 for v in choice.seconds.values())
    assert choice.value == min(choice.seconds, key=choice.seconds.get)
    assert next(model.parameters()).dtype == torch.float32  # the probe times copies, the model is untouched
    assert "float32" in choice.line("target dtype") and choice.record()["value"] == choice.value


def test_a_set_dtype_is_kept_and_a_wrong_one_is_one_line():
    assert choose_dtype("bfloat16", "cpu") == Choice("bfloat16", "as set")
    with pytest.raises(ConfigError, match="target.dtype='bf16'"):
        choose_dtype("bf16", "cpu")


def test_linear_shapes_count_every_layer_once():
    model = make_tiny_model(hidden=64, layers=3)  # llama: q, k, v, o, gate, up, down per layer + lm_head
    shapes = linear_shapes(model)
    assert sum(shapes.values()) == 3 * 7 + 1
    assert shapes[(64, 256)] == 1 and shapes[(64, 128)] == 3 * 2  # lm_head; gate + up (intermediate 128)


def test_decoder_layer_shapes_follow_the_config():
    config = make_tiny_model(hidden=64, heads=4, kv_heads=2).config
    assert decoder_layer_shapes(config) == Counter({(64, 64): 1, (64, 32): 2, (64, 128): 2, (128, 64): 1})


@pytest.mark.skipif(not NO_GPU, reason="the CPU side of auto")
def test_training_precision_auto(monkeypatch):
    shapes = Counter({(64, 128): 2, (128, 64): 1})
    monkeypatch.setenv(BF16_ENV, "0")
    assert choose_mixed_precision("auto", shapes).value == "no"
    monkeypatch.setenv(BF16_ENV, "1")
    assert choose_mixed_precision("auto", shapes, probe=False).value == "bf16"  # several processes: no probe
    choice = choose_mixed_precision("auto", shapes, rows=64, reps=1)
    assert set(choice.seconds) == {"float32", "bfloat16"}
    assert choice.value == ("bf16" if choice.seconds["bfloat16"] < choice.seconds["float32"] else "no")
    assert choose_mixed_precision("no", shapes).value == "no"


@pytest.mark.skipif(not NO_GPU, reason="the CPU side of auto")
def test_load_target_auto_loads_on_the_cpu_in_the_chosen_dtype(monkeypatch):
    from specheads.targets import load_target

    monkeypatch.setenv(BF16_ENV, "0")
    target = load_target("smollm2", "auto", "auto")
    assert target.device.type == "cpu" and target.dtype == torch.float32
    assert target.dtype_choice.value == "float32" and "no bfloat16 kernels" in target.dtype_choice.reason
    monkeypatch.setenv(BF16_ENV, "1")
    target = load_target("smollm2", "auto", "auto", probe_rows=16)
    choice = target.dtype_choice
    assert target.dtype == getattr(torch, choice.value) and choice.value == min(choice.seconds, key=choice.seconds.get)
    assert load_target("smollm2", "bfloat16", "cpu").dtype_choice == Choice("bfloat16", "as set")
    split = load_target("smollm2", "auto", "cpu", parallel="device_map")  # no probe: its ranks must agree
    assert split.dtype == torch.float32 and split.dtype_choice.reason == "split target on the CPU (its ranks must agree)"


def test_target_rows_in_bfloat16_score_a_float32_head_state():
    """Training without autocast on a bfloat16 target: the target's LM-head rows meet the head's float32
    hidden states (a float/bfloat16 mismatch crashed the EAGLE-3 loss)."""
    target = make_tiny_target("llama", dtype=torch.bfloat16)
    cols = torch.tensor([3, 7, 11])
    hidden = torch.randn(5, 64)
    got = column_logits(target, cols)(hidden)
    want = hidden @ target.lm_head.weight[cols].float().T
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    assert column_logits(target, cols)(hidden.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("device, parallel, words", [("foo", "none", "target.device=foo: not a device here"),
                                                     ("cpu", "foo", "target.parallel=foo: use one of none, tp")])
def test_every_stage_loading_a_target_refuses_a_bad_device_before_reading_it(tmp_path, device, parallel, words):
    from specheads.targets import load_target

    with pytest.raises(ConfigError, match=f"^{words}"):
        load_target(str(tmp_path / "no-such-model"), device=device, parallel=parallel)
