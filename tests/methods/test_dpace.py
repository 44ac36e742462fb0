"""D-PACE for DFlash (``loss=dpace``): the weights, their detachment and masking, a few steps learn, the setting."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specheads.data.features import add_features
from specheads.errors import ConfigError
from specheads.methods import build_method
from specheads.methods.losses import dpace_weights
from tests.conftest import make_tiny_target
from tests.methods.test_dflash import batch_of

ROOT = Path(__file__).resolve().parents[2]
LN2, LN4 = math.log(2.0), math.log(4.0)


def test_weights_equal_a_hand_computed_block():
    # slot 0 is the anchor (not counted); exp(-CE) = 1, 1/2, 1/4 give q~ = 1, 3/4, 5/8
    ce = torch.tensor([[9.0, 0.0, LN2, LN4]])
    mask = torch.tensor([[False, True, True, True]])
    # reach: 1, 3/4, 15/32; w_j = the sum of the reaches from j on
    want = torch.tensor([[0.0, 1 + 0.75 + 15 / 32, 0.75 + 15 / 32, 15 / 32]])
    torch.testing.assert_close(dpace_weights(ce, mask), want)


def test_weights_of_several_blocks_are_independent():
    ce = torch.tensor([[0.0, LN2, LN4], [LN4, 0.0, LN2]])
    mask = torch.ones_like(ce, dtype=torch.bool)
    both = dpace_weights(ce, mask)
    torch.testing.assert_close(both[0], dpace_weights(ce[:1], mask[:1])[0])
    torch.testing.assert_close(both[1], dpace_weights(ce[1:], mask[1:])[0])
    # q~ = 5/8, 1, 3/4: reach 5/8, 5/8, 15/32
    torch.testing.assert_close(both[1], torch.tensor([0.625 + 0.625 + 15 / 32, 0.625 + 15 / 32, 15 / 32]))


def test_padding_after_a_block_changes_no_weight_whatever_it_holds():
    ce = torch.tensor([[0.3, 1.2, 0.1]])
    short = dpace_weights(ce, torch.ones_like(ce, dtype=torch.bool))
    mask = torch.tensor([[True, True, True, False, False]])
    for pad in ([0.0, 0.0], [50.0, 0.0], [float("inf"), float("nan")]):
        padded = dpace_weights(torch.cat([ce, torch.tensor([pad])], 1), mask)
        torch.testing.assert_close(padded[:, :3], short)
        assert padded[:, 3:].eq(0).all()


def test_a_masked_slot_inside_a_block_is_left_out_of_the_products_and_the_sums():
    """A slot whose label is not an assistant token (a turn boundary inside the block) weighs 0 and the other
    slots weigh what they would in the block without it: its cross-entropy feeds no product."""
    kept = torch.tensor([[0.3, 1.2, 0.1]])
    without = dpace_weights(kept, torch.ones_like(kept, dtype=torch.bool))
    mask = torch.tensor([[True, False, True, True]])
    for gap in (0.0, 7.0, float("nan")):
        w = dpace_weights(torch.tensor([[0.3, gap, 1.2, 0.1]]), mask)
        assert w[0, 1] == 0
        torch.testing.assert_close(w[:, [0, 2, 3]], without)


def test_weights_carry_no_gradient():
    ce = torch.tensor([[0.5, 1.0, 2.0]], requires_grad=True)
    w = dpace_weights(ce, torch.ones(1, 3, dtype=torch.bool))
    assert not w.requires_grad


@pytest.fixture
def setup():
    target = make_tiny_target("llama", layers=4)
    method = build_method("dflash", block_size=4, anchors=64, num_layers=2, loss="dpace")
    model = method.build(target)
    batch = add_features(batch_of(), target, method.feature_spec)
    return target, method, model, batch


def _reference_loss(method, model, batch, target, detach: bool) -> torch.Tensor:
    """sum_j w_j CE_j / (counted slots), the weights written out slot by slot (held constant when ``detach``)."""
    h, labels, weights, _ = method._blocks(model, batch, target, method.anchors)
    counted = weights > 0
    ce = F.cross_entropy(model.logits(h).float().flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    ce = torch.where(counted, ce, torch.zeros_like(ce))
    src = ce.detach() if detach else ce
    q = torch.where(counted, 0.5 * torch.exp(-src) + 0.5, torch.ones_like(src))
    S = q.shape[-1]
    reach = [torch.stack([q[..., i] for i in range(m + 1)]).prod(0) * counted[..., m] for m in range(S)]
    w = torch.stack([sum(reach[m] for m in range(j, S)) for j in range(S)], -1) * counted
    return (w * ce).sum() / counted.sum()


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gradients_are_those_of_the_weighted_cross_entropy_with_the_weights_held_constant(setup):
    target, method, model, batch = setup
    torch.manual_seed(0)  # the anchors' draw
    out = method.loss(model, batch, target).loss
    got = _grads(model, out)
    torch.manual_seed(0)
    ref = _reference_loss(method, model, batch, target, detach=True)
    torch.testing.assert_close(out, ref)
    for g, r in zip(got, _grads(model, ref), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    torch.manual_seed(0)  # the same loss with gradient through the weights: the check above can tell them apart
    through = _grads(model, _reference_loss(method, model, batch, target, detach=False))
    assert any(not torch.allclose(g, t, rtol=1e-3, atol=1e-6) for g, t in zip(got, through, strict=True))


def test_padding_a_row_leaves_the_loss_unchanged(setup):
    """Every anchor is drawn (anchors >= candidates), so the blocks are the same; the padded positions hold
    garbage features and ids and no attention or loss mask."""
    target, method, model, batch = setup
    torch.manual_seed(0)
    plain = method.loss(model, batch, target).loss
    pad = 5
    padded = {}
    for k, v in batch.items():
        if not torch.is_tensor(v) or v.dim() < 2:
            padded[k] = v
            continue
        extra = v[:, :pad].clone()
        if v.is_floating_point():
            extra = torch.randn_like(extra) * 10
        elif k in ("attention_mask", "loss_mask"):
            extra = torch.zeros_like(extra)
        else:
            extra = torch.randint_like(extra, target.vocab_size)
        padded[k] = torch.cat([v, extra], 1)
    torch.manual_seed(0)
    torch.testing.assert_close(method.loss(model, padded, target).loss, plain)


def test_slot_weights_are_one_after_the_anchor():
    method = build_method("dflash", block_size=4, gamma=2.0, loss="dpace")
    assert method.slot_weights().tolist() == [0.0, 1.0, 1.0, 1.0]


def test_dpace_differs_from_the_decayed_cross_entropy(setup):
    target, method, model, batch = setup
    plain = build_method("dflash", block_size=4, anchors=64, num_layers=2)
    torch.manual_seed(0)
    a = plain.loss(model, batch, target).loss
    torch.manual_seed(0)
    b = method.loss(model, batch, target).loss
    assert torch.isfinite(b) and not torch.allclose(a, b)


def test_a_few_steps_learn_the_targets_greedy_tokens(tmp_path):
    import json

    from specheads.targets import Target
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from tests.families.family_models import make_family_model
    from tests.training.engine_helpers import sources

    target = Target(make_family_model("llama", layers=4), None, "peaked")  # context-dependent, peaked next tokens
    method = build_method("dflash", block_size=4, anchors=8, loss="dpace")
    train_src, held = sources(n_train=32, n_eval=8, max_tokens=192)
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=60, eval_every=0, save_every=0, wandb_mode="disabled",
                      progress=False, log_every=1, measure_prompts=0)
    summary = train(method, target, train_src, cfg, OptimConfig(lr=3e-3, warmup_steps=0), held)
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert sum(losses[-10:]) < 0.25 * sum(losses[:10]), losses
    ev = summary["eval"]
    assert ev["step0_acc"] > 0.1 and ev["tau_joint"] > 1.1, ev  # chance is 1/256


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from tests.training.test_train_recipe import load_recipe

    recipe = load_recipe()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return recipe, compose("train", ["method=dflash", "output_dir=unused", *overrides])


def test_the_config_selects_dpace():
    recipe, cfg = _compose("method.loss=dpace")
    _, _, mcfg = recipe.to_configs(cfg)
    method = build_method(mcfg.pop("name"), **mcfg)
    assert method.loss_name == "dpace"
    recipe, cfg = _compose()
    assert cfg.method.loss == "ce"


def test_an_unknown_loss_is_one_line_naming_the_allowed_values():
    recipe, cfg = _compose("method.loss=dpase")
    with pytest.raises(ConfigError) as e:
        recipe.run(cfg)  # refused before the target loads
    msg = str(e.value)
    assert "\n" not in msg and "loss" in msg and "ce" in msg and "dpace" in msg and "dpase" in msg, msg


def test_dpace_with_the_lk_mix_is_refused():
    with pytest.raises(ConfigError, match="lk_weight"):
        build_method("dflash", loss="dpace", lk_weight=0.5)
