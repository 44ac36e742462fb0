"""EAGLE-1 head: vLLM layout, concat order, save/load, loss, noise."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from specheads.methods.eagle1 import Eagle1Method
from specheads.models.eagle1 import Eagle1Config, Eagle1Model
from tests.conftest import make_tiny_target

V, H = 150, 64


@pytest.fixture
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=2)


def _batch(target, B=2, T=12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[0, 9:] = 0
    loss_mask = attn.clone()
    loss_mask[:, :2] = 0
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
            "hidden_last": target.forward_features(ids, attn).last}


def test_parameter_layout_matches_vllm_eagle1(target):
    model = Eagle1Method().build(target)
    keys = set(model.state_dict())
    assert "fc.weight" in keys and model.fc.weight.shape == (H, 2 * H) and model.fc.bias is None
    assert "layers.0.input_layernorm.weight" not in keys
    assert {"layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head", "norm")) for k in keys)  # the target's own


def test_fc_reads_embedding_first(target):
    """vLLM concatenates [embed(ids); hidden]: zeroing the hidden half makes the hidden irrelevant."""
    model = Eagle1Method().build(target)
    with torch.no_grad():
        model.fc.weight[:, H:] = 0
    ids = torch.randint(0, V, (1, 4))
    pos = torch.arange(4)[None]
    a = model.decode(torch.randn(1, 4, H), ids, pos)
    b = model.decode(torch.randn(1, 4, H), ids, pos)
    assert_close(a, b)


def test_save_load_round_trip_and_step(target, tmp_path):
    method = Eagle1Method()
    model = method.build(target).eval()
    method.save(model, str(tmp_path), target)
    loaded = Eagle1Model.from_pretrained(tmp_path).attach(target).eval()
    assert isinstance(loaded.config, Eagle1Config)
    h = torch.randn(2, 5, H)
    ids = torch.randint(0, V, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    h1, l1 = model.step(h, ids, pos, None, model.new_cache())
    h2, l2 = loaded.step(h, ids, pos, None, loaded.new_cache())
    assert l1.shape == (2, 5, V)
    assert_close(l1, l2)
    assert_close(l1, target.logits(h1))  # the target's LM head on the predicted feature


def test_loss_is_feature_plus_weighted_ce(target):
    method = Eagle1Method(noise_low=0.0, noise_high=0.0, ce_weight=0.1)
    model = method.build(target)
    batch = _batch(target)
    out = method.loss(model, batch, target)
    assert_close(out.loss.detach(), torch.tensor(out.metrics["feature_loss"] + 0.1 * out.metrics["ce_loss"]))
    # Manual feature loss: predicted feature at t vs the true one at t+1, where ids[t+2] is trained.
    ids, last = batch["input_ids"], batch["hidden_last"]
    nxt = torch.zeros_like(ids)
    nxt[:, :-1] = ids[:, 1:]
    pred = model.decode(last, nxt, torch.arange(ids.shape[1]).expand_as(ids))
    rows = [(b, t) for b in range(2) for t in range(ids.shape[1] - 2) if batch["loss_mask"][b, t + 2]]
    ref = sum(torch.nn.functional.smooth_l1_loss(pred[b, t], last[b, t + 1]) for b, t in rows) / len(rows)
    assert_close(torch.tensor(out.metrics["feature_loss"]), ref.detach(), atol=1e-5, rtol=1e-5)


def test_noise_only_in_training(target):
    method = Eagle1Method(noise_low=-0.5, noise_high=0.5)
    model = method.build(target)
    batch = _batch(target)
    model.eval()
    assert method.loss(model, batch, target).loss.item() == method.loss(model, batch, target).loss.item()
    model.train()
    assert method.loss(model, batch, target).loss.item() != method.loss(model, batch, target).loss.item()
    with pytest.raises(ValueError, match="noise_low"):
        Eagle1Method(noise_low=1.0, noise_high=0.0)


def test_training_reduces_loss_and_evaluate_counts(target):
    method = Eagle1Method(eval_steps=2, noise_low=0.0, noise_high=0.0)
    model = method.build(target).train()
    batch = _batch(target)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        out = method.loss(model, batch, target)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.metrics["feature_loss"])
    assert losses[-1] < 0.5 * losses[0]
    m = method.evaluate(model.eval(), batch, target)
    assert m["step0_total"] == int(batch["loss_mask"][:, 2:].sum()) and m["step1_total"] > 0
