"""EAGLE-3 head: layout, save/load, loss masking, drafting API shapes."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from specheads.methods.eagle3 import Eagle3Method
from specheads.models.eagle3 import Eagle3Config, Eagle3Model
from specheads.models.vocab import build_draft_vocab
from tests.conftest import make_tiny_target

V, H, DV = 200, 64, 40


@pytest.fixture
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=3)


def _batch(target, method, B=2, T=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 10:] = 0
    loss_mask = torch.ones(B, T, dtype=torch.long)
    loss_mask[:, :3] = 0
    loss_mask *= attn
    f = target.forward_features(ids, attn, aux_layers=method.feature_spec.aux_layers)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask, "hidden_last": f.last,
            "hidden_aux": torch.cat(f.aux, -1)}


def _rows(seed=1, n=6):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, V, (20,), generator=g).tolist(), "loss_mask": [1] * 20} for _ in range(n)]


def test_parameter_layout_matches_vllm_eagle3(target):
    model = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), init_lm_head_from_target=True).build(target)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "fc.weight": (H, 3 * H), "d2t": (DV,), "t2d": (V,), "norm.weight": (H,), "lm_head.weight": (DV, H),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (H, 2 * H), "midlayer.self_attn.k_proj.weight": (H // 2, 2 * H),
        "midlayer.self_attn.v_proj.weight": (H // 2, 2 * H), "midlayer.self_attn.o_proj.weight": (H, H),
        "midlayer.mlp.gate_proj.weight": (2 * H, H), "midlayer.mlp.up_proj.weight": (2 * H, H),
        "midlayer.mlp.down_proj.weight": (H, 2 * H),
    }
    # init_lm_head_from_target: lm_head starts from the target's rows of the draft vocabulary.
    assert_close(model.lm_head.weight, target.lm_head.weight[model.t2d])


def test_freeze_lm_head_keeps_the_target_rows(target):
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), init_lm_head_from_target=True, freeze_lm_head=True)
    model = method.build(target)
    assert not model.lm_head.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "lm_head.weight")
    with pytest.raises(ValueError, match="init_lm_head_from_target"):
        Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), freeze_lm_head=True)


def test_save_load_round_trip(target, tmp_path):
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=2)
    model = method.build(target)
    method.save(model, str(tmp_path), target)
    loaded = Eagle3Model.from_pretrained(tmp_path)
    assert isinstance(loaded.config, Eagle3Config) and loaded.config.aux_layers == [0, 1, 2]
    assert loaded.config.draft_vocab_size == DV and loaded.config.target_hidden_size == H
    with pytest.raises(RuntimeError, match="attach"):
        loaded.step(torch.zeros(1, 1, H), torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    loaded.attach(target)
    batch = _batch(target, method)
    assert method.evaluate(model.eval(), batch, target) == method.evaluate(loaded.eval(), batch, target)
    with pytest.raises(ValueError, match="does not match"):
        loaded.attach(make_tiny_target("llama", vocab=V + 1, hidden=H, layers=3))


def test_step_api_shapes_and_target_ids(target):
    model = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows()).build(target)
    cache = model.new_cache()
    h0 = model.fuse(torch.randn(2, 5, 3 * H))
    h, logits = model.step(h0, torch.randint(0, V, (2, 5)), torch.arange(5).expand(2, 5), None, cache)
    assert h.shape == (2, 5, H) and logits.shape == (2, 5, DV) and len(cache) == 5
    h2, logits2 = model.step(h[:, -1:], torch.randint(0, V, (2, 1)), torch.full((2, 1), 5), None, cache)
    assert logits2.shape == (2, 1, DV) and len(cache) == 6
    tids = model.to_target_ids(logits2.argmax(-1))
    assert bool(model.t2d[tids].all())


def test_loss_matches_manual_step0_and_masks_out_of_vocab(target):
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=1)
    model = method.build(target)
    batch = _batch(target, method)
    out = method.loss(model, batch, target)
    assert_close(out.loss, _manual_step0_loss(model, batch, target), atol=1e-5, rtol=1e-5)
    # With a draft vocabulary that never contains the target's argmax, nothing is trained.
    model.t2d.copy_(~model.t2d & False)
    keep = torch.ones(V, dtype=torch.bool)
    keep[target.logits(batch["hidden_last"]).argmax(-1).flatten()] = False
    ids_in = keep.nonzero().squeeze(-1)[:DV]
    model.t2d[ids_in] = True
    model.d2t.copy_(ids_in - torch.arange(DV))
    out = method.loss(model, batch, target)
    assert float(out.loss.detach()) == 0.0 and out.metrics["step0_acc"] == 0.0
    out.loss.backward()  # still a graph over every parameter


def test_feature_spec_needs_target_when_layers_default(target):
    method = Eagle3Method(vocab_data=_rows())
    with pytest.raises(RuntimeError, match="bind"):
        method.feature_spec
    assert method.bind(target).feature_spec.aux_layers == (0, 1, 2)
    assert Eagle3Method(aux_layers=[1, 2, 0]).feature_spec.aux_layers == (1, 2, 0)
    with pytest.raises(ValueError, match="vocab_data"):
        Eagle3Method(draft_vocab_size=DV).build(target)


def test_few_steps_reduce_loss(target):
    with torch.no_grad():  # a peaked target distribution, so the soft CE can fall well below its start
        target.lm_head.weight.mul_(30)
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=3)
    model = method.build(target).train()
    batch = _batch(target, method)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(15):
        out = method.loss(model, batch, target)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else float(out.loss.detach())
    assert float(out.loss.detach()) < 0.8 * first
    assert set(out.metrics) == {f"step{i}_{k}" for i in range(3) for k in ("loss", "acc")}


# --------------------------------------------------------------------------- the draft vocabulary: training rows only


def _unique_token_rows(n: int, common: int = 20, first_unique: int = 100) -> dict[str, list]:
    """Row i: the ``common`` ids 0..common-1 (the assistant turn, counted everywhere) and one id of its
    own, ``first_unique + i``; a 2-token user turn in front (not counted)."""
    ids = [[1, 2] + list(range(common)) + [first_unique + i] for i in range(n)]
    return {"id": [f"r{i}" for i in range(n)], "input_ids": ids,
            "loss_mask": [[0, 0] + [1] * (common + 1) for _ in range(n)], "domain": ["synthetic"] * n}


def test_vocab_rows_limit_the_count_to_those_rows(target):
    rows = _unique_token_rows(8)
    data = [{"id": i, "input_ids": x, "loss_mask": m} for i, x, m in zip(rows["id"], rows["input_ids"], rows["loss_mask"])]
    model = Eagle3Method(draft_vocab_size=23, vocab_data=data, vocab_rows=["r1", "r4", "r6"]).build(target)
    picked = set(model.t2d.nonzero().flatten().tolist())
    assert picked == set(range(20)) | {101, 104, 106}  # no token only the other rows hold
    with pytest.raises(ValueError, match="no loss-masked token"):
        Eagle3Method(draft_vocab_size=23, vocab_data=data, vocab_rows=["nope"]).build(target)


def test_recipe_counts_the_draft_vocabulary_over_training_rows_only(target, tmp_path):
    """recipes/train.py knows the train/held-out split and hands EAGLE-3 the training rows: a token
    that only held-out rows contain never enters the draft vocabulary."""
    import importlib.util
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    from specheads.data.prepare import write_prepared

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("train_recipe_vocab", repo / "recipes" / "train.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["train_recipe_vocab"] = recipe
    spec.loader.exec_module(recipe)

    n = 40
    write_prepared(_unique_token_rows(n), {"target": "tiny", "tokenizer_fingerprint": None, "max_length": 64},
                   tmp_path / "prepared")
    cfg = OmegaConf.create({"features_dir": None, "prepared_dir": str(tmp_path / "prepared"), "seed": 0,
                            "data": {"eval_samples": 8, "max_tokens": 256, "batch_size": None,
                                     "eval_max_tokens": 256, "max_length": None,
                                     "pad_to_multiple_of": 1}})
    method = Eagle3Method(vocab_data=str(tmp_path / "prepared"))
    train_src, eval_src = recipe.build_data(cfg, method, target)
    recipe.set_vocab_rows(method, cfg, train_src)
    assert sorted(method.vocab_rows) == sorted(f"r{i}" for i in train_src.indices)
    method.draft_vocab_size = 20 + len(train_src.indices)
    model = method.build(target)
    held_only = [100 + i for i in eval_src.indices]
    trained = [100 + i for i in train_src.indices]
    # 4 held out by the split, none of them the evaluator's chat slice (left out of training and held-out rows)
    assert len(held_only) == 4 and not model.t2d[held_only].any()
    assert model.t2d[trained].all() and model.t2d[:20].all()
    # vocab_data that is not the training data is counted whole (and said so)
    other = Eagle3Method(vocab_data=str(tmp_path / "elsewhere"))
    recipe.set_vocab_rows(other, cfg, train_src)
    assert other.vocab_rows is None


def test_feature_weight_adds_the_regression_on_the_targets_next_state(target):
    import torch.nn.functional as F

    from specheads.methods.ttt import step_rows, unroll

    plain = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=2, step_decay=0.5)
    model = plain.build(target)
    weighted = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=2, step_decay=0.5, feature_weight=0.3)
    batch = _batch(target, plain)
    extra = weighted.loss(model, batch, target).loss - plain.loss(model, batch, target).loss
    rows = plain.target_rows(model, batch, target)
    want = 0.0
    for i, h_out in unroll(model, model.fuse(batch["hidden_aux"]), batch["input_ids"], 2):
        b, t = step_rows(batch, i)
        keep = rows.in_vocab[b, t + 1 + i]
        b, t = b[keep], t[keep]
        reg = F.smooth_l1_loss(model.norm(h_out[b, t]), batch["hidden_last"][b, t + 1 + i], reduction="none")
        want += 0.5 ** i * 0.3 * reg.mean(-1).mean()
    assert float(extra) > 0
    assert_close(extra, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="feature_weight"):
        Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), feature_weight=-1.0)


def test_stored_target_argmax_gives_the_same_loss_without_the_full_logits(target, monkeypatch):
    """With the argmax a feature store holds, the loss and metrics are those of the full computation, and
    the target's full-vocabulary logits are never built (only the draft vocabulary's LM head rows)."""
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=2)
    model = method.build(target)
    batch = _batch(target, method)
    full = method.loss(model, batch, target)
    held = method.evaluate(model, batch, target)
    stored = dict(batch, target_argmax=target.logits(batch["hidden_last"]).argmax(-1))
    calls = []
    real = target.logits
    monkeypatch.setattr(target, "logits", lambda h: calls.append(h.shape) or real(h))
    fast = method.loss(model, stored, target)
    assert_close(fast.loss, full.loss)
    assert fast.metrics == pytest.approx(full.metrics)
    assert method.evaluate(model, stored, target) == held
    assert calls == []
    # without it the target's logits are computed as before
    method.loss(model, batch, target)
    assert calls


def test_init_layer_from_target_starts_as_the_targets_highest_fused_layer(target):
    """With the token-embedding half of q/k/v zeroed, the fresh drafter computes exactly the target's
    layer ``aux_layers[-1]`` on the feature entering it, then the target's final norm."""
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), init_layer_from_target=True)
    model = method.build(target)
    src = target.layers[model.config.aux_layers[-1]]
    assert_close(model.midlayer.mlp.up_proj.weight, src.mlp.up_proj.weight)
    assert_close(model.midlayer.self_attn.q_proj.weight[:, H:], src.self_attn.q_proj.weight)
    assert float(model.midlayer.self_attn.q_proj.weight[:, :H].abs().sum()) > 0  # embedding half: random start
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(model.midlayer.self_attn, name).weight[:, :H] = 0
    ids = torch.randint(0, V, (1, 9))
    aux = model.config.aux_layers
    f = target.forward_features(ids, aux_layers=aux)
    h_out = model.decode(model.fuse(torch.cat(f.aux, -1)), ids, torch.arange(9)[None])
    with torch.no_grad():
        seen = {}
        hook = src.register_forward_hook(lambda m, a, out: seen.setdefault("out", out[0] if isinstance(out, tuple) else out))
        target.model(ids)
        hook.remove()
    assert_close(h_out, seen["out"], atol=1e-4, rtol=1e-4)
    assert_close(model.norm.weight, target.decoder.norm.weight)
    plain = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows()).build(target)
    assert not torch.allclose(plain.midlayer.mlp.up_proj.weight, src.mlp.up_proj.weight)


def test_offpath_weight_weighs_down_rows_fed_a_token_the_target_would_not_choose(target):
    """offpath_weight=0 trains step 0 only on rows whose input token is the target's argmax at t (the
    rows greedy drafting reaches); 1 is the plain loss; other values the weighted mean."""
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=1)
    model = method.build(target)
    batch = _batch(target, method)
    full = target.logits(batch["hidden_last"])
    argmax = full.argmax(-1)
    ids, T = batch["input_ids"], batch["input_ids"].shape[1]
    ids[0, 5:9] = argmax[0, 4:8]  # some rows on the target's path, the rest (random ids) mostly off it
    batch = _batch(target, method) | {"input_ids": ids}
    f = target.forward_features(ids, batch["attention_mask"], aux_layers=method.feature_spec.aux_layers)
    batch |= {"hidden_last": f.last, "hidden_aux": torch.cat(f.aux, -1)}
    full = target.logits(batch["hidden_last"])
    argmax = full.argmax(-1)
    counts = torch.bincount(argmax.flatten(), minlength=V).float() + torch.rand(V) * 0.5
    model.set_draft_vocab(*build_draft_vocab(counts, DV))  # every argmax in the draft vocabulary
    nxt = torch.zeros_like(ids)
    nxt[:, :-1] = ids[:, 1:]
    _, logits = model.step(model.fuse(batch["hidden_aux"]), nxt, torch.arange(T).expand_as(ids))
    p = torch.softmax(full[..., model.t2d], -1)
    in_vocab = model.t2d[argmax]

    def manual(w):
        total, n = 0.0, 0.0
        for b in range(ids.shape[0]):
            for t in range(T - 2):
                if batch["loss_mask"][b, t + 2] and batch["attention_mask"][b, t + 2] and in_vocab[b, t + 1]:
                    off = bool(batch["loss_mask"][b, t + 1]) and int(ids[b, t + 1]) != int(argmax[b, t])
                    wt = w if off else 1.0
                    total = total - wt * (p[b, t + 1] * torch.log_softmax(logits[b, t], -1)).sum()
                    n += wt
        return total / n

    for w in (1.0, 0.3, 0.0):
        weighted = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=1, offpath_weight=w)
        assert_close(weighted.loss(model, batch, target).loss, manual(w), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(manual(0.0), manual(1.0))
    with pytest.raises(ValueError, match="offpath_weight"):
        Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), offpath_weight=1.5)


def test_feature_noise_perturbs_training_steps_only(target):
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=1, feature_noise=0.5)
    plain = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=1)
    model = method.build(target)
    batch = _batch(target, method)
    model.eval()
    assert_close(method.loss(model, batch, target).loss, plain.loss(model, batch, target).loss)
    model.train()
    torch.manual_seed(0)
    noisy = method.loss(model, batch, target).loss
    assert not torch.allclose(noisy, plain.loss(model, batch, target).loss)
    with pytest.raises(ValueError, match="feature_noise"):
        Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), feature_noise=-0.1)


@pytest.mark.parametrize("ttt_steps", [1, 2])
def test_loss_rows_all_trains_prompt_rows_too(target, ttt_steps):
    """loss_rows=all is the assistant-only loss of the same batch with every non-padding token marked as a
    label (prompt rows included, padding still out); held-out metrics stay on assistant tokens."""
    every = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=ttt_steps, loss_rows="all")
    plain = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=ttt_steps)
    model = every.build(target)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked drafts: rows differ in loss (a fresh head scores every row ~ln V')
    batch = _batch(target, every)
    assert (batch["loss_mask"] < batch["attention_mask"]).any()  # the batch has prompt rows
    relabelled = batch | {"loss_mask": batch["attention_mask"].clone()}
    loss_all = every.loss(model, batch, target).loss
    assert_close(loss_all, plain.loss(model, relabelled, target).loss)
    assert not torch.allclose(loss_all, plain.loss(model, batch, target).loss)
    assert every.evaluate(model, batch, target) == plain.evaluate(model, batch, target)
    with pytest.raises(ValueError, match="loss_rows"):
        Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), loss_rows="prompt")


def test_fc_norm_normalises_each_fused_layer_before_fc_and_trains_its_norms(target):
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), fc_norm=True)
    model = method.build(target)
    assert model.config.fc_norm and len(model.fc_norm) == 3
    x = torch.randn(2, 5, 3 * H)
    scaled = torch.cat([c * s for c, s in zip(x.chunk(3, -1), (10.0, 2.0, 3.0))], -1)
    assert_close(model.fuse(scaled), model.fuse(x), rtol=1e-4, atol=1e-5)  # each scale is normalised away
    out = method.loss(model, _batch(target, method), target)
    out.loss.backward()
    assert all(n.weight.grad is not None and n.weight.grad.abs().sum() > 0 for n in model.fc_norm)
    plain = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows()).build(target)
    assert plain.fc_norm is None and not plain.config.fc_norm


def _manual_step0_loss(model, batch, target, lk_weight: float = 0.0) -> torch.Tensor:
    """Step 0's loss written out row by row: the soft CE against the target's distribution on the draft vocabulary
    (rows whose argmax it holds), with ``lk_weight`` of -log sum min(p, q) mixed in."""
    ids, T = batch["input_ids"], batch["input_ids"].shape[1]
    nxt = torch.zeros_like(ids)
    nxt[:, :-1] = ids[:, 1:]
    _, logits = model.step(model.fuse(batch["hidden_aux"]), nxt, torch.arange(T).expand_as(ids))
    full = target.logits(batch["hidden_last"])
    p = torch.softmax(full[..., model.t2d], -1)
    in_vocab = model.t2d[full.argmax(-1)]
    total, n = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(T - 2):
            if batch["loss_mask"][b, t + 2] and batch["attention_mask"][b, t + 2] and in_vocab[b, t + 1]:
                logq = torch.log_softmax(logits[b, t], -1)
                ce = -(p[b, t + 1] * logq).sum()
                accept = -torch.log(torch.minimum(p[b, t + 1], logq.exp()).sum())
                total = total + (1 - lk_weight) * ce + lk_weight * accept
                n += 1
    assert n > 0
    return total / n


def test_lk_weight_mixes_the_acceptance_objective_into_each_row(target):
    """lk_weight=w: per row (1 - w) * soft CE + w * -log sum_x min(p, q), p the target's distribution on the draft
    vocabulary, q the draft's; the manual reference of the soft-CE test above with that term added."""
    w = 0.4
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=1, lk_weight=w)
    model = method.build(target)
    batch = _batch(target, method)
    out = method.loss(model, batch, target)
    assert_close(out.loss, _manual_step0_loss(model, batch, target, w), atol=1e-5, rtol=1e-5)
    plain = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), ttt_steps=1).loss(model, batch, target)
    assert not torch.allclose(out.loss, plain.loss)


@pytest.mark.parametrize("kw, word", [({"lk_weight": 1.5}, "lie in [0, 1]"),
                                      ({"lk_weight": 0.5, "offpath_weight": 0.5}, "offpath_weight")])
def test_a_bad_lk_weight_is_refused(kw, word):
    with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
        Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), **kw)


@pytest.mark.parametrize("option", [{"norm_before_fc": True}, {"norm_before_residual": True}, {"norm_output": True},
                                    {"sliding_window": 2}, {"qk_norm": True}])
def test_speculators_options_train_a_step_and_change_the_loss(option, target):
    """Each of speculators' EAGLE-3 options (``method.norm_*``, ``method.sliding_window`` shorter than the rows,
    ``method.qk_norm``) builds the head with it, one optimiser step runs (its new weights get gradients), and the loss
    is not the plain head's with the same weights: the option is computed, not only recorded."""
    method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), **option)
    model = method.build(target)
    (name, value), = option.items()
    assert getattr(model.config, name) == value and (model.input_norm is not None) == (name == "norm_before_fc")
    batch = _batch(target, method)
    plain_method = Eagle3Method(draft_vocab_size=DV, vocab_data=_rows())
    plain = plain_method.build(target)
    plain.load_state_dict(model.state_dict(), strict=False)
    loss = method.loss(model, batch, target).loss
    assert not torch.allclose(loss, plain_method.loss(plain, batch, target).loss)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss.backward()
    new = {"norm_before_fc": lambda: model.input_norm.weight, "qk_norm": lambda: model.midlayer.self_attn.q_norm.weight}
    if name in new:
        assert new[name]().grad.abs().sum() > 0
    opt.step()
    assert torch.isfinite(method.loss(model, batch, target).loss)


def test_a_bad_sliding_window_is_refused():
    with pytest.raises(ValueError, match=r"sliding_window must be >= 1"):
        Eagle3Method(draft_vocab_size=DV, vocab_data=_rows(), sliding_window=0)
