"""P-EAGLE: the depth subsampling and the packed attention mask checked directly, the training forward equal to
the drafting forward of each anchor, layout and save/load, loss and held-out metrics, a short run on a store."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from specheads.data.features import add_features
from specheads.methods import build_method
from specheads.methods.peagle import PEagleMethod, deal, depth_anchors, depth_count, pack
from specheads.models.peagle import ParallelLayout, PEagleModel, parallel_attention_mask
from specheads.models.vocab import build_draft_vocab
from tests.conftest import make_tiny_target

V, H, DV = 200, 64, 40
ROWS = [{"input_ids": list(range(V)), "loss_mask": [1] * V}]


@pytest.fixture
def target():
    return make_tiny_target("llama", vocab=V, hidden=H, layers=4)


def _method(**kw) -> PEagleMethod:
    return build_method("peagle", **{"draft_vocab_size": DV, "vocab_data": ROWS, "num_depths": 3, **kw})


def _batch(target, method, B=2, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    att = torch.ones(B, T, dtype=torch.long)
    att[1, 11:] = 0
    lm = att.clone()
    lm[:, :3] = 0
    return add_features({"input_ids": ids, "attention_mask": att, "loss_mask": lm}, target, method.feature_spec)


# --------------------------------------------------------------------------- subsampling


def test_depth_counts_follow_the_recipe():
    assert [depth_count(100, d, 0.7, 0.2) for d in range(6)] == [100, 69, 48, 33, 23, 19]
    for n in (1, 5, 37, 100):
        for d in range(1, 8):
            assert depth_count(n, d, 0.7, 0.2) == max(0, math.floor((n - d) * max(0.7 ** d, 0.2) + 1e-9))


@pytest.mark.parametrize("n", [1, 3, 10, 57])
def test_each_depth_is_drawn_from_the_shifted_pool_of_the_one_before(n):
    g = torch.Generator().manual_seed(n)
    K = 6
    anchors = depth_anchors(n, K, 0.7, 0.2, generator=g)
    assert anchors[0].tolist() == list(range(n))
    for d in range(1, K):
        a = anchors[d]
        assert a.tolist() == sorted(set(a.tolist()))  # sorted, no repeats
        assert set(a.tolist()) <= set(anchors[d - 1].tolist())  # whole chains: depths 0..d-1 exist for a
        assert all(x + d < n for x in a.tolist())  # the slot's position exists in the row
        pool = sum(1 for x in anchors[d - 1].tolist() if x + d < n)
        assert a.numel() == min(depth_count(n, d, 0.7, 0.2), pool)
    capped = depth_anchors(n, K, 0.7, 0.2, max_anchors=2, generator=g)
    assert all(c.numel() <= 2 for c in capped[1:])


def test_pack_pads_shorter_rows_and_places_depth0_first():
    att = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    p = pack(att, 3, 0.7, 0.2, generator=torch.Generator().manual_seed(0))
    T = 10
    assert p.anchor[:, :T].tolist() == [list(range(T))] * 2 and (p.depth[:, :T] == 0).all()
    assert p.valid[:, :T].tolist() == att.bool().tolist()
    m1 = depth_count(10, 1, 0.7, 0.2)
    assert int(((p.depth == 1) & p.valid)[0].sum()) == m1
    assert int(((p.depth == 1) & p.valid)[1].sum()) == depth_count(6, 1, 0.7, 0.2)
    assert ((p.anchor + p.depth)[p.valid] < T).all()


# --------------------------------------------------------------------------- the mask


def _rule(anchor, depth, valid, q, k) -> bool:
    """The attention rule written out for one query/key pair."""
    if q == k:
        return True
    if not valid[k]:
        return False
    if depth[k] == 0:
        return anchor[k] <= anchor[q]
    return anchor[k] == anchor[q] and depth[k] <= depth[q]


def test_mask_matches_the_rule_and_never_shows_a_later_anchor():
    att = torch.tensor([[1] * 12, [1] * 7 + [0] * 5])
    p = pack(att, 4, 0.7, 0.2, generator=torch.Generator().manual_seed(1))
    mask = parallel_attention_mask(p.anchor, p.depth, p.valid)
    B, Q = p.anchor.shape
    for b in range(B):
        a, d, v = p.anchor[b].tolist(), p.depth[b].tolist(), p.valid[b].tolist()
        for q in range(Q):
            for k in range(Q):
                assert bool(mask[b, q, k]) == _rule(a, d, v, q, k), (b, q, k)
                if mask[b, q, k] and q != k:
                    assert a[k] <= a[q]  # never a later anchor's key
                    assert d[k] == 0 or (a[k] == a[q] and d[k] <= d[q])  # deep keys only from its own chain
    # a deep query sees its whole chain: the depth-0 key of its anchor and its own lower depths
    q = int(((p.depth[0] == 3) & p.valid[0]).nonzero()[0, 0])
    a = int(p.anchor[0, q])
    chain = [k for k in range(Q) if p.valid[0, k] and int(p.anchor[0, k]) == a]
    assert sorted(int(p.depth[0, k]) for k in chain) == [0, 1, 2, 3]
    assert all(mask[0, q, k] for k in chain)


def test_a_mask_that_shows_later_anchors_fails_the_check():
    """The check above is not vacuous: a mask built with the anchor comparison reversed breaks it."""
    p = pack(torch.ones(1, 8, dtype=torch.long), 3, 0.7, 0.2, generator=torch.Generator().manual_seed(2))
    bad = parallel_attention_mask(-p.anchor, p.depth, p.valid)  # depth-0 keys at or *after* the anchor
    a = p.anchor[0]
    later = [(q, k) for q in range(a.numel()) for k in range(a.numel()) if bad[0, q, k] and a[k] > a[q]]
    assert later


# --------------------------------------------------------------------------- model


def test_layout_and_save_load_round_trip(target, tmp_path):
    method = _method(num_layers=2)
    model = method.build(target)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["mask_hidden"] == (1, 3 * H) and shapes["fc.weight"] == (H, 3 * H)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (H, 2 * H)  # layer 0 reads [embeds; hidden]
    assert shapes["layers.1.self_attn.q_proj.weight"] == (H, H)  # later layers read the residual stream
    assert "layers.1.hidden_norm.weight" not in shapes and shapes["lm_head.weight"] == (DV, H)
    assert model.config.mask_token_id is not None and model.config.num_depths == 3
    model.save_pretrained(tmp_path)
    loaded = PEagleModel.from_pretrained(tmp_path).attach(target)
    assert loaded.config.model_type == "specheads_peagle" and loaded.config.num_hidden_layers == 2
    for k, v in model.state_dict().items():
        assert_close(loaded.state_dict()[k], v)
    b = _batch(target, method)
    g = torch.Generator().manual_seed(0)
    h1, _ = method.forward_depths(model.eval(), b, g)
    h2, _ = method.forward_depths(loaded.eval(), b, torch.Generator().manual_seed(0))
    assert_close(h1, h2)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_training_forward_equals_drafting_each_anchor_alone(target, num_layers):
    """Every packed query's output equals a causal forward over just its anchor's context (depth 0 at 0..a) and
    its mask slots (positions a+1..a+d): the layout the drafter (and vLLM) runs."""
    method = _method(num_layers=num_layers, num_depths=4)
    model = method.build(target).double().eval()
    b = {k: (v.double() if v.is_floating_point() else v) for k, v in _batch(target, method).items()}
    h, p = method.forward_depths(model, b, torch.Generator().manual_seed(3))
    ids = b["input_ids"]
    mask_id = int(model.config.mask_token_id)
    checked = 0
    for row in range(2):
        for q in p.valid[row].nonzero()[:, 0].tolist():
            a, d = int(p.anchor[row, q]), int(p.depth[row, q])
            hid = torch.cat([model.fuse(b["hidden_aux"][row, : a + 1]), model.mask_state().expand(d, -1)])[None]
            tok = torch.cat([ids[row, 1: a + 2], torch.full((d,), mask_id)])
            if tok.numel() < a + 1 + d:  # the last position has no next token: shift_tokens fills 0
                tok = torch.cat([ids[row, 1: a + 1], torch.zeros(1, dtype=torch.long), torch.full((d,), mask_id)])
            with torch.no_grad():
                want = model.decode(hid, tok[None], torch.arange(a + 1 + d)[None])[0, -1]
            assert_close(h[row, q], want, rtol=1e-9, atol=1e-9)
            checked += 1
    assert checked > 30


def test_loss_is_the_mean_soft_ce_per_depth_summed(target):
    from specheads.methods.losses import soft_cross_entropy

    method = _method()
    model = method.build(target)
    with torch.no_grad():  # a draft vocabulary that holds every target argmax, so each depth has rows
        counts = torch.zeros(V, dtype=torch.long)
        counts[:DV] = 1
        d2t, t2d = build_draft_vocab(counts, DV)
        model.set_draft_vocab(d2t, t2d)
    b = _batch(target, method)
    b["input_ids"] = b["input_ids"] % DV
    b = add_features({k: b[k] for k in ("input_ids", "attention_mask", "loss_mask")}, target, method.feature_spec)
    torch.manual_seed(5)
    out = method.loss(model, b, target)
    torch.manual_seed(5)
    h, p = method.forward_depths(model, b)
    rows = method.target_rows(model, b, target)
    want = 0.0
    for d in range(3):
        bb, q, a = method.depth_rows(p, b, d)
        keep = rows.in_vocab[bb, a + 1 + d]
        bb, q, a = bb[keep], q[keep], a[keep]
        assert bb.numel() > 0
        s, _ = soft_cross_entropy(model.logits, h[bb, q], rows.probs[rows.row_of[bb, a + 1 + d]])
        want = want + s / bb.numel()
        assert out.metrics[f"step{d}_loss"] == pytest.approx(float(s.detach()) / bb.numel(), rel=1e-5)
    assert_close(out.loss, want)
    out.loss.backward()
    assert model.mask_hidden.grad is not None and float(model.mask_hidden.grad.abs().sum()) > 0


def test_evaluate_counts_per_depth_and_joint(target):
    method = _method()
    model = method.build(target)
    b = _batch(target, method)
    ev = method.evaluate(model, b, target)
    for d in range(3):
        assert ev[f"step{d}_total"] > 0 and ev[f"joint{d}_total"] == ev[f"step{d}_total"]
        assert ev[f"joint{d}_correct"] <= ev[f"step{d}_correct"]
    assert ev["step0_total"] == float(((b["loss_mask"][:, 2:] > 0) & (b["attention_mask"][:, 2:] > 0)).sum())
    assert method.evaluate(model, b, target) == ev  # a fixed draw


@pytest.mark.parametrize("bad,match", [({"num_depths": 0}, "num_depths"), ({"ratio": 0}, "ratio"),
                                       ({"max_anchors": 0}, "max_anchors"), ({"ttt_steps": 3}, "ttt_steps")])
def test_bad_settings_are_refused(bad, match):
    from specheads.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        build_method("peagle", **bad)


def test_init_layer_from_target_starts_every_layer_from_the_target(target):
    method = _method(num_layers=2, init_layer_from_target=True)
    model = method.build(target)
    top = list(model.config.aux_layers)[-1]
    nxt = target.layers[min(top + 1, target.num_layers - 1)]
    assert_close(model.layers["1"].mlp.down_proj.weight, nxt.mlp.down_proj.weight)
    assert_close(model.midlayer.mlp.down_proj.weight, target.layers[top].mlp.down_proj.weight)


def test_a_short_run_on_a_store_learns_every_depth(tmp_path):
    """Trained by the engine from a feature store: the loss falls, the held-out metrics and the measured
    acceptance of the drafter come back, the head reloads."""
    import datasets
    import json

    from specheads.data.features import CollectOptions, FeatureDataset, TokenDataset, collect_hidden_states
    from specheads.targets import Target
    from specheads.training.batches import DatasetBatches
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from tests.families.family_models import make_family_model
    from tests.training.engine_helpers import progression_rows

    target = Target(make_family_model("llama", layers=4), None, "peaked")
    data = progression_rows(40, length=24)
    method = build_method("peagle", draft_vocab_size=256, num_depths=3, ratio=0.7, ratio_min=0.5,
                          vocab_data=[{"input_ids": i, "loss_mask": m} for i, m in zip(data["input_ids"],
                                                                                       data["loss_mask"])])
    method.bind(target)
    rows = datasets.Dataset.from_dict(data)
    collect_hidden_states(target, rows, method.feature_spec, tmp_path / "store",
                          CollectOptions(shard_bytes=2 ** 20, batch_tokens=256, check_disk=False, estimate_time=False,
                                         progress=False))
    store = FeatureDataset(tmp_path / "store", method.feature_spec, target)
    train_src = DatasetBatches(store, max_tokens=192, seed=0, indices=range(32))
    held = DatasetBatches(store, max_tokens=512, shuffle=False, indices=range(32, 40))
    cfg = TrainConfig(output_dir=str(tmp_path / "out"), max_steps=40, eval_every=0, save_every=0,
                      wandb_mode="disabled", progress=False, log_every=1, measure_prompts=2)
    summary = train(method, target, train_src, cfg, OptimConfig(lr=3e-3, warmup_steps=0), held)
    logs = [json.loads(ln) for ln in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logs if "loss" in r]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    assert any("step2_acc" in r for r in logs)  # per-depth accuracy in the training log
    ev = summary["eval"]
    assert {"step0_acc", "step1_acc", "step2_acc", "tau_estimate", "tau_joint"} <= set(ev)
    assert min(ev["step0_acc"], ev["step1_acc"], ev["step2_acc"]) > 0.1 and ev["tau_estimate"] > 1.2, ev  # chance 1/256
    assert ev["measured_prompts"] == 2.0 and ev["measured_k"] == 3.0  # the drafter's chain: one K-token draft
    loaded = PEagleModel.from_pretrained(summary["head_dir"]).attach(target)
    assert loaded.config.num_depths == 3


def test_lk_weight_reaches_every_depths_loss(target):
    method, lk = _method(), _method(lk_weight=0.5)
    torch.manual_seed(0)
    model = method.build(target)
    batch = _batch(target, method)
    torch.manual_seed(1)
    plain = method.loss(model, batch, target).loss
    torch.manual_seed(1)
    mixed = lk.loss(model, batch, target)
    assert torch.isfinite(mixed.loss) and not torch.allclose(plain, mixed.loss)
    model.zero_grad()
    mixed.loss.backward()
    assert model.mask_hidden.grad is not None


@pytest.mark.parametrize("head_chunk", [4096, 16], ids=["one-chunk", "chunked"])
def test_the_loss_keeps_no_copy_of_a_depths_labels_for_backward(head_chunk, monkeypatch):
    """Each depth's labels are rows of the target's table (``rows.probs``), gathered a chunk at a time inside the
    loss: between the forward and the backward no tensor but that table is as large as the smallest depth's (n, V)
    labels (at 32k tokens each such copy was 2-4 GiB). Copying them per depth (``rows.probs[rows.row_of[b, s]]``)
    keeps every copy alive for backward, saved by autograd or by the chunks' checkpoints."""
    import gc

    vocab = draft_vocab = 2000  # every target argmax in the draft vocabulary: every depth row has its label
    target = make_tiny_target("llama", vocab=vocab, hidden=H, layers=4)
    method = build_method("peagle", draft_vocab_size=draft_vocab, num_depths=3, head_chunk=head_chunk,
                          vocab_data=[{"input_ids": list(range(vocab)), "loss_mask": [1] * vocab}])
    model = method.build(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, draft_vocab, (2, 256), generator=g)
    ones = torch.ones(2, 256, dtype=torch.long)
    b = add_features({"input_ids": ids, "attention_mask": ones, "loss_mask": ones}, target, method.feature_spec)
    rows = method.target_rows(model, b, target)
    monkeypatch.setattr(method, "target_rows", lambda *a: rows)  # the table made here: known, left out below
    torch.manual_seed(1)
    packed = method.forward_depths(model, b)[1]
    smallest = min(int(rows.in_vocab[bb, a + 1 + d].sum())
                   for d in range(3) for bb, _, a in [method.depth_rows(packed, b, d)])
    copy = smallest * draft_vocab * 4
    assert copy > draft_vocab * H * 4 * 2  # larger than the head's weight and its gradient: the sizes tell them apart

    def storages():
        return {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and not o.is_meta and not o.is_mkldnn}

    gc.collect()
    known = set(storages()) | {rows.probs.untyped_storage().data_ptr()}
    torch.manual_seed(1)
    out = method.loss(model, b, target)
    gc.collect()
    largest = max(n for ptr, n in storages().items() if ptr not in known)
    assert largest < copy, (largest, copy)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.mask_hidden.grad is not None


@pytest.mark.parametrize("T,size,B", [(23, 2, 2), (40, 3, 1), (7, 2, 2), (50, 4, 3)])
def test_deal_gives_each_rank_its_slice_and_the_slots_anchored_there(T, size, B):
    """Sequence parallel's split of a packed row: rank r runs depth 0 at its positions and exactly the slots anchored
    there, every rank as many entries; the ranks' entries, reordered, are the packed row's (in the order
    ``ParallelLayout`` plans without a mask)."""
    torch.manual_seed(T)
    att = torch.ones(B, T, dtype=torch.long)
    if B > 1:
        att[1, T - T // 3:] = 0
    packed = pack(att, 4, 0.7, 0.2)
    dealt = deal(packed, T, size)
    own = dealt.own
    assert own == -(-T // size) and len({x.anchor.shape for x in dealt.local}) == 1
    for r, mine in enumerate(dealt.local):
        assert torch.equal(mine.anchor[:, :own], (r * own + torch.arange(own)).expand(B, -1))
        slots = mine.valid & (mine.depth > 0)
        assert bool(((mine.anchor[slots] >= r * own) & (mine.anchor[slots] < (r + 1) * own)).all())
    ends = [torch.cat([getattr(x, f) for x in dealt.local], 1) for f in ("anchor", "depth", "valid")]
    for f, laid in zip(("anchor", "depth", "valid"), ends):
        assert torch.equal(laid.gather(1, dealt.order), getattr(dealt.whole, f)), f
    for b in range(B):
        entries = sorted(zip(packed.anchor[b][packed.valid[b]].tolist(), packed.depth[b][packed.valid[b]].tolist()))
        w = dealt.whole
        assert sorted(zip(w.anchor[b][w.valid[b]].tolist(), w.depth[b][w.valid[b]].tolist())) == entries
    assert ParallelLayout(dealt.whole.anchor, dealt.whole.depth, dealt.whole.valid).plan() is not None
