"""Shared loss helpers: the chunked target argmax."""

from __future__ import annotations

import torch

from specheads.methods.losses import target_argmax


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
