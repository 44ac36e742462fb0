"""TargetRunner: tree forwards equal full recomputation; commits keep exactly the accepted path."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import peaky_model
from specheads.decoding.runner import TargetRunner

# float64; logits are O(100) in these peaky models, and masked sums run in another order
TOL = dict(atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_logits_equal_full_forward_per_branch(attn):
    m = peaky_model(attn=attn)
    prompt = [3, 1, 4, 1, 5]
    r = TargetRunner(m)
    r.prefill([prompt])
    # root (pending 5) + tree: a=7 (parent root), b=8 (root), c=9 (parent a), d=2 (parent c)
    tok = torch.tensor([[5, 7, 8, 9, 2]])
    par = torch.tensor([[-1, 0, 0, 1, 3]])
    out = r.forward(tok, par)
    with torch.no_grad():
        for idx, path in {1: [7], 2: [8], 3: [7, 9], 4: [7, 9, 2]}.items():
            full = m(torch.tensor([prompt + path])).logits[0, -1]
            torch.testing.assert_close(out.logits[0, idx], full, **TOL)
    r.commit([[0, 1, 3]])  # keep root, a, c
    nxt = r.forward(torch.tensor([[6]]), torch.tensor([[-1]]))
    with torch.no_grad():
        want = m(torch.tensor([prompt + [7, 9, 6]])).logits[0, -1]
    torch.testing.assert_close(nxt.logits[0, 0], want, **TOL)


def test_batch_rows_with_holes_match_single_rows():
    m = peaky_model()
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    r = TargetRunner(m)
    r.prefill(prompts)
    out = r.forward(torch.tensor([[6, 10, 11], [9, 12, 13]]), torch.tensor([[-1, 0, 1], [-1, 0, 0]]))
    r.commit([[0, 1, 2], [0, 2]])  # row 1 keeps one entry fewer: a hole
    assert r.num_tokens.tolist() == [8, 4]
    nxt = r.forward(torch.tensor([[20], [21]]), torch.tensor([[-1], [-1]]))
    with torch.no_grad():
        a = m(torch.tensor([prompts[0] + [10, 11, 20]])).logits[0, -1]
        b = m(torch.tensor([prompts[1] + [13, 21]])).logits[0, -1]
    torch.testing.assert_close(nxt.logits[0, 0], a, **TOL)
    torch.testing.assert_close(nxt.logits[1, 0], b, **TOL)
    assert out.logits.shape == (2, 3, 64)


def test_discard_and_bad_commit():
    m = peaky_model()
    r = TargetRunner(m)
    r.prefill([[1, 2, 3]])
    r.forward_chain([[3, 4, 5]])
    r.discard()
    assert r.cache.get_seq_length() == 2 and r.scratch_size == 0
    r.forward_chain([[3]])
    with pytest.raises(ValueError, match="outside"):
        r.commit([[0, 1]])
    with pytest.raises(ValueError, match="at least 2 tokens"):
        r.prefill([[1]])


def test_a_commit_moves_only_the_kept_entries():
    """The accepted path is written over the first scratch slots of the same cache tensors: no
    layer's keys or values are reallocated (a concatenation would copy the whole cache each step)."""
    m = peaky_model()
    prompt = [3, 1, 4, 1, 5]
    r = TargetRunner(m)
    r.prefill([prompt])
    r.forward(torch.tensor([[5, 7, 8, 9]]), torch.tensor([[-1, 0, 0, 2]]))
    before = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in r.cache.layers]
    r.commit([[0, 2, 3]])  # root, b, its child: not the leading entries, so entries move
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in r.cache.layers] == before
    assert r.cache.get_seq_length() == len(prompt) - 1 + 3
    nxt = r.forward(torch.tensor([[6]]), torch.tensor([[-1]]))
    with torch.no_grad():
        want = m(torch.tensor([prompt + [8, 9, 6]])).logits[0, -1]
    torch.testing.assert_close(nxt.logits[0, 0], want, **TOL)


def test_rewind_gives_back_the_context_a_fresh_prefill_leaves():
    """After a tree, commits and more tokens, ``rewind`` to the prompt's committed slots: the next forwards give
    bitwise what they give after a fresh prefill of the prompt (the exactness proof walks each leaf so)."""
    model = peaky_model()
    prompt = [3, 9, 4, 17, 22, 5]
    fresh = TargetRunner(model)
    fresh.prefill([prompt])
    want = fresh.forward(torch.tensor([[7, 8]]), torch.tensor([[-1, 0]])).logits
    r = TargetRunner(model)
    r.prefill([prompt])
    base = r.slots.committed
    r.forward(torch.tensor([[1, 2, 3]]), torch.tensor([[-1, 0, 0]]))
    r.commit([[0, 1]])
    r.forward(torch.tensor([[11]]), torch.tensor([[-1]]))
    r.rewind(base)
    assert r.slots.committed == base and r.slots.scratch == 0 and int(r.slots.num_tokens[0]) == len(prompt) - 1
    assert r.cache.get_seq_length() == base
    assert torch.equal(r.forward(torch.tensor([[7, 8]]), torch.tensor([[-1, 0]])).logits, want)
    with pytest.raises(ValueError, match="truncate"):
        r.rewind(base + 5)


def test_a_long_prompt_is_prefilled_in_chunks_with_the_states_and_cache_of_one_forward(monkeypatch):
    """Chunks of 4 tokens over a ragged batch (rows of 11 and 3 prompt tokens): the prompt's states, the committed
    slots and the next forward's logits are one whole-prompt forward's; no forward sees more than 4 queries."""
    m = peaky_model()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [7, 8, 9, 4]]
    whole, chunked = TargetRunner(m), TargetRunner(m)
    a = whole.prefill(prompts)
    queries = []
    forward = TargetRunner.forward
    monkeypatch.setattr(TargetRunner, "forward", lambda self, tok, *x, **k: (queries.append(tok.shape[1]),
                                                                             forward(self, tok, *x, **k))[1])
    b = chunked.prefill(prompts, chunk=4)
    assert queries == [4, 4, 3]
    for row, n in enumerate(len(p) - 1 for p in prompts):
        torch.testing.assert_close(b.hidden_last[row, :n], a.hidden_last[row, :n], **TOL)
    assert torch.equal(chunked.num_tokens, whole.num_tokens)
    nxt = torch.tensor([[12], [4]]), torch.tensor([[-1], [-1]])
    torch.testing.assert_close(chunked.forward(*nxt).logits, whole.forward(*nxt).logits, **TOL)
