"""DraftDecoderLayer and KVCache: parity with Hugging Face's Llama layer, masks, cache editing."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from specheads.models.layers import DraftDecoderLayer, KVCache, RotaryEmbedding, causal_mask
from specheads.models.eagle1 import Eagle1Config
from tests.conftest import make_tiny_target


@pytest.fixture
def setup():
    target = make_tiny_target("llama", vocab=97, hidden=64, layers=2, heads=4, kv_heads=2)
    config = Eagle1Config.from_target(target)
    torch.manual_seed(1)
    layer = DraftDecoderLayer(config, input_layernorm=True).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return target, config, layer, RotaryEmbedding(config)


def _run(layer, rope, x, pos, mask=None, cache=None):
    cos, sin = rope(x, pos)
    return layer(x, cos, sin, mask, cache)


def test_layer_matches_hf_llama_layer(setup):
    target, config, layer, rope = setup
    hf = target.model.model.layers[0]
    hf.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 64)
    pos = torch.arange(9).expand(2, 9)
    hf_mask = torch.full((9, 9), float("-inf")).triu(1)[None, None].expand(2, 1, 9, 9)
    cos, sin = target.model.model.rotary_emb(x, pos)
    expected = hf(x, attention_mask=hf_mask, position_ids=pos, position_embeddings=(cos, sin))
    assert_close(_run(layer, rope, x, pos), expected, atol=1e-5, rtol=1e-5)


def test_rope_follows_target_settings():
    target = make_tiny_target("llama", vocab=97, hidden=64, layers=2)
    target.model.config.rope_parameters = {"rope_type": "default", "rope_theta": 1234.0}
    config = Eagle1Config.from_target(target)
    assert config.rope_parameters["rope_theta"] == 1234.0
    inv = RotaryEmbedding(config).inv_freq
    assert_close(inv[1], torch.tensor(1234.0) ** (-2 / config.head_dim))


def test_incremental_decoding_with_cache_equals_full(setup):
    _, _, layer, rope = setup
    x = torch.randn(2, 10, 64)
    pos = torch.arange(10).expand(2, 10)
    full = _run(layer, rope, x, pos)
    cache = KVCache()
    first = _run(layer, rope, x[:, :6], pos[:, :6], cache=cache)
    rest = [_run(layer, rope, x[:, i:i + 1], pos[:, i:i + 1], cache=cache) for i in range(6, 10)]
    assert len(cache) == 10
    assert_close(torch.cat([first] + rest, 1), full, atol=1e-5, rtol=1e-5)


def test_tree_mask_equals_separate_branches(setup):
    """Two children of the same prefix drafted in one call equal two separate chain calls."""
    _, _, layer, rope = setup
    prefix, a, b = torch.randn(1, 5, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    pos = torch.arange(5)[None]
    cache = KVCache()
    _run(layer, rope, prefix, pos, cache=cache)
    tree_mask = torch.zeros(1, 2, 7, dtype=torch.bool)
    tree_mask[:, :, :5] = True
    tree_mask[0, 0, 5] = tree_mask[0, 1, 6] = True  # siblings do not see each other
    both = _run(layer, rope, torch.cat([a, b], 1), torch.tensor([[5, 5]]), tree_mask, cache.clone())
    for i, node in enumerate((a, b)):
        alone = _run(layer, rope, node, torch.tensor([[5]]), cache=cache.clone())
        assert_close(both[:, i:i + 1], alone, atol=1e-5, rtol=1e-5)


def test_cache_select_and_crop_keep_the_accepted_path(setup):
    _, _, layer, rope = setup
    x = torch.randn(1, 8, 64)
    pos = torch.arange(8)[None]
    cache = KVCache()
    _run(layer, rope, x[:, :5], pos[:, :5], cache=cache)
    # A rejected sibling at position 5, then the accepted node also at position 5.
    mask = causal_mask(2, 5)
    mask[0, 1, 5] = False
    _run(layer, rope, torch.stack([torch.randn(64), x[0, 5]])[None], torch.tensor([[5, 5]]), mask, cache)
    cache.select(torch.tensor([0, 1, 2, 3, 4, 6]))
    assert len(cache) == 6
    after_select = _run(layer, rope, x[:, 6:8], pos[:, 6:8], cache=cache)
    assert_close(after_select, _run(layer, rope, x, pos)[:, 6:8], atol=1e-5, rtol=1e-5)
    cache.crop(3)
    assert len(cache) == 3
    assert_close(_run(layer, rope, x[:, 3:5], pos[:, 3:5], cache=cache), _run(layer, rope, x[:, :5], pos[:, :5])[:, 3:5],
                 atol=1e-5, rtol=1e-5)


def test_cache_per_row_select_and_batch_select():
    cache = KVCache()
    k = torch.arange(2 * 1 * 4 * 1, dtype=torch.float).view(2, 1, 4, 1)
    cache.update(0, k, -k)
    cache.select(torch.tensor([[0, 3], [2, 1]]))
    assert cache.keys[0].flatten().tolist() == [0, 3, 6, 5]
    assert cache.values[0].flatten().tolist() == [0, -3, -6, -5]
    cache.select_batch(torch.tensor([1, 1, 0]))
    assert cache.batch_size == 3 and cache.keys[0][:, 0, :, 0].tolist() == [[6, 5], [6, 5], [0, 3]]
    with pytest.raises(IndexError, match="indices must lie"):
        cache.select(torch.tensor([2]))


def test_bad_mask_is_a_clear_error(setup):
    _, _, layer, rope = setup
    x = torch.randn(1, 3, 64)
    with pytest.raises(ValueError, match="attn_mask must be a bool tensor"):
        _run(layer, rope, x, torch.arange(3)[None], torch.ones(1, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask must be a bool tensor"):
        _run(layer, rope, x, torch.arange(3)[None], torch.ones(1, 3, 3))
