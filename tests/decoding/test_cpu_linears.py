"""oneDNN-prepacked CPU linear layers and the evaluator's measured choice between them and plain ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specheads.decoding import cpu_linears
from specheads.decoding.cpu_linears import (PackedLinear, can_pack, choose_cpu_linears, pack_cpu_linears,
                                            packed_count, unpack_cpu_linears)
from specheads.decoding.exact import make_exact
from specheads.decoding.generate import plain_generate
from specheads.decoding.runner import TargetRunner
from specheads.hardware import BF16_ENV
from tests.conftest import make_tiny_model


def hardware_bf16() -> bool:
    """This CPU's own answer (oneDNN's check of the hardware), whatever the environment forces."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

pytestmark = pytest.mark.skipif(not can_pack(make_tiny_model("llama", layers=1)),
                                reason="needs a CPU build of torch with oneDNN")


def _uses_packed(model) -> bool:
    return any(type(m) is PackedLinear and m.use_packed for m in model.modules())


def _linears(model) -> int:
    return sum(type(m) is nn.Linear for m in model.modules())


def test_pack_keeps_the_parameters_and_the_outputs_and_unpack_restores_plain_linears():
    model = make_tiny_model("llama", layers=2)
    ref = make_tiny_model("llama", layers=2)
    n = _linears(model)
    weights = {id(p) for p in model.parameters()}
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        want = ref(ids).logits
        assert pack_cpu_linears(model) == n and packed_count(model) == n and _linears(model) == 0
        assert {id(p) for p in model.parameters()} == weights  # the packed copies are buffers, not parameters
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        for m in model.modules():  # the plain path of a packed layer is nn.Linear's own arithmetic
            if type(m) is PackedLinear:
                m.use_packed = False
        assert torch.equal(model(ids).logits, want)
        assert unpack_cpu_linears(model) == n and packed_count(model) == 0 and _linears(model) == n
        assert {id(p) for p in model.parameters()} == weights
        assert torch.equal(model(ids).logits, want)


def test_a_packed_model_deep_copies_into_a_packed_model_of_its_own_weights():
    """An evaluation leaves its target packed where that layout measured faster; a copy of that target (a test's
    variant of a shared target, a user's) once failed: the packed tensor's storage cannot be read."""
    import copy

    model = make_tiny_model("llama", layers=2)
    pack_cpu_linears(model)
    ids = torch.randint(0, 256, (2, 7))
    twin = copy.deepcopy(model)
    assert packed_count(twin) == packed_count(model) > 0 and _uses_packed(twin)
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)
        want = model(ids).logits
        for m in twin.modules():
            if type(m) is PackedLinear:
                m.weight.zero_()
                assert m.weight.data_ptr() not in {p.data_ptr() for p in model.parameters()}
        assert torch.equal(model(ids).logits, want)  # the original keeps its own weights and packed copies


def test_packed_decoding_gives_the_plain_greedy_tokens():
    model, ref = make_tiny_model("llama", layers=2), make_tiny_model("llama", layers=2)
    pack_cpu_linears(model)
    prompts = [[5, 9, 17, 3, 44], [7, 7, 1]]
    got = plain_generate(TargetRunner(model), prompts, 12).tokens
    assert got == plain_generate(TargetRunner(ref), prompts, 12).tokens


@pytest.mark.parametrize("faster", ["packed", "plain"])
def test_auto_keeps_the_layout_whose_one_token_forward_is_faster(monkeypatch, faster):
    model = make_tiny_model("llama", layers=2)
    n = _linears(model)
    seen = []

    def timed(runner, token, reps):  # the layout in place when the forward would be timed
        layout = "packed" if _uses_packed(runner.model) else "plain"
        seen.append(layout)
        return 0.010 if layout == faster else 0.012

    monkeypatch.setattr(cpu_linears, "_one_token_seconds", timed)
    done = choose_cpu_linears(model, "auto", context=8, rounds=3)
    assert seen == ["packed", "plain"] * 3  # interleaved rounds
    assert done["linears"] == faster and done["one_token_ms"][faster] == pytest.approx(10.0)
    assert packed_count(model) == (n if faster == "packed" else 0)
    assert _linears(model) == (0 if faster == "packed" else n)
    assert done["packed_linears"] == packed_count(model)


def test_auto_times_real_forwards_and_modes_are_checked():
    model = make_tiny_model("llama", layers=1)
    done = choose_cpu_linears(model, "auto", context=8, rounds=1, reps=1)
    assert set(done["one_token_ms"]) == {"packed", "plain"} and all(v > 0 for v in done["one_token_ms"].values())
    assert packed_count(model) == done["packed_linears"]
    assert choose_cpu_linears(make_tiny_model("llama", layers=1), "plain")["packed_linears"] == 0
    packed = make_tiny_model("llama", layers=1)
    assert choose_cpu_linears(packed, "packed")["packed_linears"] == _linears(make_tiny_model("llama", layers=1))
    with pytest.raises(ValueError, match="cpu_linears='fast'"):
        choose_cpu_linears(make_tiny_model("llama", layers=1), "fast")
    with pytest.raises(ValueError, match="cpu_linears=packed needs"):
        choose_cpu_linears(make_tiny_model("llama", layers=1, dtype=torch.float16), "packed")


def test_without_bfloat16_kernels_a_bfloat16_target_keeps_plain_linears(monkeypatch):
    """A CPU without oneDNN's bfloat16 kernels (AVX2 only) cannot reorder bfloat16 weights: the exact forwards
    and the layout choice keep ``nn.Linear`` instead of crashing, and time nothing."""
    monkeypatch.setenv(BF16_ENV, "0")
    model = make_tiny_model("llama", layers=1, dtype=torch.bfloat16)
    linears = _linears(model)
    assert not can_pack(model)
    assert make_exact(model, "auto")["packed_linears"] == 0
    monkeypatch.setattr(cpu_linears, "_one_token_seconds", lambda *a: pytest.fail("nothing to time"))
    assert choose_cpu_linears(model, "auto") == {"linears": "plain", "packed_linears": 0, "one_token_ms": None}
    assert packed_count(model) == 0 and _linears(model) == linears
    with pytest.raises(ValueError, match="bfloat16 kernels"):
        choose_cpu_linears(model, "packed")
    assert can_pack(make_tiny_model("llama", layers=1))  # float32 packs on any CPU with oneDNN


def test_a_bfloat16_target_forced_past_the_check_packs_or_falls_back(monkeypatch):
    """With the check forced to yes, a CPU that has the kernels packs every layer, one without them (the
    reorder refuses) keeps every plain layer and still computes: never a crash."""
    monkeypatch.setenv(BF16_ENV, "1")
    model = make_tiny_model("llama", layers=1, dtype=torch.bfloat16)
    linears = _linears(model)
    x = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.no_grad():
        before = model(x).logits
    n = pack_cpu_linears(model)
    assert n == (linears if hardware_bf16() else 0)
    assert packed_count(model) == n and _linears(model) == linears - n
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


def test_a_target_packed_for_exact_bfloat16_forwards_stays_packed(monkeypatch):
    monkeypatch.setenv(BF16_ENV, "1" if hardware_bf16() else "0")
    model = make_tiny_model("llama", layers=1, dtype=torch.bfloat16)
    n = make_exact(model, "auto")["packed_linears"]
    if not hardware_bf16():  # the plain side: nothing packed, nothing timed
        assert n == 0
        monkeypatch.setattr(cpu_linears, "_one_token_seconds", lambda *a: pytest.fail("nothing to time"))
        assert choose_cpu_linears(model, "auto")["linears"] == "plain"
        return
    assert n > 0
    monkeypatch.setattr(cpu_linears, "_one_token_seconds", lambda *a: pytest.fail("nothing to time"))
    assert choose_cpu_linears(model, "auto") == {"linears": "packed", "packed_linears": n, "one_token_ms": None}
    assert all(type(m) is PackedLinear for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear)))


def test_a_drafter_is_packed_exactly_when_its_target_is():
    from specheads.decoding.cpu_linears import pack_like

    target, drafter = make_tiny_model("llama", layers=1), make_tiny_model("llama", layers=1, seed=3)
    assert pack_like(drafter, target) == 0 and packed_count(drafter) == 0
    pack_cpu_linears(target)
    assert pack_like(drafter, target) == _linears(make_tiny_model("llama", layers=1)) == packed_count(drafter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_are_laid_out_for_a_verify_forwards_rows_and_give_each_row_count_the_plain_result(dtype):
    """``pack_cpu_linears`` lays weights out for ``BATCH_HINT`` rows (a verify forward's few rows, not one: laid
    out for one row, two rows cost about twice one on an AVX2 CPU); the results stay ``nn.Linear``'s for every
    row count a decode step feeds (1 to 24), float32 to rounding, bfloat16 to its rounding."""
    if dtype == torch.bfloat16 and not hardware_bf16():
        pytest.skip("this CPU has no bfloat16 kernels: bfloat16 layers are not packed here")
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=True, dtype=dtype)
    model = nn.Sequential(lin)
    ref = nn.Linear(96, 160, bias=True, dtype=dtype)
    ref.load_state_dict(lin.state_dict())
    assert pack_cpu_linears(model) == 1
    packed = model[0]
    assert cpu_linears.BATCH_HINT >= 2 and packed.batch_hint == cpu_linears.BATCH_HINT
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    for rows in (1, 2, 3, 4, 8, 24):
        x = torch.randn(rows, 96, dtype=dtype)
        torch.testing.assert_close(packed(x), ref(x), **tol)
