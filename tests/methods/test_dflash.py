"""DFlash: the block mask, the anchors, training and drafting agree, and a few steps learn."""

from __future__ import annotations

import pytest
import torch

from specheads.data.features import add_features
from specheads.methods import build_method
from specheads.models.dflash import DFlashModel, block_attention_mask
from tests.conftest import make_tiny_target
from tests.training.engine_helpers import progression_rows


def batch_of(n: int = 2, length: int = 24, seed: int = 0) -> dict:
    rows = progression_rows(n, length=length, seed=seed)
    T = min(map(len, rows["input_ids"]))
    b = {"input_ids": torch.tensor([r[:T] for r in rows["input_ids"]]),
         "loss_mask": torch.tensor([r[:T] for r in rows["loss_mask"]])}
    b["attention_mask"] = torch.ones_like(b["input_ids"])
    return b


@pytest.fixture
def setup():
    target = make_tiny_target("llama", layers=4)
    method = build_method("dflash", block_size=4, anchors=6, num_layers=2)
    model = method.build(target)
    batch = add_features(batch_of(), target, method.feature_spec)
    return target, method, model, batch


def test_block_mask_sees_the_context_before_its_anchor_and_its_own_block_only():
    m = block_attention_mask(torch.tensor([[2, 5]]), block_size=3, context_len=7)
    assert m.shape == (1, 6, 7 + 6)
    ctx, blk = m[0, :, :7], m[0, :, 7:]
    assert ctx[:3].sum(-1).tolist() == [2, 2, 2] and ctx[3:].sum(-1).tolist() == [5, 5, 5]
    assert blk[:3, :3].all() and blk[3:, 3:].all() and not blk[:3, 3:].any() and not blk[3:, :3].any()
    valid = torch.tensor([[True, False, True, True, True, True, True]])
    assert block_attention_mask(torch.tensor([[2]]), 1, 7, valid)[0, 0, :7].tolist() == [True] + [False] * 6


def test_anchors_are_positions_whose_next_token_is_an_assistant_token(setup):
    _, method, _, batch = setup
    batch = dict(batch)
    lm = torch.zeros_like(batch["loss_mask"])
    lm[0, 10:14] = 1
    lm[1, 3] = 1
    batch["loss_mask"] = lm
    anchors, valid = method.sample_anchors(batch, 6, torch.Generator().manual_seed(1))
    assert sorted(anchors[0][valid[0]].tolist()) == [9, 10, 11, 12] and anchors[1][valid[1]].tolist() == [2]
    assert valid.sum(1).tolist() == [4, 1]


def test_a_block_never_reads_the_context_at_or_after_its_anchor(setup):
    target, method, model, batch = setup
    gen = torch.Generator().manual_seed(0)
    anchors, valid = method.sample_anchors(batch, 1, gen)
    a = int(anchors[0, 0])
    h, *_ = method._blocks(model, batch, target, 1, torch.Generator().manual_seed(0))
    later = dict(batch)
    later["hidden_aux"] = batch["hidden_aux"].clone()
    later["hidden_aux"][0, a:] += 5.0  # the anchor's own state and everything after it
    h2, *_ = method._blocks(model, later, target, 1, torch.Generator().manual_seed(0))
    assert torch.allclose(h[0], h2[0], atol=1e-6)
    earlier = dict(batch)
    earlier["hidden_aux"] = batch["hidden_aux"].clone()
    earlier["hidden_aux"][0, a - 1] += 5.0
    h3, *_ = method._blocks(model, earlier, target, 1, torch.Generator().manual_seed(0))
    assert not torch.allclose(h[0], h3[0], atol=1e-4)


def test_many_blocks_in_one_training_forward_equal_one_block_drafted_from_a_cache(setup):
    target, method, model, batch = setup
    h, *_ = method._blocks(model, batch, target, 6, torch.Generator().manual_seed(3))
    anchors, valid = method.sample_anchors(batch, 6, torch.Generator().manual_seed(3))
    bs = method.block_size
    for i in range(anchors.shape[1]):
        if not valid[0, i]:
            continue
        a = int(anchors[0, i])
        cache = model.new_cache()
        model.extend_context(cache, model.fuse(batch["hidden_aux"][:1, :a]), torch.arange(a)[None])
        block = model.block_inputs(batch["input_ids"][:1, a])
        one = model.decode(block, (a + torch.arange(bs))[None], cache, torch.ones(1, bs, a + bs, dtype=torch.bool))
        assert torch.allclose(one[0], h[0, i], atol=1e-5), i


def test_slot_weights_decay_and_skip_the_anchor():
    method = build_method("dflash", block_size=4, gamma=2.0)
    w = method.slot_weights()
    assert w[0] == 0 and torch.allclose(w[1:], torch.exp(-torch.arange(3.0) / 2.0))


def test_acceptance_objective_is_minus_log_of_the_overlap_of_the_distributions():
    from specheads.methods.losses import acceptance_nll

    p, q = torch.tensor([[0.0, 2.0, 0.0]]), torch.tensor([[0.0, 2.0, 0.0]])
    assert acceptance_nll(q, p).item() == pytest.approx(0.0, abs=1e-6)  # same distribution: always accepted
    pt, qt = torch.softmax(p, -1), torch.softmax(torch.tensor([[2.0, 0.0, 0.0]]), -1)
    want = -torch.log(torch.minimum(pt, qt).sum())
    assert acceptance_nll(torch.tensor([[2.0, 0.0, 0.0]]), p).item() == pytest.approx(want.item(), rel=1e-6)


def test_lk_weight_mixes_the_acceptance_objective_into_the_loss(setup):
    target, _, model, batch = setup
    plain = build_method("dflash", block_size=4, anchors=6, num_layers=2)
    mixed = build_method("dflash", block_size=4, anchors=6, num_layers=2, lk_weight=0.5)
    torch.manual_seed(0)
    a = plain.loss(model, batch, target).loss
    torch.manual_seed(0)
    b = mixed.loss(model, batch, target).loss
    assert torch.isfinite(b) and not torch.allclose(a, b)
    b.backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("loss", ["ce", "dpace"])
def test_the_slots_cross_entropy_through_the_frozen_lm_head_equals_the_plain_logits(setup, monkeypatch, loss):
    """slot_cross_entropy (no (N, V) tensor kept for backward) gives the loss, metrics and gradients that
    cross-entropy on ``model.logits`` gives."""
    import specheads.methods.dflash as dflash
    from specheads.methods.losses import hard_cross_entropy

    target, _, model, batch = setup
    method = build_method("dflash", block_size=4, anchors=6, num_layers=2, loss=loss, head_chunk=8)  # several chunks

    def run():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = method.loss(model, batch, target)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, got_grads = run()
    monkeypatch.setattr(dflash, "slot_cross_entropy", lambda m, t, h, y, chunk: hard_cross_entropy(m.logits, h, y))
    want, want_grads = run()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert got.metrics == want.metrics and set(got_grads) == set(want_grads) and "norm.weight" in got_grads
    for name, g in got_grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_held_out_metrics_never_hold_every_rows_logits(setup):
    """evaluate scores the counted slots ``head_chunk`` rows of logits at a time (it once made all of them at once:
    the training run's peak memory), with the metrics that whole-vocabulary argmax gives."""
    target, _, model, batch = setup
    V = model.config.vocab_size

    class WidestLogits(torch.utils._python_dispatch.TorchDispatchMode):
        """The most rows of any (..., V) product: the logits (the LM head's own weight is (V, H))."""
        rows = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "linear") and out.shape[-1] == V:
                self.rows = max(self.rows, out.numel() // V)
            return out

    small = build_method("dflash", block_size=4, anchors=6, num_layers=2, head_chunk=4, target_chunk=4)
    whole = build_method("dflash", block_size=4, anchors=6, num_layers=2, head_chunk=10**6)
    with WidestLogits() as seen:
        got = small.evaluate(model, batch, target)
    assert 0 < seen.rows <= 4
    assert got == whole.evaluate(model, batch, target) and sum(v for k, v in got.items() if k.endswith("_total")) > 4


@pytest.mark.parametrize("bad, match", [({"block_size": 1}, "block_size"), ({"labels": "x"}, "labels"),
                                        ({"lk_weight": 1.5}, "lk_weight"),
                                        ({"gamma": 0}, "gamma"), ({"anchors": 0}, "anchors")])
def test_bad_settings_are_refused(bad, match):
    from specheads.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        build_method("dflash", **bad)


def test_a_few_steps_learn_the_targets_greedy_tokens(tmp_path):
    import json

    from specheads.targets import Target
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from tests.families.family_models import make_family_model
    from tests.training.engine_helpers import sources

    target = Target(make_family_model("llama", layers=4), None, "peaked")  # context-dependent, peaked next tokens
    method = build_method("dflash", block_size=4, anchors=8)
    train_src, held = sources(n_train=32, n_eval=8, max_tokens=192)
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=60, eval_every=0, save_every=0, wandb_mode="disabled",
                      progress=False, log_every=1, measure_prompts=0)
    summary = train(method, target, train_src, cfg, OptimConfig(lr=3e-3, warmup_steps=0), held)
    losses = [json.loads(ln)["loss"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert sum(losses[-10:]) < 0.25 * sum(losses[:10]), losses
    ev = summary["eval"]
    assert ev["step0_acc"] > 0.1 and ev["tau_joint"] > 1.1, ev  # chance is 1/256
    loaded = DFlashModel.from_pretrained(summary["head_dir"]).attach(target)
    assert loaded.config.block_size == 4 and loaded.config.aux_layers == list(method.feature_spec.aux_layers)


def test_training_measures_a_chain_no_longer_than_a_block(setup):
    from specheads.decoding.drafters import TreeShape

    _, method, model, _ = setup  # block_size 4: three drafted tokens
    assert method.drafter(model, TreeShape("chain", k=5)).shape.k == 3
    assert method.drafter(model, TreeShape("chain", k=2)).shape.k == 2


def test_a_float32_head_reads_a_bfloat16_targets_lm_head():
    target = make_tiny_target("llama", layers=4, dtype=torch.bfloat16)
    method = build_method("dflash", block_size=4)
    model = method.build(target).float()
    logits = model.logits(torch.randn(2, 3, target.hidden_size))
    assert logits.shape == (2, 3, target.vocab_size) and torch.isfinite(logits.float()).all()


def test_init_layer_from_target_gives_the_context_that_layers_keys_and_values():
    target = make_tiny_target("llama", layers=4)
    method = build_method("dflash", block_size=4, init_layer_from_target=True)
    model = method.build(target)
    aux = method.feature_spec.aux_layers
    batch = add_features(batch_of(1), target, method.feature_spec)
    cache = model.new_cache()
    T = batch["input_ids"].shape[1]
    model.extend_context(cache, model.fuse(batch["hidden_aux"]), torch.arange(T)[None])
    src = target.layers[aux[-1]]
    h = src.input_layernorm(target.forward_features(batch["input_ids"], batch["attention_mask"], (aux[-1],)).aux[0])
    v = src.self_attn.v_proj(h).view(1, T, -1, model.config.head_dim).transpose(1, 2)
    assert torch.allclose(cache.values[0], v, atol=1e-5)  # the context's values are the target layer's own
    assert torch.equal(model.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(model.norm.weight, target.decoder.norm.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_forward_on_cuda_equals_the_cpu_one(setup):
    """CUDA repeats the key/value heads before the masked fused attention (the CPU path passes enable_gqa)."""
    target, method, model, batch = setup
    h_cpu, *_ = method._blocks(model, batch, target, 4, torch.Generator().manual_seed(0))
    target.model.cuda()
    model.cuda().attach(target)
    gpu = {k: v.cuda() for k, v in batch.items()}
    h_gpu, *_ = method._blocks(model, gpu, target, 4, torch.Generator().manual_seed(0))
    assert torch.allclose(h_gpu.cpu(), h_cpu, atol=1e-4)
