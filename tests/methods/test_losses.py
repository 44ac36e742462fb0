"""Shared loss helpers: the chunked target argmax, and the row padding of the soft cross-entropy and
the target's distribution."""

from __future__ import annotations

import pytest
import torch

from specheads.methods.losses import ROW_MULTIPLE, pad_rows, soft_cross_entropy, target_probs
from specheads.targets import target_argmax


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


# --------------------------------------------------------------------------- linear_cross_entropy


def _plain_ce(hidden, weight, labels, bias=None, softcap=None):
    """The reference: the whole (N, V) float32 logits, as the methods computed them before."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum"), logits.argmax(-1)


def _leaves(dtype, n=150, h=16, v=300, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype).requires_grad_(True)
    b = torch.randn(v, generator=g).to(dtype).requires_grad_(True) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100  # ignored rows
    return hidden, weight, b, labels


def _grads(fn, leaves, scale=0.25):
    """fn's loss, argmax and the gradients of ``scale * loss`` (a scaled sum, as a weighted head's is)."""
    for t in leaves:
        if t is not None:
            t.grad = None
    loss, pred = fn()
    (scale * loss).backward()
    return loss.detach(), pred, [None if t is None else t.grad.clone() for t in leaves]


# float32: float32 tolerance; bfloat16: the reference itself rounds its bf16 matmuls differently (once over all rows)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("chunk", [7, 64, 100, 150, 1000])  # 7 and 64 do not divide 150
def test_linear_cross_entropy_equals_the_plain_loss_and_gradients(dtype, softcap, chunk):
    from specheads.methods.losses import linear_cross_entropy

    hidden, weight, bias, labels = _leaves(dtype)
    leaves = (hidden, weight, bias)
    got = _grads(lambda: linear_cross_entropy(hidden, weight, labels, bias, softcap=softcap, chunk=chunk), leaves)
    want = _grads(lambda: _plain_ce(hidden, weight, labels, bias, softcap), leaves)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-3)  # a sum of ~130 rows of ~6 nats
    assert torch.equal(got[1], want[1])
    for name, a, b in zip(("hidden", "weight", "bias"), got[2], want[2]):
        assert a.dtype == b.dtype == dtype, name
        torch.testing.assert_close(a, b, **TOL[dtype], msg=name)


def test_linear_cross_entropy_without_bias_frozen_weight_and_no_grad():
    from specheads.methods.losses import linear_cross_entropy

    hidden, weight, _, labels = _leaves(torch.float32, bias=False)
    weight.requires_grad_(False)  # a frozen output layer (Medusa's train_lm_heads=false, the target's LM head)
    got = _grads(lambda: linear_cross_entropy(hidden, weight, labels, chunk=64), (hidden,))
    want = _grads(lambda: _plain_ce(hidden, weight, labels), (hidden,))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[2][0], want[2][0])
    assert weight.grad is None
    with torch.no_grad():
        loss, pred = linear_cross_entropy(hidden, weight, labels, chunk=64)
    assert not loss.requires_grad and torch.equal(pred, want[1])
    empty, none = linear_cross_entropy(hidden[:0], weight, labels[:0])
    assert float(empty.detach()) == 0.0 and none.shape == (0,)


def test_linear_cross_entropy_under_bfloat16_autocast_matches_the_plain_layer():
    from specheads.methods.losses import linear_cross_entropy

    hidden, weight, bias, labels = _leaves(torch.float32)
    leaves = (hidden, weight, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(lambda: linear_cross_entropy(hidden, weight, labels, bias, chunk=64), leaves)
        want = _grads(lambda: _plain_ce(hidden, weight, labels, bias), leaves)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-3)
    assert torch.equal(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **TOL[torch.bfloat16])


def test_linear_cross_entropy_refuses_a_second_backward_through_its_graph():
    from specheads.methods.losses import linear_cross_entropy

    hidden, weight, bias, labels = _leaves(torch.float32)
    loss, _ = linear_cross_entropy(hidden, weight, labels, bias)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):  # its gradients were scaled in place: never twice
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_per_row_linear_cross_entropy_weighted_later_equals_the_plain_loss_and_gradients(dtype, softcap, chunk):
    from specheads.methods.losses import linear_cross_entropy

    hidden, weight, bias, labels = _leaves(dtype)
    weight.requires_grad_(False)
    bias.requires_grad_(False)  # a frozen output layer: the target's LM head, as DFlash trains through it
    w = torch.rand(hidden.shape[0], generator=torch.Generator().manual_seed(1))  # per-row weights made afterwards

    def plain():
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)

    rows, pred = linear_cross_entropy(hidden, weight, labels, bias, softcap, chunk=chunk, reduction="none")
    want_rows, want_pred = plain()
    assert rows.shape == (hidden.shape[0],) and rows.dtype == torch.float32
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, want_pred) and float(rows[::7].abs().sum()) == 0.0  # ignored rows count nothing
    (rows * w).sum().backward()
    got = hidden.grad.clone()
    hidden.grad = None
    (plain()[0] * w).sum().backward()
    assert got.dtype == dtype
    torch.testing.assert_close(got, hidden.grad, **TOL[dtype])


def test_per_row_linear_cross_entropy_refuses_an_output_layer_that_trains():
    from specheads.methods.losses import linear_cross_entropy

    hidden, weight, bias, labels = _leaves(torch.float32)  # weight and bias require gradients
    with pytest.raises(ValueError, match="frozen output layer"):
        linear_cross_entropy(hidden, weight, labels, bias, reduction="none")
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, bias, reduction="mean")


class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements of any tensor an operator returns (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_linear_cross_entropy_never_makes_a_tensor_of_all_rows_logits(softcap):
    from specheads.methods.losses import linear_cross_entropy

    n, v, chunk = 512, 300, 64
    hidden, weight, bias, labels = _leaves(torch.float32, n=n, v=v)
    for fn, bound in ((lambda: _plain_ce(hidden, weight, labels, bias, softcap), None),
                      (lambda: linear_cross_entropy(hidden, weight, labels, bias, softcap, chunk=chunk), chunk * v)):
        with LargestTensor() as seen:
            loss, _ = fn()
            loss.backward()
        if bound is None:  # the test sees the plain loss's (N, V) logits
            assert seen.numel >= n * v
        else:
            assert seen.numel <= bound < n * v, seen.numel


def test_logit_chunk_rows():
    from specheads.methods.losses import LOGIT_CHUNK_BYTES, logit_chunk_rows

    assert logit_chunk_rows(128256) == 512  # 256 MiB of float32 logits at Llama 3's vocabulary
    assert logit_chunk_rows(10**9) == ROW_MULTIPLE  # never fewer rows than one padding multiple
    for v in (1000, 49152, 151936):
        rows = logit_chunk_rows(v)
        assert rows % ROW_MULTIPLE == 0 and rows * v * 4 <= max(LOGIT_CHUNK_BYTES, ROW_MULTIPLE * v * 4)
