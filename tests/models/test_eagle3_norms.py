"""Eagle3Model's normalisation options (speculators' norm_before_fc, norm_before_residual, norm_output): each one
against a reference written here from its formula, and the default path as before
the options existed (to float32 rounding: the saved outputs were made on another CPU, whose kernels may round a
last bit otherwise).

``data/eagle3_default*.safetensors`` hold a tiny head's state dict, inputs and outputs (``fuse``, two ``step``s)
written by the code before these options (commit 56e7f59), without and with ``fc_norm``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from tests.conftest import make_tiny_target

DATA = Path(__file__).parent / "data"
SAVED_TOL = dict(rtol=1e-5, atol=1e-5)
"""A few float32 ulps at these magnitudes (a CPU rounds a matmul's last bit its own way); an option leaking into
the default path moves the outputs by orders more."""
AUX, DV, EPS = (0, 1, 3), 50, 1e-6


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=97, hidden=32, layers=4, heads=4, kv_heads=2)


def _head(target, seed: int = 3, **options) -> Eagle3Model:
    fc_norm = options.pop("fc_norm", False)
    model = Eagle3Model(Eagle3Config.from_target(target, DV, AUX, fc_norm, **options)).eval().attach(target)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def _rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _layer(model, hidden, ids, pos, residual_from_norm: bool):
    """The EAGLE-3 draft layer from its formula (causal attention over the q positions, no cache)."""
    mid = model.midlayer
    normed = _rms(hidden, mid.hidden_norm.weight)
    x = torch.cat([_rms(model.embed(ids), mid.input_layernorm.weight), normed], -1)
    cos, sin = model.rotary_emb(hidden, pos)
    h = (normed if residual_from_norm else hidden) + mid.self_attn(x, cos, sin, 0, None, None)
    return h + mid.mlp(_rms(h, mid.post_attention_layernorm.weight))


@pytest.mark.parametrize("name", ["eagle3_default", "eagle3_default_fc_norm"])
def test_default_head_computes_what_it_did_before_the_options(name):
    saved = load_file(str(DATA / f"{name}.safetensors"))
    target = make_tiny_target("llama", vocab=97, hidden=32, layers=4, heads=4, kv_heads=2)
    model = Eagle3Model(Eagle3Config.from_target(target, DV, AUX, "fc_norm" in name)).eval().attach(target)
    state = {k[len("state."):]: v for k, v in saved.items() if k.startswith("state.")}
    assert sorted(state) == sorted(model.state_dict())  # no new tensor on the default path
    model.load_state_dict(state)
    model.__dict__["_embed"] = torch.nn.Embedding.from_pretrained(saved["embed"])
    with torch.no_grad():
        h0 = model.fuse(saved["aux"])
        h1, l1 = model.step(h0, saved["ids"], saved["pos"])
        h2, l2 = model.step(h1, saved["ids"].roll(-1, 1), saved["pos"] + 1)
    for got, key in ((h0, "h0"), (h1, "h1"), (l1, "l1"), (h2, "h2"), (l2, "l2")):
        torch.testing.assert_close(got, saved[key], **SAVED_TOL, msg=key)


def test_a_config_json_written_before_the_options_reads_them_as_off(target, tmp_path):
    head = _head(target)
    head.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert [cfg.pop(k) for k in ("norm_before_fc", "norm_before_residual", "norm_output")] == [False] * 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = Eagle3Model.from_pretrained(tmp_path)
    assert not (back.config.norm_before_fc or back.config.norm_before_residual or back.config.norm_output)
    assert back.input_norm is None and not back.midlayer.norm_before_residual


def test_norm_before_fc_norms_the_concatenated_features_once_before_fc(target):
    on, off = _head(target, norm_before_fc=True), _head(target)
    assert tuple(on.input_norm.weight.shape) == (3 * 32,) and off.input_norm is None
    aux = torch.randn(2, 5, 96) * 4
    with torch.no_grad():
        assert_close(on.fuse(aux), _rms(aux, on.input_norm.weight) @ on.fc.weight.T)
        assert not torch.allclose(on.fuse(aux), off.fuse(aux), atol=1e-3)
        on.load_state_dict(off.state_dict() | {"input_norm.weight": on.input_norm.weight})  # the rest alike
        assert_close(on.fuse(aux * 7), on.fuse(aux))  # one norm over the whole row: a common scale drops out
    both = _head(target, norm_before_fc=True, fc_norm=True)
    with torch.no_grad():  # vLLM's order: input_norm, then each feature's fc_norm
        ref = torch.cat([_rms(c, n.weight) for c, n in zip(_rms(aux, both.input_norm.weight).chunk(3, -1),
                                                           both.fc_norm)], -1)
        assert_close(both.fuse(aux), ref @ both.fc.weight.T)


def test_norm_before_residual_starts_the_residual_from_the_normed_hidden(target):
    on, off = _head(target, norm_before_residual=True), _head(target)
    assert sorted(on.state_dict()) == sorted(off.state_dict())  # no new tensor: the same weights, another sum
    h = torch.randn(2, 6, 32) * 3
    ids, pos = torch.randint(0, 97, (2, 6)), torch.arange(6).expand(2, 6)
    with torch.no_grad():
        got = on.decode(h, ids, pos)
        assert_close(got, _layer(on, h, ids, pos, residual_from_norm=True))
        assert_close(off.decode(h, ids, pos), _layer(off, h, ids, pos, residual_from_norm=False))
        assert not torch.allclose(got, off.decode(h, ids, pos), atol=1e-3)


def test_norm_output_feeds_the_post_norm_state_back_and_keeps_the_logits(target):
    on, off = _head(target, norm_output=True), _head(target)
    h = torch.randn(2, 6, 32)
    ids, pos = torch.randint(0, 97, (2, 6)), torch.arange(6).expand(2, 6)
    with torch.no_grad():
        pre = _layer(on, h, ids, pos, residual_from_norm=False)
        h1, l1 = on.step(h, ids, pos)
        assert_close(h1, _rms(pre, on.norm.weight))  # what the next step reads
        assert_close(l1, _rms(pre, on.norm.weight) @ on.lm_head.weight.T)  # lm_head reads it as it is
        g1, k1 = off.step(h, ids, pos)
        assert_close(k1, l1) and assert_close(on.normed(h1), off.normed(g1))
        assert not torch.allclose(h1, g1, atol=1e-3)
        nxt = ids.roll(-1, 1)
        h2, l2 = on.step(h1, nxt, pos + 1)
        assert_close(l2, _rms(_layer(on, h1, nxt, pos + 1, False), on.norm.weight) @ on.lm_head.weight.T)
        assert not torch.allclose(l2, off.step(g1, nxt, pos + 1)[1], atol=1e-3)


def test_options_round_trip_through_save_pretrained(target, tmp_path):
    head = _head(target, norm_before_fc=True, norm_before_residual=True, norm_output=True)
    head.save_pretrained(tmp_path)
    back = Eagle3Model.from_pretrained(tmp_path).eval().attach(target)
    cfg = back.config
    assert cfg.norm_before_fc and cfg.norm_before_residual and cfg.norm_output
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())
    h, ids, pos = torch.randn(1, 4, 32), torch.randint(0, 97, (1, 4)), torch.arange(4)[None]
    with torch.no_grad():
        assert torch.equal(back.step(h, ids, pos)[1], head.step(h, ids, pos)[1])
