"""The draft layer's sliding window and Qwen3 q/k norms (specheads/models/layers.py), as vLLM speculators 0.9 trains
them: each against a reference written here from speculators' rule, in training (the training-time test, P-EAGLE's
packed mask) and in drafting; the default path as before
the options existed (to float32 rounding: the saved outputs were made on another CPU, whose kernels may round a
last bit otherwise).

``data/eagle3_layer_default.safetensors`` holds a tiny EAGLE-3 and P-EAGLE head's states, inputs and outputs (a
3-step unroll, a prompt then a tree level through the KV cache, P-EAGLE's packed mask and unroll) written by the code
before these options (commit 71da0c2).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from specheads.decoding.drafters import TreeShape
from specheads.decoding.head_drafters import EagleDrafter
from specheads.decoding.peagle_drafter import PEagleDrafter
from specheads.methods.ttt import unroll
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.layers import DraftDecoderLayer
from specheads.models.peagle import PEagleConfig, PEagleModel, parallel_attention_mask, parallel_window_mask
from tests.conftest import make_tiny_target

DATA = Path(__file__).parent / "data"
SAVED_TOL = dict(rtol=1e-5, atol=1e-5)
"""A few float32 ulps at these magnitudes (a CPU rounds a matmul's last bit its own way); an option leaking into
the default path moves the outputs by orders more."""
AUX, DV = (0, 1, 3), 50


@pytest.fixture(scope="module")
def target():
    return make_tiny_target("llama", vocab=97, hidden=32, layers=4, heads=4, kv_heads=2)


def _random(model, seed: int = 3):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval()


def eagle3(target, **options) -> Eagle3Model:
    return _random(Eagle3Model(Eagle3Config.from_target(target, DV, AUX, **options))).attach(target)


def peagle(target, **options) -> PEagleModel:
    cfg = PEagleConfig.from_target(target, DV, AUX, num_layers=2, num_depths=3, **options)
    return _random(PEagleModel(cfg)).attach(target)


# --------------------------------------------------------------------------- default off: as before


def test_default_heads_compute_what_they_did_before_the_options():
    saved = load_file(str(DATA / "eagle3_layer_default.safetensors"))
    target = make_tiny_target("llama", vocab=97, hidden=32, layers=4, heads=4, kv_heads=2)
    e3 = Eagle3Model(Eagle3Config.from_target(target, DV, AUX)).eval()
    pe = PEagleModel(PEagleConfig.from_target(target, DV, AUX, num_layers=2, num_depths=3)).eval()
    for prefix, m in (("e3.", e3), ("pe.", pe)):
        state = {k[len(prefix):]: v for k, v in saved.items() if k.startswith(prefix) and k[len(prefix):]
                 in m.state_dict()}
        assert sorted(state) == sorted(m.state_dict())  # no new tensor on the default path
        m.load_state_dict(state)
        m.__dict__["_embed"] = torch.nn.Embedding.from_pretrained(saved["embed"])
    aux, ids, pos = saved["aux"], saved["ids"], saved["pos"]
    got = {}
    with torch.no_grad():
        h0 = e3.fuse(aux)
        got.update({f"e3.unroll{i}": h for i, h in unroll(e3, h0, ids, 3)})
        cache = e3.new_cache()
        got["e3.prompt_h"], got["e3.prompt_l"] = e3.step(h0[:, :6], ids[:, :6], pos[:, :6], None, cache)
        got["e3.tree_h"], got["e3.tree_l"] = e3.step(got["e3.prompt_h"][:, -3:], ids[:, 6:9], saved["tpos"],
                                                     saved["tree_mask"], cache)
        mask = parallel_attention_mask(saved["pe.anchor"], saved["pe.depth"], torch.ones(2, 10, dtype=torch.bool))
        got["pe.out"] = pe.decode(saved["pe.hin"], saved["pe.ids"], saved["pe.pos"], mask, None)
        got.update({f"pe.unroll{i}": h for i, h in unroll(pe, saved["pe.hin"], saved["pe.ids"], 2)})
    for key, value in got.items():
        torch.testing.assert_close(value, saved[key], **SAVED_TOL, msg=key)


# --------------------------------------------------------------------------- references from speculators' rules


def _attention(q, k, v, allowed):
    """Plain softmax attention: q (nh, Q, D), k/v (nkv, K, D), allowed (Q, K) bool."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def _qkv(attn, x, cos, sin):
    """q (nh, q, D), k, v (nkv, q, D) of ``DraftAttention`` ``attn`` on x (1, q, in): Qwen3's per-head norms
    written out (RMS over each head's D, times the weight) before RoPE."""
    n, D = x.shape[1], attn.head_dim

    def heads(lin, norm, count):
        t = lin(x).view(1, n, count, D)
        if norm is not None:
            t = norm.weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
        return t.transpose(1, 2)

    q, k = heads(attn.q_proj, attn.q_norm, attn.num_heads), heads(attn.k_proj, attn.k_norm, attn.num_kv_heads)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0], k[0], heads(attn.v_proj, None, attn.num_kv_heads)[0]


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_unroll(model, h0, ids, steps, window):
    """speculators' training-time test (eagle3/core.py + attention.py) for one row: step 0 causal with
    ``kv > q - window``; step s's keys attended on the diagonal only. Returns the outputs of every step."""
    mid, eps = model.midlayer, model.config.rms_norm_eps
    T = ids.shape[1]
    keys, values, outs, h = [], [], [], h0
    t_idx = torch.arange(T)
    for s in range(steps):
        tok = torch.cat([ids[:, 1 + s:], ids.new_zeros(1, 1 + s)], 1)[:, :T]
        x = torch.cat([_rms(model.embed(tok), mid.input_layernorm.weight, eps), _rms(h, mid.hidden_norm.weight, eps)],
                      -1)
        cos, sin = model.rotary_emb(h, (t_idx + s)[None])
        q, k, v = _qkv(mid.self_attn, x, cos, sin)
        keys.append(k)
        values.append(v)
        blocks = [(t_idx[None] <= t_idx[:, None]) & (t_idx[None] > t_idx[:, None] - (window or 10 ** 9))]
        blocks += [torch.eye(T, dtype=torch.bool)] * s
        o = _attention(q, torch.cat(keys, 1), torch.cat(values, 1), torch.cat(blocks, 1))
        o = mid.self_attn.o_proj(o.transpose(0, 1).reshape(1, T, -1))
        a = h + o
        h = a + mid.mlp(_rms(a, mid.post_attention_layernorm.weight, eps))
        outs.append(h)
    return outs


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_unroll_with_a_window_is_speculators_training_time_test(target, qk_norm):
    torch.manual_seed(0)
    aux, ids = torch.randn(1, 12, 96), torch.randint(0, 97, (1, 12))
    model = eagle3(target, sliding_window=4, qk_norm=qk_norm)
    with torch.no_grad():
        h0 = model.fuse(aux)
        got = [h for _, h in unroll(model, h0, ids, 3)]
        ref = reference_unroll(model, h0, ids, 3, 4)
        full = [h for _, h in unroll(eagle3(target, qk_norm=qk_norm), h0, ids, 3)]
    for g, r, f in zip(got, ref, full):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(g, f, atol=1e-3)  # a window shorter than the context changes the outputs
    torch.testing.assert_close(got[0][:, :4], full[0][:, :4])  # ... only past the window


def test_a_window_as_long_as_the_context_changes_nothing(target):
    torch.manual_seed(0)
    aux, ids = torch.randn(2, 12, 96), torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        h0 = eagle3(target).fuse(aux)
        for W in (12, 100):
            long = [h for _, h in unroll(eagle3(target, sliding_window=W), h0, ids, 3)]
            full = [h for _, h in unroll(eagle3(target), h0, ids, 3)]
            assert all(torch.equal(a, b) for a, b in zip(long, full))


def test_qk_norm_layer_is_transformers_qwen3_decoder_layer(target):
    """A plain draft layer (P-EAGLE's layers after the first) with qk_norm computes transformers' Qwen3 layer."""
    cfg = Eagle3Config.from_target(target, DV, AUX, qk_norm=True)
    ours = _random(DraftDecoderLayer(cfg, layer=1))
    names = {n for n, _ in ours.named_parameters()}
    assert {"self_attn.q_norm.weight", "self_attn.k_norm.weight"} <= names
    qcfg = Qwen3Config(hidden_size=32, intermediate_size=cfg.intermediate_size, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, rms_norm_eps=cfg.rms_norm_eps, num_hidden_layers=1,
                       hidden_act=cfg.hidden_act, rope_parameters=dict(cfg.rope_parameters))
    qcfg._attn_implementation = "eager"
    theirs = Qwen3DecoderLayer(qcfg, 0).eval()
    theirs.load_state_dict(ours.state_dict())
    x, pos = torch.randn(1, 7, 32), torch.arange(7)[None]
    cos, sin = Qwen3RotaryEmbedding(qcfg)(x, pos)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        got = ours(x, cos, sin)
        ref = theirs(x, attention_mask=causal, position_embeddings=(cos, sin), position_ids=pos)
        plain = _random(DraftDecoderLayer(Eagle3Config.from_target(target, DV, AUX), layer=1))
        plain.load_state_dict({k: v for k, v in ours.state_dict().items() if "_norm.weight" not in k or "layernorm" in k})
    torch.testing.assert_close(got, ref[0] if isinstance(ref, tuple) else ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(plain(x, cos, sin), got, atol=1e-3)  # the norms change the output


# --------------------------------------------------------------------------- drafting


def _feats(aux):
    from types import SimpleNamespace

    return SimpleNamespace(hidden_last=None, hidden_aux=aux)


@pytest.mark.parametrize("window", [3, 50])
def test_drafting_with_a_window_is_the_unroll_at_the_root(target, window):
    """A chain drafted by EagleDrafter gives, at each depth, the distribution of the training-time test's step at the
    root, fed the drafted tokens: the window counts from the root (speculators' TTT), and a window longer than the
    context leaves the draft as without one."""
    torch.manual_seed(1)
    model = eagle3(target, sliding_window=window)
    model.set_draft_vocab(torch.arange(DV) * 0, torch.arange(97) < DV)  # draft id i = target id i
    prompt = torch.randint(0, DV, (11,)).tolist()
    aux = torch.randn(1, 11, 96)
    d = EagleDrafter(model, TreeShape("chain", k=3), "eagle3")
    d.start([prompt], _feats(aux))
    (tree,) = d.propose([prompt], [True], 1.0, torch.Generator().manual_seed(0))
    ids = torch.tensor([prompt + tree.tokens.tolist()[:2]])
    T, r = ids.shape[1], len(prompt) - 2  # the root: the last pair (feature at r, token r + 1)
    with torch.no_grad():
        h0 = model.fuse(torch.cat([aux, torch.zeros(1, T - 11, 96)], 1))
        ref = reference_unroll(model, h0, ids, 3, window)
        full = [h for _, h in unroll(eagle3(target), h0, ids, 3)]
    for s in range(3):
        torch.testing.assert_close(tree.q[s][:DV].float(),  # q over the target vocabulary; draft id i = target id i
                                   torch.softmax(model.logits(ref[s][0, r]).double(), -1).float(), rtol=1e-4, atol=1e-5)
    changed = not torch.allclose(tree.q[2][:DV].float(),
                                 torch.softmax(model.logits(full[2][0, r]).double(), -1).float(), atol=1e-4)
    assert changed == (window < r)


def test_a_tree_node_keeps_its_ancestors_and_the_window_of_its_root(target):
    model = eagle3(target, sliding_window=2)
    d = EagleDrafter(model, TreeShape("dynamic", depth=2, topk=2, total_tokens=4), "eagle3")
    d.start([list(range(6))], _feats(torch.randn(1, 6, 96)))
    d._feed_pending([True])  # commits positions 0..4: the root is 4
    pos, mask = d.slots.extend(torch.tensor([[-1, -1]]), torch.ones(1, 2, dtype=torch.bool))
    window = d._window(pos, verified=False)
    assert window[0].tolist() == [[False, False, False, True, True, True, True]] * 2  # keys 3, 4 and the new nodes
    d.slots.extend(torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool))
    pos = d.slots.scratch_pos[:, -1:]
    assert d._window(pos, verified=False)[0, 0].tolist()[:5] == [False, False, False, True, True]


def test_peagle_packed_mask_with_a_window_is_speculators(target):
    """parallel_attention_mask & parallel_window_mask against speculators' peagle_mask_mod rule written out."""
    anchor = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 3, 4, 6, 0, 3, 6]])
    depth = torch.tensor([0] * 8 + [1] * 5 + [2] * 3)
    W = 3
    got = parallel_attention_mask(anchor, depth, torch.ones(1, 16, dtype=torch.bool)) & parallel_window_mask(
        anchor, depth, W)
    a, dd = anchor[0].tolist(), depth.tolist()
    ref = torch.tensor([[(dd[k] == 0 and a[q] >= a[k] and a[k] > a[q] + dd[q] - W) or (a[q] == a[k] and dd[q] >= dd[k])
                         for k in range(16)] for q in range(16)])
    assert torch.equal(got[0], ref)
    assert not torch.equal(got[0], parallel_attention_mask(anchor, depth, torch.ones(1, 16, dtype=torch.bool))[0])


@pytest.mark.parametrize("window", [2, 40])
def test_peagle_drafting_with_a_window_is_its_packed_training_forward(target, window):
    """P-EAGLE's drafter (pending pairs then K-1 mask slots in one forward) gives the logits of the packed training
    forward over the same entries under speculators' mask (the window counted from each query's own position)."""
    torch.manual_seed(2)
    model = peagle(target, sliding_window=window, qk_norm=True)
    model.set_draft_vocab(torch.arange(DV) * 0, torch.arange(97) < DV)
    prompt, aux = torch.randint(0, DV, (9,)).tolist(), torch.randn(1, 9, 96)
    d = PEagleDrafter(model)
    d.start([prompt], _feats(aux))
    d.propose([prompt], [True], 0.0, None)
    n, K = len(prompt) - 1, 3
    anchor = torch.tensor([list(range(n)) + [n - 1] * (K - 1)])
    depth = torch.tensor([0] * n + list(range(1, K)))
    with torch.no_grad():
        hidden = torch.cat([model.fuse(aux[:, :n]), model.mask_state()[None].expand(1, K - 1, -1)], 1)
        tokens = torch.tensor([prompt[1:] + [int(model.config.mask_token_id)] * (K - 1)])
        valid = torch.ones(1, n + K - 1, dtype=torch.bool)
        mask = parallel_attention_mask(anchor, depth, valid)
        h = model.decode(hidden, tokens, anchor + depth, mask, None,
                         window_mask=parallel_window_mask(anchor, depth, window))
        full = model.decode(hidden, tokens, anchor + depth, mask, None, window_mask=torch.ones_like(mask))
    torch.testing.assert_close(d.last_logits[0].float(), model.logits(h[0, n - 1:]).float(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(h, full) == (window >= n + K)
