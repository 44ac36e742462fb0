"""Exact (batch-invariant) target forwards: a bfloat16 tree verify gives, bitwise, what one-token
forwards after each node's ancestors give, so speculative decoding in bfloat16 stays lossless."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import make_tiny_model
from specheads.decoding.cpu_linears import PackedLinear, can_pack
from specheads.decoding.exact import ATTENTION_NAME, exact_attention, make_exact
from specheads.decoding.runner import TargetRunner


def _random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return [rng.randrange(vocab) for _ in range(n)], parents


def _path(parents: list[int], i: int) -> list[int]:
    """Node ``i``'s root-to-node path (node indices, root first)."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def _tree_vs_sequential(model, contexts=(40, 150), sizes=(3, 6, 12), vocab=256, seed=0,
                        reference_parents=None) -> tuple[int, int, float, int]:
    """(unequal, total, largest difference, nodes whose reference path differs): logits of every node of
    random trees, one verify forward vs one-token forwards of its root-to-node path, compared bitwise.
    ``reference_parents(parents) -> parents`` builds the one-token reference along other paths (the control)."""
    rng = random.Random(seed)
    r = TargetRunner(model)
    unequal = total = moved = 0
    worst = 0.0
    for length in contexts:
        prompt = [rng.randrange(vocab) for _ in range(length)]
        for n in sizes:
            toks, parents = _random_tree(rng, n, vocab)
            ref = reference_parents(parents) if reference_parents else parents
            r.prefill([prompt])
            tree = r.forward(torch.tensor([toks]), torch.tensor([parents])).logits[0]
            for i in range(n):
                r.prefill([prompt])
                for j in _path(ref, i):
                    one = r.forward(torch.tensor([[toks[j]]]), torch.tensor([[-1]])).logits[0, 0]
                    r.commit([[0]])
                total += 1
                moved += _path(ref, i) != _path(parents, i)
                unequal += not torch.equal(one, tree[i])
                worst = max(worst, float((one.float() - tree[i].float()).abs().max()))
    return unequal, total, worst, moved


def _bf16_model():
    return make_tiny_model("llama", hidden=128, layers=2, heads=4, kv_heads=2, dtype=torch.bfloat16)


def test_bf16_tree_verify_is_bitwise_sequential_with_exact_forwards():
    model = _bf16_model()
    assert make_exact(model, "auto")["attention"] == ATTENTION_NAME
    unequal, total, worst, _ = _tree_vs_sequential(model)
    assert total == 2 * (3 + 6 + 12)
    assert unequal == 0 and worst == 0.0


def test_the_bitwise_comparison_tells_a_wrong_ancestor_path_apart():
    """The control, on any machine: with exact forwards, a one-token reference decoded along other
    paths (every node a child of the node before it) matches the tree bitwise exactly on the nodes
    whose path is the same in both, and differs on every other one, so the test above can fail."""
    model = _bf16_model()
    make_exact(model, "on")
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


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_exact_attention_matches_sdpa_in_float32(mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    b, h, hkv, q, d = 2, 6, 2, 5, 8
    kv = q if mask_kind == "none" else 11  # no mask: causal over a prefill (SDPA aligns is_causal top-left)
    query, key, value = torch.randn(b, h, q, d), torch.randn(b, hkv, kv, d), torch.randn(b, hkv, kv, d)
    allowed = torch.rand(b, 1, q, kv) > 0.3
    allowed[..., 0] = True
    mask = {"none": None, "bool": allowed,
            "additive": torch.zeros(b, 1, q, kv).masked_fill(~allowed, torch.finfo(torch.float32).min)}[mask_kind]
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.is_causal = h // hkv, mask is None
    got, _ = exact_attention(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    assert got.shape == (b, q, h, d) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_make_exact_modes():
    m32 = make_tiny_model("llama", layers=1)
    assert make_exact(m32, "auto") == {"attention": "eager", "packed_linears": 0}  # float32: left as it is
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
