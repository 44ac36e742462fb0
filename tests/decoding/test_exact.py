"""Exact (batch-invariant) target forwards: a bfloat16 tree verify gives, bitwise, what one-token
forwards after each node's ancestors give, so speculative decoding in bfloat16 stays lossless."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_model
from specheads.decoding.cpu_linears import PackedLinear, can_pack
from specheads.decoding.exact import (ATTENTION_NAME, FLOOR_CAP, ExactDecodeCalls, apply_row_floor, exact_attention,
                                      floor_calls, linear_kind, linear_row_floor, make_exact, prove_exact,
                                      remove_row_floor, row_floor_is_on, row_floor_lifted, row_floor_set,
                                      set_row_floor, settle_exact, tree_vs_sequential)


@pytest.fixture(autouse=True)
def _floors_measured_here(monkeypatch, tmp_path):
    """Every test here measures its own row floors (several stand in for the measurement): nothing remembered
    (``exact.remembered_form``) comes in, and nothing they remember goes out."""
    import specheads.decoding.exact as exact

    monkeypatch.setattr(exact, "_FORM_MEMO", {})
    monkeypatch.setattr(exact, "memo_dir", lambda: tmp_path / "row_floors")


def _tree_vs_sequential(model, contexts=(40, 150), sizes=(3, 6, 12), seed=0, reference_parents=None):
    """(unequal, total, largest difference, nodes whose reference path differs)."""
    r = tree_vs_sequential(model, contexts=contexts, sizes=sizes, seed=seed, reference_parents=reference_parents)
    return r["unequal"], r["nodes"], r["largest_difference"], r["moved"]


def _bf16_model():
    return make_tiny_model("llama", hidden=128, layers=2, heads=4, kv_heads=2, dtype=torch.bfloat16)


def test_bf16_tree_verify_is_bitwise_sequential_with_exact_forwards():
    model = _bf16_model()
    assert make_exact(model, "auto")["attention"] == ATTENTION_NAME
    assert prove_exact(model)["proven"]
    unequal, total, worst, _ = _tree_vs_sequential(model)
    assert total == 2 * (3 + 6 + 12)
    assert unequal == 0 and worst == 0.0


def test_the_bitwise_comparison_tells_a_wrong_ancestor_path_apart():
    """The control, on any machine: with exact forwards, a one-token reference decoded along other
    paths (every node a child of the node before it) matches the tree bitwise exactly on the nodes
    whose path is the same in both, and differs on every other one, so the test above can fail."""
    model = _bf16_model()
    make_exact(model, "on")
    prove_exact(model)
    chain = lambda parents: [i - 1 for i in range(len(parents))]  # noqa: E731
    unequal, total, _, moved = _tree_vs_sequential(model, reference_parents=chain)
    assert total == 42 and 0 < moved < total  # random trees: some nodes' paths are a chain prefix, most not
    assert unequal == moved


def test_bf16_sdpa_tree_verify_agrees_with_sequential_to_rounding():
    """Without exact forwards the verify forward computes the same logits up to bfloat16 rounding
    (SDPA may reduce over the keys in a blocking that depends on the query count, so bitwise equality
    is not guaranteed, and depends on the machine's kernel: not asserted either way). A wrong mask or
    position would move them by the logits' own size (~1 here)."""
    model = _bf16_model()
    model.set_attn_implementation("sdpa")
    unequal, total, worst, _ = _tree_vs_sequential(model)
    assert total == 42 and worst <= 0.03  # a few bfloat16 steps at |logit| ~1 (0.0039 measured on a 2-core EPYC)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive", "none, not causal", "none, is_causal=False"])
def test_exact_attention_matches_sdpa_in_float32(mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    b, h, hkv, q, d = 2, 6, 2, 5, 8
    kv = q if mask_kind.startswith("none") else 11  # no mask: causal over a prefill (SDPA aligns is_causal top-left)
    query, key, value = torch.randn(b, h, q, d), torch.randn(b, hkv, kv, d), torch.randn(b, hkv, kv, d)
    allowed = torch.rand(b, 1, q, kv) > 0.3
    allowed[..., 0] = True
    mask = {"bool": allowed,
            "additive": torch.zeros(b, 1, q, kv).masked_fill(~allowed, torch.finfo(torch.float32).min)}.get(mask_kind)
    module = torch.nn.Module().eval()
    # a vision encoder's attention: no mask and not causal (the module says so, or the call does)
    module.num_key_value_groups, module.is_causal = h // hkv, mask_kind in ("none", "none, is_causal=False")
    kw = {"is_causal": False} if mask_kind == "none, is_causal=False" else {}
    got, _ = exact_attention(module, query, key, value, mask, scaling=0.3, **kw)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3, dropout=0.0, **kw)
    assert got.shape == (b, q, h, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_make_exact_modes():
    m32 = make_tiny_model("llama", layers=1)
    assert make_exact(m32, "off") == {"attention": "eager", "packed_linears": 0}
    assert make_exact(make_tiny_model("llama", layers=1), "auto")["attention"] == ATTENTION_NAME  # float32 too
    with pytest.raises(ValueError, match="exact_forward='yes'"):
        make_exact(m32, "yes")
    assert make_exact(m32, "on")["attention"] == ATTENTION_NAME
    m16 = make_tiny_model("llama", layers=1, dtype=torch.bfloat16)
    linears = sum(type(x) is torch.nn.Linear for x in m16.modules())
    done = make_exact(m16, "auto")
    assert done["packed_linears"] == (linears if can_pack(m16) else 0)


def test_the_exact_bfloat16_linear_is_bitwise_the_same_for_every_row_count():
    """What ``make_exact`` relies on: the linear layer it leaves a bfloat16 CPU target with (packed where the
    CPU has oneDNN's bfloat16 kernels, plain ``nn.Linear`` elsewhere) gives a row the same bits whatever the
    row count."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 160).to(torch.bfloat16)
    x = torch.randn(2, 13, 96).to(torch.bfloat16)
    packs = can_pack(lin)
    layer = PackedLinear(lin) if packs else lin
    full = layer(x)
    assert full.shape == (2, 13, 160) and layer.weight is lin.weight
    if packs:
        assert torch.equal(full, lin(x))
    assert all(torch.equal(layer(x[:1, :m]), full[:1, :m]) for m in range(1, 14))


def _wide_model(dtype):
    """Wide enough for the kernels that move with the row count: the MLP's down projection reads 1536 inputs
    (float32 rows of a one-row call differ from a call of several on every x86 CPU measured; bfloat16 ones on
    a CPU with bfloat16 kernels where the input is over 1024 wide)."""
    return make_tiny_model("llama", hidden=768, layers=2, heads=4, kv_heads=2, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_exact_forwards_are_bitwise_sequential_at_real_widths(dtype):
    """The main job's failure on a CPU with bfloat16 kernels (4 of 12 prompts differed from plain greedy
    decoding) came from a 1536-wide linear layer whose one-row kernel sums in another order; float64
    attention alone left it. With the measured row floor every node of every tree is bitwise what one-token
    forwards give, in both precisions the dtype probe can pick, under whatever instruction set this run
    dispatches (CI repeats tests/decoding under AVX2)."""
    model = _wide_model(dtype)
    make_exact(model, "auto")
    record = prove_exact(model)
    assert record["proven"] and 1 <= record["row_floor"] <= 16
    unequal, total, worst, _ = _tree_vs_sequential(model, contexts=(40, 150), sizes=(3, 6, 12))
    assert total == 42 and unequal == 0 and worst == 0.0


def test_the_row_floor_pads_small_calls_splits_large_ones_and_keeps_every_row():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 5, dtype=torch.float64)
    with torch.no_grad():  # small integers everywhere: every product and sum exact in float64, in any order
        lin.weight.copy_(torch.randint(-3, 4, (5, 8)).double())
        lin.bias.copy_(torch.randint(-3, 4, (5,)).double())
    seen = []
    inner = lin.forward
    lin.forward = lambda x: (seen.append(x.shape[0]), inner(x))[1]
    model = torch.nn.Sequential(lin)
    apply_row_floor(model, floor=4, chunk=6)
    x = torch.randint(-3, 4, (2, 7, 8)).double()
    want = x @ lin.weight.T + lin.bias
    assert torch.equal(lin(x[:1, :1]), want[:1, :1]) and seen == [4]  # one row, padded to the floor
    seen.clear()
    assert torch.equal(lin(x), want) and seen == [6, 6, 4]  # 14 rows: chunks of 6, the last 2 padded to 4
    seen.clear()
    with row_floor_lifted(model):
        assert torch.equal(lin(x[:1, :1]), want[:1, :1]) and seen == [1]  # lifted: as the kernels choose
    seen.clear()
    assert torch.equal(lin(x[0, :5]), want[0, :5]) and seen == [5]  # within [floor, chunk]: untouched
    # the evaluator's fast pass lifts the floor for good (set_row_floor); a lifted block inside it leaves it lifted,
    # and a block that sets it on (the exact pass, row_floor_set) restores it lifted
    set_row_floor(model, False)
    with row_floor_lifted(model):
        pass
    assert not row_floor_is_on(model)
    with row_floor_set(model, True):
        seen.clear()
        lin(x[:1, :1])
        assert row_floor_is_on(model) and seen == [4]
    seen.clear()
    lin(x[:1, :1])
    assert not row_floor_is_on(model) and seen == [1]
    remove_row_floor(model)
    seen.clear()
    lin(x[:1, :1])
    assert seen == [1]


def test_the_row_floor_measurement_finds_a_kernel_that_moves_with_the_row_count(monkeypatch):
    """A linear layer whose calls of fewer than 3 rows sum in another order (as a one-row kernel does) gets
    a floor of 3; an ordinary exact one a floor of 1."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4, bias=False, dtype=torch.float64)
    lin.weight.data = torch.randint(-3, 4, (4, 16)).double()
    model = torch.nn.Sequential(lin)
    assert linear_row_floor(model, max_rows=8)["floor"] == 1
    inner = lin.forward
    lin.forward = lambda x: inner(x) + (1e-9 if x.shape[0] < 3 else 0.0)
    measured = linear_row_floor(model, max_rows=8)
    assert measured["floor"] == 3 and list(measured["per_kind"].values()) == [3]


class _RowCountDependent(torch.nn.Module):
    """A layer whose bfloat16 output moves with the number of rows fed (a kernel no row floor can fix:
    it is not a linear layer); in float32 it is the identity."""

    def forward(self, x):
        if x.dtype == torch.bfloat16 and x.shape[-2] > 1:
            return x + 0.05 * torch.ones_like(x)
        return x


def test_an_unproven_bfloat16_target_falls_back_to_float32_and_says_why():
    model = _bf16_model()
    model.model.layers[0].mlp.act_fn = _RowCountDependent()
    make_exact(model, "auto")
    record = settle_exact(model)
    assert next(model.parameters()).dtype == torch.float32
    assert record["proven"] and record["fallback"]["from"] == "bfloat16"
    assert record["fallback"]["first"]["proof"]["unequal"] > 0 and "not proven exact" in record["fallback"]["reason"]
    assert _tree_vs_sequential(model)[0] == 0


def test_settle_exact_leaves_a_model_without_exact_forwards_alone():
    model = make_tiny_model("llama", layers=1)
    make_exact(model, "off")
    assert settle_exact(model) == {}


def test_every_kind_of_linear_layer_is_padded_to_the_largest_floor(monkeypatch):
    """Attention projections proven from 4 rows and the MLP's down-projection from 16: every kind is padded to 16.
    Each kind padded to its own floor left 1 of 42 tree nodes unequal on a bfloat16 model held to AVX-512 without
    bfloat16 kernels (its LM head measured 1, the others 2): test_exact_isa.py's check."""
    import specheads.decoding.exact as exact

    monkeypatch.setattr(exact, "FORMS", ("linear",))  # the layers' own forward (other forms: tests below)
    model = make_tiny_model("llama", hidden=64, layers=1, heads=4, kv_heads=2)
    mlp = model.model.layers[0].mlp
    make_exact(model, "on")
    seen: dict[str, list[int]] = {}
    layers = {"q": model.model.layers[0].self_attn.q_proj, "down": mlp.down_proj}
    for name, lin in layers.items():
        inner = lin.forward
        lin.forward = lambda x, name=name, inner=inner: (
            seen.setdefault(name, []).append(x.reshape(-1, x.shape[-1]).shape[0]), inner(x))[1]
    monkeypatch.setattr(exact, "layer_row_floor",
                        lambda f, in_features, *a, **k: 16 if in_features == mlp.down_proj.in_features else 4)
    record = prove_exact(model)
    assert record["proven"] and record["row_floor"] == 16
    assert record["row_floor_per_kind"][linear_kind(layers["q"])] == 4
    seen.clear()
    with torch.no_grad():
        layers["q"](torch.randn(1, 1, 64))
        mlp.down_proj(torch.randn(1, 1, mlp.down_proj.in_features))
    assert seen == {"q": [16], "down": [16]}


def test_floor_calls_follow_the_padding_of_the_row_floor():
    """The calls a layer gets for n rows under a floor, as ``_floored_forward`` makes them."""
    assert floor_calls(1, 4) == [4] and floor_calls(16, 4) == [16] and floor_calls(3, 5) == [5]
    assert floor_calls(4, 40, chunk=32) == [32, 8] and floor_calls(16, 33, chunk=32) == [32, 16]
    assert floor_calls(FLOOR_CAP + 1, 3) == [1, 1, 1]  # over the cap every row runs alone


def test_the_decoding_dtype_probe_times_each_dtype_at_its_own_row_floor(monkeypatch):
    """On a CPU where float32 rows move with the row count below 16 and bfloat16 rows do not (the main job's
    machine: a float32 one-token forward 76 ms padded vs 40 ms unpadded), the dtype probe of a decoding target
    times float32's calls padded to 16 rows and bfloat16's at the forward's 4: a probe at 4 rows for both chose
    float32 by 3% and decoded at twice the cost per verify forward."""
    import specheads.decoding.exact as exact
    import specheads.hardware as hardware

    monkeypatch.setenv(hardware.BF16_ENV, "1")
    monkeypatch.setattr(exact, "layer_row_floor", lambda m, i, dtype, *a, **k: 16 if dtype == torch.float32 else 1)
    timed = {}

    def forward_seconds(weights, shapes, dtype, calls, reps, backward):
        timed[str(dtype).replace("torch.", "")] = list(calls)
        assert all(callable(m) for m in weights.values())  # the layers as decoding runs them
        return 1.0 if dtype == torch.float32 else 0.5

    monkeypatch.setattr(hardware, "_forward_seconds", forward_seconds)
    rows = exact.ExactDecodeCalls(tokens=4)
    choice = hardware.choose_dtype("auto", "cpu", make_tiny_model(), rows=rows)
    assert timed == {"float32": [16], "bfloat16": [4]} and choice.value == "bfloat16"
    assert "row floor float32 16, bfloat16 1" in choice.reason


def test_exact_decode_calls_measure_the_floor_of_the_layers_they_time(monkeypatch):
    """Without stand-ins: the floor ``ExactDecodeCalls`` reports for float32 layers is the one
    ``linear_row_floor`` measures on the same layers inside a model, and the layers it hands back compute
    what the weights do."""
    import specheads.decoding.exact as exact

    monkeypatch.setattr(exact, "FORMS", ("linear",))  # the layers' own forward: a timed choice of form aside
    model = make_tiny_model("llama", layers=1)
    weights = {(m.in_features, m.out_features): m.weight.detach() for m in model.modules()
               if isinstance(m, torch.nn.Linear)}
    rows = ExactDecodeCalls(tokens=4)
    layers, calls = rows("float32", weights)
    floor = rows.floors["float32"]
    assert floor == linear_row_floor(model)["floor"] and calls == floor_calls(floor, 4)
    x = torch.randn(5, 64)
    shape = next(iter(weights))
    assert torch.allclose(layers[shape](x), x @ weights[shape].T)


@pytest.mark.parametrize("form", ["wxt", "xwt"])
def test_each_linear_form_computes_the_layers_product(form):
    from specheads.decoding.exact import form_forward

    lin = torch.nn.Linear(24, 10)
    x = torch.randn(2, 3, 24)
    assert torch.allclose(form_forward(lin, form)(x), lin(x), atol=1e-6)
    with pytest.raises(ValueError, match="unknown linear form"):
        form_forward(lin, "xw")


def test_a_form_replaces_the_layers_own_forward_only_where_its_padded_calls_are_cheaper(monkeypatch):
    """Held to AVX2 here, F.linear's float32 MLP needs 16 rows and x·Wᵀ-contiguous 2: the form whose padded calls
    cost least is chosen; none is where the layer needs no padding; the copy of Wᵀ is left out over its budget."""
    import specheads.decoding.exact as exact

    lin = torch.nn.Linear(32, 48, bias=False)
    own = lin.forward
    monkeypatch.setattr(exact, "layer_row_floor", lambda f, *a, **k: 16 if f == own else 2)
    monkeypatch.setattr(exact, "_calls_seconds", lambda f, i, d, dev, floor: float(floor) + (f != own) * 0.5)
    pick = exact.choose_form(lin)
    assert pick["form"] == "xwt" and pick["floor"] == 2 and pick["floors"] == {"linear": 16, "xwt": 2}
    assert exact.choose_form(lin, copy_budget=0)["floors"].keys() == {"linear", "wxt"}
    monkeypatch.setattr(exact, "FORM_MAX_BYTES", 32 * 48 * 4 - 1)  # a layer over the size: no form measured
    assert exact.choose_form(lin)["floors"] == {"linear": 16} and exact.choose_form(lin)["form"] == "linear"
    monkeypatch.setattr(exact, "FORM_MAX_BYTES", 256 << 20)
    half = torch.nn.Linear(32, 48, bias=False, dtype=torch.bfloat16)
    own = half.forward
    assert exact.choose_form(half)["floors"] == {"linear": 16}  # float32 only: a bfloat16 layer keeps its own
    monkeypatch.setattr(exact, "_calls_seconds", lambda f, i, d, dev, floor: 1.0 if f == own else 0.95)
    assert exact.choose_form(lin)["form"] == "linear"  # under FORM_GAIN's margin: the layer keeps its own
    monkeypatch.setattr(exact, "layer_row_floor", lambda f, *a, **k: 1)
    assert exact.choose_form(lin)["form"] == "linear" and exact.choose_form(lin)["ms"] == {}


@pytest.mark.parametrize("form", ["wxt", "xwt"])
def test_a_target_decoding_in_another_linear_form_stays_exact_and_plain_timing_keeps_its_own(form):
    """Every linear layer in ``form`` padded to that form's measured floor: every node of random draft trees is
    bitwise what one-token forwards give, and the floor lifted runs the layer's own forward."""
    from specheads.decoding.exact import form_forward, layer_row_floor

    model = make_tiny_model("llama", hidden=256, layers=2, heads=4, kv_heads=2)
    make_exact(model, "on")
    kinds = {linear_kind(m): m for m in model.modules() if isinstance(m, torch.nn.Linear)}
    floor = max(layer_row_floor(form_forward(m, form), m.in_features, m.weight.dtype, "cpu") for m in kinds.values())
    apply_row_floor(model, floor, forms={k: form for k in kinds})
    unequal, total, _, _ = _tree_vs_sequential(model, contexts=(40,), sizes=(3, 6, 12))
    assert total == 21 and unequal == 0
    head = model.lm_head
    x = torch.randn(1, 256)
    with torch.no_grad():
        padded = torch.cat([x, x.expand(floor - 1, -1)])
        assert torch.equal(head(x), form_forward(head, form)(padded)[:1])
        with row_floor_lifted(model):
            assert torch.equal(head(x), torch.nn.functional.linear(x, head.weight))


def test_prove_exact_records_each_kinds_form_and_proves_the_model_in_it():
    model = make_tiny_model("llama", hidden=256, layers=2, heads=4, kv_heads=2)
    make_exact(model, "on")
    record = prove_exact(model)
    assert record["proven"] and set(record["row_form"]) == set(record["row_floor_per_kind"])
    assert set(record["row_form"].values()) <= {"linear", "wxt", "xwt"}


class _MovesFrom(torch.nn.Module):
    """An activation whose output moves once a forward feeds more than ``rows`` rows per batch row (``dim`` -2) or
    more than ``batch`` batch rows: a kernel path no row floor fixes, seen only by a proof that feeds that many."""

    def __init__(self, rows: int = 10**9, batch: int = 10**9):
        super().__init__()
        self.rows, self.batch = rows, batch

    def forward(self, x):
        moved = x.shape[-2] > self.rows or (x.dim() == 3 and x.shape[0] > self.batch)
        return torch.nn.functional.silu(x) + (0.05 if moved else 0.0)


def _float32_model_with(act):
    model = make_tiny_model("llama", hidden=64, layers=1, heads=4, kv_heads=2)
    model.model.layers[0].mlp.act_fn = act
    make_exact(model, "on")
    return model


def test_the_proof_covers_the_tree_size_the_run_verifies():
    """A layer that moves only above 12 rows passes the default proof (trees of 3 and 8 nodes) but not one that
    checks the run's 24-node trees, and a float32 target that fails it stops in one line, before any decode."""
    from specheads.decoding.exact import ExactnessError, ProofScope

    assert prove_exact(_float32_model_with(_MovesFrom(rows=12)))["proven"]  # what the proof checked before
    record = prove_exact(_float32_model_with(_MovesFrom(rows=12)), scope=ProofScope(size=24, context=60))
    assert not record["proven"] and record["proof"]["cases"][-1] == [60, 24]
    with pytest.raises(ExactnessError) as err:
        settle_exact(_float32_model_with(_MovesFrom(rows=12)), scope=ProofScope(size=24, context=60))
    assert "\n" not in str(err.value) and "exact_forward=off" in str(err.value) and "[60, 24]" in str(err.value)
    assert settle_exact(_float32_model_with(_MovesFrom()), scope=ProofScope(size=24, context=60))["proven"]


def test_the_proof_covers_the_batch_the_run_verifies():
    """A layer that moves when two or more batch rows share a forward: unseen at batch 1, caught by the batched
    forward of the proven trees (with holes and padding), whose rows must equal their batch-1 forwards."""
    from specheads.decoding.exact import ProofScope

    model = _float32_model_with(_MovesFrom(batch=1))
    assert prove_exact(model)["proven"]  # batch 1 only, as before; the row floor is now applied
    alone = tree_vs_sequential(model, cases=[(40, 3), (90, 8)])
    assert alone["unequal"] == 0 and alone["batch_nodes"] == 0
    batched = tree_vs_sequential(model, cases=[(40, 3), (90, 8)], batch=4)
    assert batched["batch_nodes"] == 3 + 8 + 3 + 8 and batched["batch_unequal"] == batched["batch_nodes"]
    plain = _float32_model_with(_MovesFrom())
    prove_exact(plain)
    clean = tree_vs_sequential(plain, cases=[(40, 3), (90, 8)], batch=4)
    assert clean["batch_nodes"] == 22 and clean["unequal"] == 0
    assert not prove_exact(model, scope=ProofScope(size=8, batch=4, context=90))["proven"]


def test_a_scope_above_the_chunk_is_proven_at_one_chunk_and_a_row():
    from specheads.decoding.exact import MAX_ROWS, ProofScope

    assert ProofScope(size=200, batch=4, context=500).cases() == [(500, MAX_ROWS + 1)]
    assert ProofScope().cases() == [] and ProofScope(size=5, context=1).cases() == []
