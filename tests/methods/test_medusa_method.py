import pytest
import torch
import torch.nn.functional as F

from tests.training.engine_helpers import sources
from specheads.models.medusa import MedusaHeads, medusa_for_target
from specheads.training.config import OptimConfig, TrainConfig
from specheads.training.engine import train
from specheads.methods.medusa import (TREE_FILE, Medusa1Method, Medusa2Method, Teacher, greedy_next_tokens,
                                     head_counts, head_losses, label_mask, read_medusa_tree, teacher_rows,
                                     tree_for_head)


def _tiny(seed=0):
    from tests.conftest import make_tiny_target

    return make_tiny_target("llama", hidden=32, layers=2, vocab=256, seed=seed)


def test_head_k_is_scored_on_token_t_plus_k_plus_2_where_the_mask_allows():
    target = _tiny()
    heads = medusa_for_target(target, num_heads=2)
    ids = torch.randint(0, 256, (1, 6))
    ok = torch.tensor([[0, 0, 1, 1, 0, 1]], dtype=torch.bool)
    hidden = torch.randn(1, 6, 32)
    loss, stats = head_losses(heads, hidden, ids, ok, decay=0.5)
    logits = target.logits(hidden)[0]
    ce0 = F.cross_entropy(logits[[0, 1, 3]], ids[0, [2, 3, 5]])  # labels 2, 3, 5 count
    ce1 = F.cross_entropy(logits[[0, 2]], ids[0, [3, 5]])
    torch.testing.assert_close(stats["head0_loss"], ce0)
    torch.testing.assert_close(loss, ce0 + 0.5 * ce1)



def _plain_head_losses(heads, hidden, ids, ok, decay):
    """The Medusa loss over each head's whole (N, V) logits, as head_losses computed it before chunking."""
    T, total = ids.shape[1], 0.0
    for k in range(heads.num_heads):
        s = k + 2
        rows = ok[:, s:]
        logits = heads.head_logits(hidden[:, : T - s][rows], k).float()
        ce = F.cross_entropy(logits, ids[:, s:][rows], reduction="sum") / max(1, int(rows.sum()))
        total = total + decay ** k * ce
    return total


@pytest.mark.parametrize("train_lm_heads", [True, False])
def test_head_losses_in_chunks_equal_the_whole_logits_loss_and_gradients(monkeypatch, train_lm_heads):
    import specheads.methods.losses as losses

    monkeypatch.setattr(losses, "LOGIT_CHUNK_BYTES", 64 * 256 * 4)  # 64 rows of the 256-token vocabulary a chunk
    target = _tiny()
    heads = medusa_for_target(target, num_heads=3)
    heads.lm_heads.requires_grad_(train_lm_heads)
    with torch.no_grad():  # blocks that are not the identity
        for p in heads.blocks.parameters():
            p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, 50), generator=g)
    ok = torch.rand(3, 50, generator=g) > 0.2  # ~115 labels a head: two chunks, the second padded
    hidden = torch.randn(3, 50, 32, generator=g)
    params = [p for p in heads.parameters() if p.requires_grad]
    loss, _ = head_losses(heads, hidden, ids, ok, 0.8)
    want = _plain_head_losses(heads, hidden, ids, ok, 0.8)
    got, ref = torch.autograd.grad(loss, params), torch.autograd.grad(want, params)
    torch.testing.assert_close(loss, want)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _, stats = head_losses(heads, hidden, ids, ok, 0.8)
    h0 = hidden[:, :48][ok[:, 2:]]
    want_acc = (heads.head_logits(h0, 0).argmax(-1) == ids[:, 2:][ok[:, 2:]]).float().mean()
    torch.testing.assert_close(stats["head0_acc"], want_acc)


@pytest.mark.parametrize("target_loss", ["lm", "kl"])
def test_medusa2_target_term_in_chunks_is_the_whole_logits_term(monkeypatch, target_loss):
    import specheads.methods.losses as losses

    monkeypatch.setattr(losses, "LOGIT_CHUNK_BYTES", 64 * 256 * 4)  # 64 rows a chunk
    target = _tiny()
    target.model.config.final_logit_softcapping = 2.0  # Gemma-2's cap, read from the adapted target's config
    model = Medusa2Method(num_heads=2, lora_r=2, target_loss=target_loss, kl_temperature=1.5).build(target)
    assert isinstance(model.base().lm_head, torch.nn.Linear)  # LoRA on all-linear leaves it: the chunked path
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (4, 40), generator=g)
    att = torch.ones_like(ids)
    ok = torch.rand(4, 40, generator=g) > 0.3  # ~110 next-token labels: two chunks
    h = torch.randn(4, 40, 32, generator=g, requires_grad=True)
    term = model._target_term(h, ids, att, ok)
    (got,) = torch.autograd.grad(term, h)
    pos = torch.zeros_like(ok)
    pos[:, :-1] = ok[:, 1:]
    logits = model._logits(h[pos])  # float32 and capped: output_logits
    assert float(logits.detach().abs().max()) <= 2.0 and logits.shape[0] > 64
    y = ids[:, 1:][ok[:, 1:]]
    if target_loss == "lm":
        want = F.cross_entropy(logits, y, reduction="sum") / y.numel()
    else:
        ref = model._logits(model.reference_hidden(ids, att)[pos])
        lp, lq = F.log_softmax(logits / 1.5, -1), F.log_softmax(ref / 1.5, -1)
        want = F.kl_div(lp, lq, log_target=True, reduction="sum") * 1.5 ** 2 / y.numel()
    (ref_grad,) = torch.autograd.grad(want, h)
    torch.testing.assert_close(term, want)
    torch.testing.assert_close(got, ref_grad)

def test_held_out_counts_and_chain_are_joint():
    target = _tiny()
    heads = medusa_for_target(target, num_heads=2)
    hidden = torch.randn(2, 8, 32)
    pred = target.logits(hidden).argmax(-1)  # fresh heads predict what the target predicts
    ids = torch.randint(0, 256, (2, 8))
    ids[:, 2:] = pred[:, :-2]  # head 0 right everywhere
    ok = torch.ones(2, 8, dtype=torch.bool)
    c = head_counts(heads, hidden, ids, ok, top_k=3)
    assert c["head0_top1_correct"] == c["head0_top1_total"] == 12
    assert c["head1_top1_total"] == c["chain1_total"] == 10
    assert c["chain1_correct"] == c["head1_top1_correct"]  # head 0 always right -> chain = head 1
    assert c["head1_top3_correct"] >= c["head1_top1_correct"]


def test_argmax_accuracy_scores_heads_against_the_targets_greedy_tokens():
    """On data the target wrote greedily, head k's argmax accuracy equals its data accuracy; on other
    data it is scored against the target's own next-token choices, not the data."""
    target = _tiny()
    heads = medusa_for_target(target, num_heads=2)
    hidden = torch.randn(2, 8, 32)
    ok = torch.ones(2, 8, dtype=torch.bool)
    ok[1, 6:] = False
    nxt = greedy_next_tokens(target, hidden, ok)
    greedy = target.logits(hidden).argmax(-1)
    assert torch.equal(nxt[:, 1:][ok[:, 1:]], greedy[:, :-1][ok[:, 1:]])
    assert (nxt[:, 0] == -1).all() and (nxt[1, 6:] == -1).all()
    data = torch.randint(0, 256, (2, 8))
    c = head_counts(heads, hidden, data, ok, top_k=3, greedy_next=nxt)
    # fresh heads are the target's LM head: head k at t predicts greedy[t], compared with greedy[t+k+1]
    for k in range(2):
        s = k + 2
        rows = ok[:, s:]
        want = (greedy[:, : 8 - s] == greedy[:, s - 1: 7])[rows]
        assert c[f"head{k}_argmax_correct"] == float(want.sum())
        assert c[f"head{k}_argmax_total"] == float(rows.sum())
    greedy_data = torch.zeros(2, 8, dtype=torch.long)
    greedy_data[:, 1:] = greedy[:, :-1]  # the target's greedy continuation as the data
    c = head_counts(heads, hidden, greedy_data, ok, top_k=3, greedy_next=nxt)
    assert c["head0_argmax_correct"] == c["head0_top1_correct"]


def test_medusa1_evaluate_reports_target_accuracy_and_argmax_counts():
    target = _tiny()
    method = Medusa1Method(num_heads=2)
    model = method.build(target)
    ids = torch.randint(0, 256, (2, 7))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "hidden_last": torch.randn(2, 7, 32)}
    out = method.evaluate(model, batch, target)
    want = target.logits(batch["hidden_last"]).argmax(-1)[:, :-1] == ids[:, 1:]
    assert out["target_top1_correct"] == float(want.sum()) and out["target_top1_total"] == 12
    assert out["head0_argmax_total"] == 10 and out["head1_argmax_total"] == 8
    assert label_mask(batch).all()


def test_teacher_rows_align_head_k_with_the_targets_distribution_of_token_t_plus_k_plus_2():
    target = _tiny()
    heads = medusa_for_target(target, num_heads=2)
    ids = torch.randint(0, 256, (2, 7))
    ok = torch.ones(2, 7, dtype=torch.bool)
    ok[0, :3] = False
    hidden = torch.randn(2, 7, 32)
    t = teacher_rows(target, hidden, ok)
    b, p = (t.row_of >= 0).nonzero(as_tuple=True)
    assert torch.equal(ok[b, p + 1], torch.ones_like(b, dtype=torch.bool)) and len(b) == int(ok[:, 1:].sum())
    torch.testing.assert_close(t.probs[t.row_of[b, p]], torch.softmax(target.logits(hidden[b, p]), -1))
    # One-hot teacher rows holding the data token make the soft loss the data CE, term for term.
    onehot = torch.zeros_like(t.probs)
    onehot[t.row_of[b, p], ids[b, p + 1]] = 1.0
    soft, soft_stats = head_losses(heads, hidden, ids, ok, 0.8, Teacher(onehot, t.row_of))
    hard, hard_stats = head_losses(heads, hidden, ids, ok, 0.8)
    torch.testing.assert_close(soft, hard)
    torch.testing.assert_close(soft_stats["head1_loss"], hard_stats["head1_loss"])
    # With the target's own distribution, the loss differs and still has gradients for the blocks.
    loss, _ = head_losses(heads, hidden, ids, ok, 0.8, t)
    assert not torch.isclose(loss, hard)
    loss.backward()
    assert heads.blocks[1].layers[0].weight.grad.abs().sum() > 0


def test_medusa1_labels_option_trains_and_rejects_bad_values(tmp_path):
    s = _run(Medusa1Method(num_heads=2, labels="target"), tmp_path, 3, _tiny())
    # agreement with the target's greedy token, counted twice: by argmax and as rank 0 of the top-k
    assert s["steps"] == 3 and s["eval"]["head0_argmax_acc"] == s["eval"]["head0_rank0_acc"]
    with pytest.raises(ValueError, match="labels must be 'data' or 'target'"):
        Medusa1Method(labels="soft")
    with pytest.raises(ValueError, match="labels=data"):
        Medusa2Method(labels="target")


def _run(method, out, steps, target, lr=1e-2):
    train_src, held = sources()
    cfg = TrainConfig(output_dir=str(out), max_steps=steps, save_every=0, eval_every=0, wandb_mode="disabled",
                      progress=False)
    return train(method, target, train_src, cfg, OptimConfig(lr=lr, warmup_steps=2), held)


def test_medusa2_moves_lora_beats_medusa1_and_keeps_drift_small(tmp_path):
    """Equal steps and LR. Stated drift bound: held-out KL(original || adapted) < 0.01 nats/token
    (measured 0.0014; head accuracies summed 0.74 vs Medusa-1's 0.69)."""
    m1 = _run(Medusa1Method(num_heads=2), tmp_path / "m1", 50, _tiny(), lr=2e-2)
    target = _tiny()
    method = Medusa2Method(num_heads=2, lora_r=4, lora_alpha=8, heads_warmup_steps=5)
    m2 = _run(method, tmp_path / "m2", 50, target, lr=2e-2)
    lora_b = [p for n, p in target.model.named_parameters() if "lora_B" in n]
    assert lora_b and max(float(p.detach().abs().max()) for p in lora_b) > 0  # LoRA moved from zero
    e1, e2 = m1["eval"], m2["eval"]
    assert e2["head0_top1_acc"] + e2["head1_top1_acc"] > e1["head0_top1_acc"] + e1["head1_top1_acc"]
    assert 0 <= e2["drift_kl"] < 0.01
    assert e2["ppl"] > 1 and e2["original_ppl"] > 1


def test_medusa2_save_writes_heads_and_merged_target(tmp_path):
    from transformers import AutoModelForCausalLM

    target = _tiny()
    s = _run(Medusa2Method(num_heads=2, lora_r=4), tmp_path, 4, target, lr=5e-2)
    head_dir = tmp_path / "head"
    heads = MedusaHeads.from_pretrained(head_dir)
    assert heads.config.adapted_target == "target"
    merged = AutoModelForCausalLM.from_pretrained(head_dir / "target")
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        adapted = target.model(input_ids=ids).logits  # LoRA adapters active
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, atol=1e-4, rtol=1e-4)
        original = _tiny().model(input_ids=ids).logits  # same seed: the untouched target
        assert not torch.allclose(original, adapted, atol=1e-5)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert s["eval"]["drift_kl"] > 0  # the adapted target moved (above): its distribution drifted
    # The static tree is calibrated against the adapted target's greedy tokens and saved with the heads.
    tree = read_medusa_tree(head_dir)
    assert len(tree["rank_accuracy"]) == 2 and tree["rank_accuracy"][0][0] == s["eval"]["head0_rank0_acc"]
    assert s["eval"]["tau_vs_target_greedy"] == 1.0


def test_medusa2_rejects_bad_settings():
    with pytest.raises(ValueError, match="adapter"):
        Medusa2Method(adapter="qlora")
    with pytest.raises(ValueError, match="target_loss"):
        Medusa2Method(target_loss="mse")


@pytest.mark.parametrize("method", [Medusa1Method(num_heads=2), Medusa2Method(num_heads=2, lora_r=2)])
def test_bfloat16_target_trains_float32_heads(tmp_path, method):
    from tests.conftest import make_tiny_target

    target = make_tiny_target("llama", hidden=32, layers=2, vocab=256, dtype=torch.bfloat16)
    s = _run(method, tmp_path, 2, target)
    from specheads.acceptance_math import estimate_tau

    assert s["steps"] == 2 and s["eval"]["tau_estimate"] == pytest.approx(estimate_tau(s["eval"])[0])
    assert MedusaHeads.from_pretrained(tmp_path / "head").lm_heads[0].weight.dtype == torch.float32


def test_frozen_output_layers_stay_equal_to_the_target_lm_head(tmp_path):
    """train_lm_heads=False: only the residual blocks learn; the saved output layers are still the
    target's LM head (so the exported layout is unchanged)."""
    target = _tiny()
    _run(Medusa1Method(num_heads=2, train_lm_heads=False), tmp_path, 4, target)
    heads = MedusaHeads.from_pretrained(tmp_path / "head")
    for k in range(2):
        torch.testing.assert_close(heads.lm_heads[k].weight, target.lm_head.weight, rtol=0, atol=0)
    assert any(float(b.detach().abs().max()) > 0 for n, b in heads.blocks.named_parameters() if "weight" in n)
    _run(Medusa1Method(num_heads=2), tmp_path / "trained", 4, _tiny())
    moved = MedusaHeads.from_pretrained(tmp_path / "trained" / "head")
    assert not torch.equal(moved.lm_heads[0].weight, target.lm_head.weight)


# --------------------------------------------------------------------------- one basis: the target's greedy token


def _off_greedy_batch(target, B=2, T=9):
    """Data on which fresh heads (= the target's LM head) are right at every data label but mostly
    wrong against the target's greedy tokens: head 0 at t predicts greedy[t], and the data token
    t+2 is greedy[t], while the greedy token t+2 is greedy[t+1]."""
    hidden = torch.randn(B, T, 32, generator=torch.Generator().manual_seed(3))
    greedy = target.logits(hidden).argmax(-1)
    ids = torch.zeros(B, T, dtype=torch.long)
    ids[:, 2:] = greedy[:, :-2]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids),
             "hidden_last": hidden}
    return batch, greedy


def test_chain_estimate_is_scored_against_the_targets_greedy_token():
    """The τ estimate's chain{k} (heads 0..k all right) compares with what greedy verification
    compares with, the target's argmax, not the data token (EAGLE's joint{k} basis)."""
    target = _tiny()
    method = Medusa1Method(num_heads=2)
    model = method.build(target)
    batch, greedy = _off_greedy_batch(target)
    out = method.evaluate(model, batch, target)
    assert out["head0_top1_correct"] == out["head0_top1_total"] == 14  # right against the data everywhere
    want0 = greedy[:, :7] == greedy[:, 1:8]  # head 0 at t: greedy[t] vs the greedy token t+2 = greedy[t+1]
    assert out["chain0_correct"] == out["head0_argmax_correct"] == float(want0.sum()) < 14
    want1 = want0[:, :6] & (greedy[:, :6] == greedy[:, 2:8])
    assert out["chain1_correct"] == float(want1.sum()) and out["chain1_total"] == 12
    assert method.summarize({})["tau_vs_target_greedy"] == 1.0


def test_rank_counts_are_each_ranks_hits_on_the_greedy_token():
    target = _tiny()
    heads = medusa_for_target(target, num_heads=2)
    with torch.no_grad():
        heads.blocks[1].layers[0].weight.normal_(0, 0.5)  # head 1 differs from the target
    hidden = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(5))
    ok = torch.ones(2, 10, dtype=torch.bool)
    ok[0, 8:] = False
    data = torch.randint(0, 256, (2, 10))
    nxt = greedy_next_tokens(target, hidden, ok)
    c = head_counts(heads, hidden, data, ok, top_k=3, greedy_next=nxt, ranks=4)
    for k in range(2):
        s = k + 2
        rows = ok[:, s:]
        top = heads.head_logits(hidden[:, : 10 - s][rows], k).topk(4, -1).indices
        g = nxt[:, s:][rows]
        for r in range(4):
            assert c[f"head{k}_rank{r}_correct"] == float((top[:, r] == g).sum()), (k, r)
            assert c[f"head{k}_rank{r}_total"] == float(rows.sum())
        assert c[f"head{k}_rank0_correct"] == c[f"head{k}_argmax_correct"]


def test_training_saves_a_tree_calibrated_on_held_out_rows(tmp_path):
    """The static tree comes from held-out *training* rows at save time, beside the heads; the
    evaluator rebuilds it from those accuracies at any node budget, fitting nothing itself."""
    from specheads.decoding.tree import choices_from_accuracies

    s = _run(Medusa1Method(num_heads=2, tree_nodes=6), tmp_path, 3, _tiny())
    tree = read_medusa_tree(tmp_path / "head")
    acc = [[s["eval"][f"head{k}_rank{r}_acc"] for r in range(8)] for k in range(2)]
    assert tree["rank_accuracy"] == acc and tree["calibrated_on"] == "held-out training rows"
    assert [tuple(c) for c in tree["medusa_choices"]] == choices_from_accuracies(acc, 6)
    choices, source = tree_for_head(tmp_path / "head", 2, 10)
    assert choices == choices_from_accuracies(acc, 10) and TREE_FILE in source
    assert s["eval"]["tau_vs_target_greedy"] == 1.0
    # the τ estimate comes from the greedy-basis chain
    c = [s["eval"]["chain0_acc"], s["eval"]["chain1_acc"]]
    assert s["tau_estimate"] == pytest.approx(1 + c[0] + c[1])


def test_no_held_out_rows_no_tree_and_a_default_shape(tmp_path):
    from specheads.methods.medusa import default_choices

    method = Medusa1Method(num_heads=3)
    target = _tiny()
    method.save(method.build(target), str(tmp_path), target)  # never evaluated
    assert not (tmp_path / TREE_FILE).exists()
    choices, source = tree_for_head(tmp_path, 3, 12)
    assert choices == default_choices(3, 12) and source.startswith("default")
    assert len(choices) == 12 and max(map(len, choices)) <= 3


def test_medusa2_refuses_a_tensor_parallel_target():
    from specheads.errors import ConfigError
    from specheads.targets import ParallelLayout, Target

    tiny = _tiny()
    split = Target(tiny.model, name="tiny-tp", layout=ParallelLayout("tp", world=2, rank=0, tp_size=2))
    with pytest.raises(ConfigError, match="tensor-parallel"):
        Medusa2Method(num_heads=1).build(split)


def test_the_teacher_loss_keeps_no_copy_of_a_heads_labels_for_backward():
    """Each head's soft labels are rows of the teacher's table, gathered a chunk at a time inside the loss: between
    the forward and the backward no tensor but that table is as large as one head's (n, V) labels. Copying them per
    head (``teacher.probs[rows]``) keeps each copy alive for backward. Over 2,048 rows a head, so the loss runs in
    checkpointed chunks, which keep no logits either."""
    import gc

    target = _tiny()
    heads = medusa_for_target(target, num_heads=3)
    ids = torch.randint(0, 256, (2, 1100))
    ok = torch.ones(2, 1100, dtype=torch.bool)
    hidden = torch.randn(2, 1100, 32)
    t = teacher_rows(target, hidden, ok)
    copy = (2 * (1100 - 4)) * 256 * 4  # the last head's labels: 2 rows of 1100 - 2 - 2 positions
    assert copy > 2 * sum(p.numel() * 4 for p in heads.parameters() if p.dim() == 2 and p.shape[0] == 256)

    def storages():
        return {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and not o.is_meta and not o.is_mkldnn}

    gc.collect()
    known = set(storages())
    loss, _ = head_losses(heads, hidden, ids, ok, 0.8, t)
    gc.collect()
    largest = max(n for ptr, n in storages().items() if ptr not in known)
    assert largest < copy, (largest, copy)
    loss.backward()
    assert heads.blocks[2].layers[0].weight.grad.abs().sum() > 0
