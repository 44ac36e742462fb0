"""DSpark: the Markov and confidence heads' maths, the loss's pieces against hand computation, the detached
confidence target, teacher-forced previous tokens, the DFlash warm start, and a few steps that learn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specheads.data.features import add_features
from specheads.methods import build_method
from specheads.methods import dspark
from specheads.methods.dspark import ce_and_l1, combine, slot_terms
from specheads.methods.losses import pad_rows
from specheads.models.dspark import DSparkConfig, DSparkModel
from tests.conftest import make_tiny_target
from tests.methods.test_dflash import batch_of


@pytest.fixture
def setup():
    target = make_tiny_target("llama", layers=4)
    method = build_method("dspark", block_size=4, anchors=6, num_layers=2)
    torch.manual_seed(0)
    model = method.build(target)
    with torch.no_grad():  # a trained Markov head is not zero
        model.markov_head.markov_w2.weight.normal_(0, 0.5)
    batch = add_features(batch_of(), target, method.feature_spec)
    return target, method, model, batch


def test_config_names_and_shapes_are_vllms():
    target = make_tiny_target("llama", layers=4)
    cfg = DSparkConfig.from_target(target, block_size=4)
    H, V = target.hidden_size, target.vocab_size
    assert cfg.markov_rank == min(256, H) and cfg.model_type == "specheads_dspark" and cfg.markov_head_type == "vanilla"
    model = DSparkModel(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(("markov", "confidence"))}
    r = cfg.markov_rank
    assert shapes == {"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r),
                      "confidence_head.proj.weight": (1, H + r), "confidence_head.proj.bias": (1,)}
    assert not model.markov_head.markov_w2.weight.any()  # a fresh head drafts as its backbone
    assert DSparkConfig.from_target(target, markov_rank=8).markov_rank == 8


def test_markov_bias_and_confidence_are_the_papers_formulas(setup):
    target, _, model, _ = setup
    h = torch.randn(5, target.hidden_size)
    prev = torch.tensor([1, 7, 7, 30, 2])
    w1, w2 = model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight
    want = model.logits(h).float() + w1[prev] @ w2.T
    torch.testing.assert_close(model.draft_logits(h, prev), want)
    proj = model.confidence_head.proj
    z = torch.cat([model.norm(h), w1[prev]], -1) @ proj.weight[0] + proj.bias[0]
    torch.testing.assert_close(model.confidence(h, prev), torch.sigmoid(z))


def test_loss_pieces_equal_a_hand_computation(setup):
    target, _, model, _ = setup
    g = torch.Generator().manual_seed(1)
    h = torch.randn(4, target.hidden_size, generator=g)
    th = torch.randn(4, target.hidden_size, generator=g)
    prev, labels = torch.tensor([3, 4, 5, 6]), torch.tensor([9, 8, 7, 6])
    ce, l1, conf, pred = slot_terms(model, target.logits, h, prev, labels, th)
    q = torch.softmax(model.draft_logits(h, prev), -1)
    p = torch.softmax(target.logits(th).float(), -1)
    torch.testing.assert_close(ce, -torch.log(q[torch.arange(4), labels]))
    torch.testing.assert_close(l1, (p - q).abs().sum(-1))
    torch.testing.assert_close(conf, torch.logit(model.confidence(h, prev)), atol=1e-5, rtol=1e-5)
    w = torch.exp(-torch.arange(4.0) / 4)
    loss, parts = combine(ce, l1, conf, w, 0.1, 0.9, 1.0)
    a = 1 - 0.5 * l1
    c = torch.sigmoid(conf)
    bce = -(a * torch.log(c) + (1 - a) * torch.log(1 - c)).mean()
    want = (w * (0.1 * ce + 0.9 * l1)).sum() / w.sum() + bce
    torch.testing.assert_close(loss, want)
    assert parts["bce"] == pytest.approx(float(bce.detach()), rel=1e-5)


def test_the_confidence_target_is_detached():
    l1 = torch.tensor([0.4, 1.2, 0.1], requires_grad=True)
    ce = torch.tensor([1.0, 2.0, 0.5], requires_grad=True)
    conf = torch.tensor([0.3, -0.2, 1.0], requires_grad=True)
    loss, _ = combine(ce, l1, conf, torch.ones(3), 0.0, 0.0, 1.0)  # the BCE alone
    loss.backward()
    assert l1.grad is None or not l1.grad.any()
    assert ce.grad is None or not ce.grad.any()
    want = (torch.sigmoid(conf.detach()) - (1 - 0.5 * l1.detach())) / 3  # d BCE / d logit
    torch.testing.assert_close(conf.grad, want)


def test_previous_tokens_are_the_anchor_then_the_earlier_slots_labels(setup):
    target, method, model, batch = setup
    h, labels, weights, source = method._blocks(model, batch, target, 3, torch.Generator().manual_seed(2))
    prev = method.previous_tokens(batch, labels, source)
    ids = batch["input_ids"]
    anchors = source[:, :, 1]
    torch.testing.assert_close(prev[:, :, 1], ids.gather(1, anchors))
    torch.testing.assert_close(prev[:, :, 2:], labels[:, :, 1:-1])
    data = build_method("dspark", block_size=4, anchors=6, num_layers=2, labels="data")
    prev_d = data.previous_tokens(batch, labels, source)
    torch.testing.assert_close(prev_d, ids.gather(1, source.reshape(2, -1)).view_as(source))


def test_the_loss_trains_every_part_and_reports_its_pieces(setup):
    target, method, model, batch = setup
    out = method.loss(model, batch, target)
    assert torch.isfinite(out.loss) and {"ce", "l1", "bce", "confidence", "step0_acc"} <= set(out.metrics)
    out.loss.backward()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                 "fc.weight"):
        assert model.get_parameter(name).grad.abs().sum() > 0, name
    ev = method.evaluate(model, batch, target)
    assert ev["step0_total"] > 0 and ev["tv_count"] > 0 and ev["conf_err_count"] == ev["tv_count"]


def test_warm_start_from_a_dflash_head_drafts_as_that_head(tmp_path, setup):
    from specheads.errors import UserError

    target, _, _, batch = setup
    dflash = build_method("dflash", block_size=4, anchors=6, num_layers=2)
    torch.manual_seed(5)
    head = dflash.build(target)
    head.save_pretrained(tmp_path / "dflash")
    dspark = build_method("dspark", block_size=4, anchors=6, num_layers=2, init_from=str(tmp_path / "dflash"))
    model = dspark.build(target)
    h1, *_ = dflash._blocks(head, batch, target, 3, torch.Generator().manual_seed(0))
    h2, *_ = dspark._blocks(model, batch, target, 3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(h1, h2)
    prev = torch.zeros(h1.shape[:-1], dtype=torch.long)
    torch.testing.assert_close(model.draft_logits(h2, prev), head.logits(h1).float())  # markov_w2 starts at zero
    other = build_method("dspark", block_size=6, num_layers=2, init_from=str(tmp_path / "dflash"))
    with pytest.raises(UserError, match="block_size"):
        other.build(target)


def test_save_and_load_round_trip(tmp_path, setup):
    target, method, model, _ = setup
    method.save(model, str(tmp_path), target)
    loaded = DSparkModel.from_pretrained(str(tmp_path)).attach(target)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v)


@pytest.mark.parametrize("bad, match", [({"markov_rank": 0}, "markov_rank"), ({"ce_weight": -1}, "weights"),
                                        ({"ce_weight": 0, "l1_weight": 0}, "weights"),
                                        ({"init_from": "x", "init_layer_from_target": True}, "init_from")])
def test_bad_settings_are_refused(bad, match):
    from specheads.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        build_method("dspark", **bad)


def test_a_few_steps_lower_the_loss_on_a_tiny_store(tmp_path):
    import json

    from specheads.targets import Target
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from tests.families.family_models import make_family_model
    from tests.training.engine_helpers import sources

    target = Target(make_family_model("llama", layers=4), None, "peaked")
    method = build_method("dspark", block_size=4, anchors=8)
    train_src, held = sources(n_train=32, n_eval=8, max_tokens=192)
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=40, eval_every=0, save_every=0, wandb_mode="disabled",
                      progress=False, log_every=1, measure_prompts=0)
    summary = train(method, target, train_src, cfg, OptimConfig(lr=3e-3, warmup_steps=0), held)
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert sum(losses[-8:]) < 0.7 * sum(losses[:8]), losses  # the BCE keeps its entropy floor
    ev = summary["eval"]
    assert ev["step0_acc"] > 0.1 and ev["tv"] < 1.0, ev
    loaded = DSparkModel.from_pretrained(summary["head_dir"]).attach(target)
    assert loaded.config.markov_rank == min(256, target.hidden_size)


def test_dpace_weights_each_block_from_its_draft_cross_entropies(setup):
    """loss=dpace: sum_j w_j (0.1 CE_j + 0.9 L1_j) / counted slots with D-PACE's detached weights computed from the
    draft's (Markov-biased) CE of each block, plus the unchanged confidence BCE; the default decay gives another
    loss."""
    from specheads.methods.losses import dpace_weights

    target, plain, model, batch = setup
    method = build_method("dspark", block_size=4, anchors=6, num_layers=2, loss="dpace")
    assert method.loss_name == "dpace" and method.slot_weights().tolist() == [0.0, 1.0, 1.0, 1.0]
    torch.manual_seed(0)
    got = method.loss(model, batch, target).loss
    torch.manual_seed(0)
    (ce, l1, conf, _), _, _, sel = method._terms(model, batch, target, method.anchors)
    per_slot = torch.zeros(sel.shape)
    per_slot[sel] = ce.detach()
    w = dpace_weights(per_slot, sel)[sel]
    accept = (1 - 0.5 * l1).detach().clamp(0, 1)
    want = (w * (0.1 * ce + 0.9 * l1)).sum() / sel.sum() + F.binary_cross_entropy_with_logits(conf, accept)
    torch.testing.assert_close(got, want)
    torch.manual_seed(0)
    decayed = plain.loss(model, batch, target).loss
    assert torch.isfinite(got) and not torch.allclose(got, decayed)
    model.zero_grad()
    got.backward()  # the weights are constants: the gradient reaches the draft through CE and L1 only
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_dspark_refuses_an_unknown_loss():
    with pytest.raises(ValueError, match="loss must be one of ce, dpace"):
        build_method("dspark", block_size=4, loss="dpase")


def plain_slot_terms(model, target_logits, h, prev, labels, target_h, l1_grad=True):
    """``slot_terms`` before ``ce_and_l1`` (the reference): plain autograd, which keeps every (N, V) step."""
    n = h.shape[0]
    logq = torch.log_softmax(model.draft_logits(h, prev), dim=-1)
    with torch.no_grad():
        p = torch.softmax(target_logits(pad_rows(target_h))[:n].float(), dim=-1)
    ce = F.nll_loss(logq, labels, reduction="none")
    l1 = (p - logq.exp()).abs().sum(-1)
    conf = model.confidence(h, prev, logit=True) if model.confidence_head is not None else None
    return ce, l1, conf, logq.argmax(-1)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.float32)], ids=["f32", "bf16", "bf16+f32"])
@pytest.mark.parametrize("chunk", [1, 3, 7, None])
@pytest.mark.parametrize("l1_grad", [True, False])
def test_ce_and_l1_and_their_gradients_are_the_plain_formulas(dtypes, chunk, l1_grad):
    """Against the plain formula in float64: CE, L1, argmax, and the gradient of any weighted sum of CE and L1
    with respect to both logit inputs (zero on the padding rows); without ``l1_grad`` L1 is a constant."""
    g = torch.Generator().manual_seed(3)
    n, rows, V = 7, 9, 50
    a = (3 * torch.randn(rows, V, generator=g)).to(dtypes[0]).requires_grad_()
    b = torch.randn(rows, V, generator=g).to(dtypes[1]).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=g)
    p = torch.softmax(2 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    w_ce, w_l1 = torch.rand(n, generator=g), torch.rand(n, generator=g)
    ce, l1, pred = ce_and_l1(a, b, labels, lambda s, e: p[s:e].float(), l1_grad, chunk)
    assert l1.requires_grad == l1_grad and not pred.requires_grad
    (w_ce * ce + w_l1 * l1).sum().backward()
    a64, b64 = (x.detach().double().requires_grad_() for x in (a, b))
    logq = torch.log_softmax(a64[:n] + b64[:n], dim=-1)
    ce64, l164 = F.nll_loss(logq, labels, reduction="none"), (p - logq.exp()).abs().sum(-1)
    (w_ce * ce64 + w_l1 * (l164 if l1_grad else l164.detach())).sum().backward()
    torch.testing.assert_close(ce, ce64.float())
    torch.testing.assert_close(l1, l164.float())
    assert torch.equal(pred, logq.argmax(-1))
    for x, x64 in ((a, a64), (b, b64)):
        torch.testing.assert_close(x.grad, x64.grad.to(x.dtype))
        assert not x.grad[n:].any()
    with torch.no_grad():
        ce0, l10, pred0 = ce_and_l1(a, b, labels, lambda s, e: p[s:e].float(), l1_grad, chunk)
    torch.testing.assert_close((ce0, l10), (ce.detach(), l1.detach()))
    assert torch.equal(pred0, pred)


@pytest.mark.parametrize("l1_weight, head_chunk, loss, autocast", [
    (0.9, 2048, "ce", False), (0.9, 5, "ce", False), (0.0, 2048, "dpace", False), (0.0, 5, "ce", False),
    (0.9, 7, "dpace", False), (0.9, 2048, "ce", True), (0.0, 5, "dpace", True)])
def test_the_loss_and_its_gradients_are_the_plain_formulas(monkeypatch, setup, l1_weight, head_chunk, loss, autocast):
    """The whole DSpark loss and every parameter's gradient, as with ``plain_slot_terms``, with and without
    the L1 term, in one chunk of slots or several (recomputed in backward), in float32 or under bfloat16
    autocast (bfloat16 logits: a bfloat16 rounding apart at most)."""
    target, _, model, batch = setup
    method = build_method("dspark", block_size=4, anchors=6, num_layers=2, l1_weight=l1_weight,
                          head_chunk=head_chunk, loss=loss)

    def run():
        model.zero_grad()
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = method.loss(model, batch, target)
        out.loss.backward()
        return out.loss.detach(), {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}

    got, got_grads = run()
    monkeypatch.setattr(dspark, "slot_terms", plain_slot_terms)
    want, want_grads = run()
    tol = dict(rtol=1.6e-2, atol=1e-5) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **tol)
    assert got_grads.keys() == want_grads.keys() and "markov_head.markov_w2.weight" in got_grads
    for name, w in want_grads.items():
        # under autocast a gradient element sums bfloat16-rounded products: its error scales with the largest
        # terms (the tensor's largest gradient), not with the element, which may be near 0 (MKL's AVX2 kernels)
        scale = dict(atol=max(tol["atol"], tol["rtol"] * float(w.abs().max()))) if autocast else {}
        torch.testing.assert_close(got_grads[name], w, **{**tol, **scale}, msg=lambda m, n=name: f"{n}: {m}")
