"""EAGLE-3 on the real SmolLM2 and real ShareGPT data: a briefly trained head beats a bigram model.

Both learn from the same few thousand training tokens (a CPU-sized budget) and are scored on the
same held-out labels ``ids[t+2]``; the drafter also sees the target's features, so it must win.
"""

from __future__ import annotations

import pytest
import torch

from specheads.methods.eagle3 import Eagle3Method
from specheads.methods.ttt import step_rows

T, BATCH, TRAIN_BATCHES, HELD, EPOCHS = 192, 4, 4, 8, 8


def _chunks(rows, n):
    """First T tokens of the first n rows that have at least T tokens and some loss tokens."""
    out = [r for r in rows if len(r["input_ids"]) >= T and sum(r["loss_mask"][2:T]) > 0][:n]
    ids = torch.tensor([r["input_ids"][:T] for r in out])
    mask = torch.tensor([r["loss_mask"][:T] for r in out], dtype=torch.long)
    return ids, mask


def _batch(target, method, ids, mask):
    f = target.forward_features(ids, torch.ones_like(ids), aux_layers=method.feature_spec.aux_layers)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask, "hidden_last": f.last,
            "hidden_aux": torch.cat(f.aux, -1)}


@pytest.fixture(scope="module")
def prepared_sharegpt(tmp_path_factory, smollm2):
    """The packaged ShareGPT's first 300 usable chats, prepared for SmolLM2 (a few seconds)."""
    from specheads.data.prepare import PrepareConfig, prepare
    from specheads.targets import Target

    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(Target.tokenizer_only(smollm2.tokenizer, "smollm2"), PrepareConfig(num_samples=300, max_length=512), out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_trained_step0_beats_bigram(smollm2, prepared_sharegpt):
    from specheads.data.prepare import load_prepared
    from specheads.training.baselines import bigram_accuracy

    torch.manual_seed(0)
    data, _ = load_prepared(str(prepared_sharegpt))
    n = len(data)
    train_rows, held_rows = data.select(range(n - 64)), data.select(range(n - 64, n))
    method = Eagle3Method(draft_vocab_size=2048, vocab_data=train_rows, ttt_steps=1)
    model = method.build(smollm2).train()
    ids, mask = _chunks(train_rows, BATCH * TRAIN_BATCHES)
    batches = [_batch(smollm2, method, ids[i:i + BATCH], mask[i:i + BATCH]) for i in range(0, len(ids), BATCH)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    for epoch in range(EPOCHS):
        for batch in batches:
            out = method.loss(model, batch, smollm2)
            opt.zero_grad()
            out.loss.backward()
            opt.step()

    held_ids, held_mask = _chunks(held_rows, HELD)
    held = _batch(smollm2, method, held_ids, held_mask)
    model.eval()
    with torch.no_grad():
        h, logits = model.step(model.fuse(held["hidden_aux"]), torch.roll(held_ids, -1, 1),
                               torch.arange(T).expand_as(held_ids))
        pred = model.to_target_ids(logits.argmax(-1))
    b, t = step_rows(held, 0)
    drafter = float((pred[b, t] == held_ids[b, t + 2]).float().mean())  # same labels as the bigram: ids[t+2]
    held_cols = {"input_ids": held_ids.tolist(), "loss_mask": held_mask.tolist()}
    bigram = bigram_accuracy({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}, held_cols)
    bigram_all = bigram_accuracy(train_rows, held_cols)  # fitted on every training conversation: for the log
    vs_target = method.evaluate(model, held, smollm2)
    print(f"step-0 held-out accuracy vs data {drafter:.3f}, bigram (same data) {bigram:.3f}, "
          f"bigram (all {len(train_rows)} training conversations) {bigram_all:.3f}, "
          f"vs target argmax {vs_target['step0_correct'] / vs_target['step0_total']:.3f}")
    assert drafter > bigram
