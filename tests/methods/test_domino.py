"""Domino: the config and tensor names, the GRU reading only the block's earlier tokens, the two-part loss against a
hand computation, the decaying mix, save/load, and a few steps that learn on a tiny target."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specheads.data.features import add_features
from specheads.methods.domino import DominoMethod, mix_weight
from specheads.models.domino import DominoConfig, DominoModel
from tests.conftest import make_tiny_target
from tests.methods.test_dflash import batch_of


def _setup(shift_label=True, labels="target"):
    target = make_tiny_target("llama", layers=4)
    method = DominoMethod(block_size=4, anchors=6, num_layers=2, shift_label=shift_label, labels=labels,
                          lambda_base_start=0.3, total_steps=None)
    torch.manual_seed(0)
    model = method.build(target)
    batch = add_features(batch_of(), target, method.feature_spec)
    return target, method, model, batch


@pytest.fixture
def setup():
    return _setup()


def test_config_and_tensor_names_are_modelopts():
    target = make_tiny_target("llama", layers=4)
    cfg = DominoConfig.from_target(target, block_size=4)
    H, V = target.hidden_size, target.vocab_size
    G, E = cfg.gru_hidden_dim, cfg.emb_dim
    assert (G, E) == (min(1024, H), min(256, H)) and cfg.shift_label is True and cfg.pure_draft_prefix_len == 1
    assert cfg.model_type == "specheads_domino"
    shapes = {k: tuple(v.shape) for k, v in DominoModel(cfg).state_dict().items()
              if k.startswith(("prefix_gru", "embed_proj"))}
    assert shapes == {"prefix_gru.weight_ih_l0": (3 * G, H), "prefix_gru.weight_hh_l0": (3 * G, G),
                      "embed_proj.0.weight": (E, H + G), "embed_proj.2.weight": (V, E)}
    assert DominoModel(cfg).suffix_start == 1
    assert DominoModel(DominoConfig.from_target(target, block_size=4, shift_label=False)).suffix_start == 2


@pytest.mark.parametrize("shift_label", [True, False])
def test_block_logits_shapes_and_the_correction_formula(shift_label):
    target, _, model, _ = _setup(shift_label)
    N, bs, H = 3, model.block_size, target.hidden_size
    h = torch.randn(N, bs, H)
    prefix = torch.randint(0, target.vocab_size, (N, bs))
    z = model.block_logits(h, prefix)
    assert z.shape == (N, bs, target.vocab_size) and z.dtype == torch.float32
    s, f = model.suffix_start, model.first_slot
    torch.testing.assert_close(z[:, :s], model.logits(h[:, :s]).float())
    for k in range(s, bs):  # slot k predicts x[a+m], m = k + 1 - f: the GRU over x[a..a+m-1]
        m = k + 1 - f
        _, g = model.gru_states(prefix[:, :m])
        want = model.logits(h[:, k]).float() + model.embed_proj(torch.cat([model.norm(h[:, k]), g[0]], -1)).float()
        torch.testing.assert_close(z[:, k], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shift_label", [True, False])
def test_the_gru_sees_only_the_blocks_earlier_tokens(shift_label):
    target, _, model, _ = _setup(shift_label)
    with torch.no_grad():
        model.embed_proj[2].weight.normal_(0, 1.0)
    N, bs = 2, model.block_size
    h = torch.randn(N, bs, target.hidden_size)
    prefix = torch.randint(0, target.vocab_size, (N, bs))
    z = model.block_logits(h, prefix)
    f = model.first_slot
    for i in range(bs - f):  # change token x[a+i]: slots predicting x[a+m], m <= i, must not move; m = i + 1 must
        other = prefix.clone()
        other[:, i] = (other[:, i] + 1) % target.vocab_size
        z2 = model.block_logits(h, other)
        for k in range(bs):
            m = k + 1 - f
            if m <= i or k < model.suffix_start:
                torch.testing.assert_close(z2[:, k], z[:, k], msg=f"slot {k} saw token {i}")
            elif m == i + 1:
                assert not torch.allclose(z2[:, k], z[:, k]), f"slot {k} did not see token {i}"


def test_the_gru_reads_the_anchor_then_the_labels(setup):
    target, method, model, batch = setup
    h, labels, weights, prefix = method._blocks(model, batch, target, 3, torch.Generator().manual_seed(0))
    assert prefix.shape == labels.shape == weights.shape == h.shape[:-1]
    torch.testing.assert_close(prefix[:, :, 1:], labels[:, :, :-1])  # shifted: slot k is labelled x[a+k+1]
    data = DominoMethod(block_size=4, anchors=6, num_layers=2, labels="data")
    _, ldata, wdata, pdata = data._blocks(model, batch, target, 3, torch.Generator().manual_seed(0))
    anchors, _ = data.sample_anchors(batch, 3, torch.Generator().manual_seed(0))
    ids, T = batch["input_ids"], batch["input_ids"].shape[1]
    pos = anchors[:, :, None] + torch.arange(4)  # x[a..a+3]: what the GRU reads (labels=data)
    torch.testing.assert_close(pdata, ids.gather(1, pos.clamp(max=T - 1).flatten(1)).view_as(pdata))
    counted = wdata > 0
    want = ids.gather(1, (pos + 1).clamp(max=T - 1).flatten(1)).view_as(ldata)  # slot k labelled x[a+k+1]
    torch.testing.assert_close(ldata[counted], want[counted])
    assert bool(counted[:, :, 0].any())  # slot 0 counts when shifted


def test_the_loss_is_the_two_part_mix_by_hand(setup):
    target, method, model, batch = setup
    with torch.no_grad():
        model.embed_proj[2].weight.normal_(0, 0.3)
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    h, labels, weights, prefix = method._blocks(model, batch, target, method.anchors, gen())
    sel = weights > 0
    w = weights[sel]
    assert torch.allclose(weights[sel], torch.exp(-(torch.arange(4.0).expand_as(sel)[sel]) / 7.0))  # exp(-k/gamma)
    final = model.block_logits(h.flatten(0, 1), prefix.flatten(0, 1)).view(*sel.shape, -1)
    base = model.logits(h).float()
    ce = lambda z: -torch.log_softmax(z[sel], -1).gather(1, labels[sel][:, None])[:, 0]  # noqa: E731
    want = 0.7 * (ce(final) * w).sum() / w.sum() + 0.3 * (ce(base) * w).sum() / w.sum()
    method.sample_anchors = (lambda orig: lambda b, n, g=None: orig(b, n, gen()))(method.sample_anchors)
    out = method.loss(model, batch, target)
    torch.testing.assert_close(out.loss, want, atol=1e-5, rtol=1e-5)
    assert out.metrics["lambda"] == pytest.approx(0.3) and "step0_acc" in out.metrics
    out.loss.backward()
    for name in ("prefix_gru.weight_ih_l0", "prefix_gru.weight_hh_l0", "embed_proj.0.weight", "embed_proj.2.weight",
                 "fc.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name


def test_the_mix_decays_linearly_to_zero():
    assert mix_weight(0, 1.0, 1.0, 100) == 1.0 and mix_weight(50, 1.0, 1.0, 100) == pytest.approx(0.5)
    assert mix_weight(25, 1.0, 0.5, 100) == pytest.approx(0.5) and mix_weight(80, 1.0, 0.5, 100) == 0.0
    assert mix_weight(10 ** 6, 0.8, 1.0, None) == 0.8
    assert mix_weight(10, 1.0, 1.0, 100, 0.75) == pytest.approx(0.25)  # a time budget three quarters used
    assert mix_weight(10, 1.0, 0.5, None, 0.25) == pytest.approx(0.5) and mix_weight(0, 1.0, 0.0, 10) == 0.0
    method = DominoMethod(total_steps=10)
    method.on_step_start(5)
    assert method.mix == pytest.approx(0.5)
    timed = DominoMethod(total_steps=10 ** 6, budget_minutes=1.0)
    timed.on_step_start(0)
    timed._started -= 45.0  # three quarters of the minute used
    assert timed.mix == pytest.approx(0.25, abs=0.01)


def test_save_and_load_round_trip(tmp_path, setup):
    target, method, model, _ = setup
    method.save(model, str(tmp_path), target)
    loaded = DominoModel.from_pretrained(str(tmp_path)).attach(target)
    assert loaded.config.shift_label is True and loaded.config.pure_draft_prefix_len == 1
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


@pytest.mark.parametrize("bad", [{"lambda_base_start": 1.5}, {"lambda_base_decay_ratio": -1},
                                 {"pure_draft_prefix_len": -1}, {"total_steps": 0}, {"gru_hidden_dim": 0},
                                 {"budget_minutes": 0}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="domino"):
        DominoMethod(**bad)


def test_a_few_steps_lower_the_loss_on_a_tiny_store(tmp_path):
    import json

    from specheads.targets import Target
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from tests.families.family_models import make_family_model
    from tests.training.engine_helpers import sources

    target = Target(make_family_model("llama", layers=4), None, "peaked")
    method = DominoMethod(block_size=4, anchors=8, total_steps=30, lambda_base_decay_ratio=0.5)
    train_src, held = sources(n_train=32, n_eval=8, max_tokens=192)
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=30, eval_every=0, save_every=0, wandb_mode="disabled",
                      progress=False, log_every=1, measure_prompts=2, measure_tokens=8)
    summary = train(method, target, train_src, cfg, OptimConfig(lr=3e-3, warmup_steps=0), held)
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    losses = [r["loss"] for r in rows]
    assert sum(losses[-6:]) < 0.7 * sum(losses[:6]), losses
    assert rows[0]["lambda"] == 1.0 and rows[-1]["lambda"] == 0.0
    assert summary["eval"]["step0_acc"] > 0.1, summary["eval"]
    assert summary["eval"]["measured_tau"] >= 1.0 and summary["eval"]["measured_k"] == 3  # the drafter, a chain of B-1
    loaded = DominoModel.from_pretrained(summary["head_dir"]).attach(target)
    assert loaded.config.gru_hidden_dim == min(1024, target.hidden_size)


@pytest.mark.parametrize("shift_label", [True, False])
def test_held_out_metrics_cover_the_b_minus_1_drafted_tokens(shift_label):
    target, method, model, batch = _setup(shift_label)
    ev = method.evaluate(model, batch, target)
    assert sorted(k for k in ev if k.endswith("_total") and k.startswith("step")) == [
        f"step{i}_total" for i in range(method.block_size - 1)]
    assert all(ev[f"joint{i}_correct"] <= ev[f"step{i}_correct"] for i in range(method.block_size - 1))
