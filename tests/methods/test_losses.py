"""Shared loss helpers: the chunked target argmax, and the row padding of the soft cross-entropy and
the target's distribution."""

from __future__ import annotations

import pytest
import torch

from specheads.methods.losses import ROW_MULTIPLE, pad_rows, soft_cross_entropy, target_argmax, target_probs


def test_target_argmax_is_argmax_with_first_index_on_ties():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)
    weight = torch.randn(50, 16)
    logits_fn = lambda h: (h @ weight.T).to(torch.bfloat16)  # noqa: E731 - bf16 rounding makes ties likely
    want = (hidden @ weight.T).to(torch.bfloat16).argmax(-1)
    assert torch.equal(target_argmax(logits_fn, hidden, chunk=5), want)
    tied = torch.zeros(4, 50, dtype=torch.bfloat16)
    tied[:, [7, 3, 30]] = 1.0  # three maxima per row: the first index, 3
    assert target_argmax(lambda h: h, tied, chunk=3).tolist() == [3, 3, 3, 3]


class Recording(torch.nn.Module):
    """A linear head that records the row counts it is called with."""

    def __init__(self, h: int, v: int):
        super().__init__()
        self.linear = torch.nn.Linear(h, v)
        self.rows: list[int] = []

    def forward(self, x):
        self.rows.append(x.shape[0])
        return self.linear(x)


def test_pad_rows():
    x = torch.randn(5, 3)
    padded = pad_rows(x, 4)
    assert padded.shape == (8, 3) and torch.equal(padded[:5], x) and not padded[5:].any()
    whole = x[:4]
    assert pad_rows(whole, 4) is whole  # already a multiple: no copy


@pytest.mark.parametrize("n,chunk", [(37, 2048), (200, 128)])
def test_soft_cross_entropy_calls_the_head_on_recurring_row_counts_with_unchanged_results(n, chunk):
    # a new row count per step would make a new oneDNN primitive per step under bfloat16 autocast
    torch.manual_seed(0)
    head = Recording(16, 40)
    hidden = torch.randn(n, 16, requires_grad=True)
    probs = torch.softmax(torch.randn(n, 40), -1)
    loss, pred = soft_cross_entropy(head, hidden, probs, chunk=chunk)
    assert head.rows and all(r % ROW_MULTIPLE == 0 for r in head.rows)
    loss.backward()
    ref_hidden = hidden.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(head.linear(ref_hidden), -1)
    ref = -(probs * logp).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    assert torch.equal(pred, logp.argmax(-1)) and pred.shape == (n,)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad)


def test_target_probs_calls_the_target_on_recurring_row_counts():
    torch.manual_seed(0)
    head = Recording(16, 40)
    hidden = torch.randn(70, 16)
    columns = torch.tensor([1, 5, 9, 33])
    with torch.no_grad():
        probs, argmax = target_probs(head, hidden, columns, chunk=64)
        logits = head.linear(hidden)
    assert head.rows == [64, 64]  # 64 rows, then the 6 left padded to 64
    torch.testing.assert_close(probs, torch.softmax(logits[:, columns], -1))
    assert torch.equal(argmax, logits.argmax(-1))


def test_soft_cross_entropy_with_the_lk_term_is_the_same_chunked_and_whole():
    from specheads.methods.losses import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 12)
    h = torch.randn(10, 8, generator=g)
    p = torch.softmax(torch.randn(10, 12, generator=g) * 3, -1)
    whole, pred = soft_cross_entropy(head, h, p, chunk=64, lk_weight=0.3)
    parts, pred2 = soft_cross_entropy(head, h, p, chunk=3, lk_weight=0.3)
    q = torch.softmax(head(h), -1)
    want = (0.7 * -(p * q.log()).sum(-1) + 0.3 * -torch.log(torch.minimum(p, q).sum(-1))).sum()
    torch.testing.assert_close(whole, want)
    torch.testing.assert_close(parts, want)
    assert torch.equal(pred, pred2)
    plain, _ = soft_cross_entropy(head, h, p, chunk=64)
    assert not torch.allclose(plain, whole)
