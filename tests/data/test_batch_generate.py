"""The static-cache generation loop answers exactly what transformers' generate answers."""

import pytest
import torch

from specheads.data import batch_generate
from specheads.data.batch_generate import generate_static
from specheads.errors import UserError
from tests.conftest import make_tiny_model

PAD = 0


def hf_greedy(model, prompts, n, eos):
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=n, do_sample=False, pad_token_id=PAD,
                         eos_token_id=eos)[:, width:].tolist()
    res = []
    for row in out:
        res.append((row[: row.index(eos)], True) if eos in row else (row[:n], False))
    return res


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab=64, hidden=32, layers=2, seed=3)


PROMPTS = [[5, 9, 17], [3] * 11, [40, 41], [7, 8, 9, 10, 11, 12], [60], [22, 23, 24, 25]]


def test_greedy_rows_equal_generate_including_rows_that_finish_early(model, monkeypatch):
    n = 24
    free = hf_greedy(model, PROMPTS, n, eos=-1)  # no end-of-turn token: every row runs to n
    # an end-of-turn token that rows reach at different steps (and some never): rows leave the batch
    counts = torch.bincount(torch.tensor([t for row, _ in free for t in row]), minlength=64)
    eos = int(counts.argmax())
    expected = hf_greedy(model, PROMPTS, n, eos)
    assert 0 < sum(done for _, done in expected) < len(PROMPTS)
    compactions = []
    real = batch_generate._compact
    monkeypatch.setattr(batch_generate, "_compact", lambda c, keep: compactions.append(int(keep.sum())) or real(c, keep))
    got = generate_static(model, PROMPTS, n, eos_token_id=eos, pad_token_id=PAD)
    assert got == expected
    assert compactions, "no finished row left the batch"


def test_all_rows_finished_stops_early_and_cap_marks_unfinished(model):
    first = generate_static(model, PROMPTS, 1, eos_token_id=-1, pad_token_id=PAD)
    assert all(len(ids) == 1 and not done for ids, done in first)
    eos = first[0][0][0]
    got = generate_static(model, PROMPTS[:1], 50, eos_token_id=eos, pad_token_id=PAD)
    assert got == [([], True)]


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(model):
    a = generate_static(model, PROMPTS, 12, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, seed=7)
    b = generate_static(model, PROMPTS, 12, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, seed=7)
    c = generate_static(model, PROMPTS, 12, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, seed=8)
    greedy = generate_static(model, PROMPTS, 12, eos_token_id=-1, pad_token_id=PAD)
    assert a == b and a != c and a != greedy
    nucleus = generate_static(model, PROMPTS, 12, eos_token_id=-1, pad_token_id=PAD, temperature=1.0, top_p=1e-6,
                              seed=7)
    assert nucleus == greedy


def test_bad_arguments_are_user_errors(model):
    with pytest.raises(UserError, match="empty prompt"):
        generate_static(model, [[1, 2], []], 4, eos_token_id=3, pad_token_id=PAD)
    with pytest.raises(UserError, match="max_new_tokens"):
        generate_static(model, [[1, 2]], 0, eos_token_id=3, pad_token_id=PAD)


def test_stops_once_every_row_has_finished_even_if_an_early_one_stayed_in_the_batch(model, monkeypatch):
    """A row that finished while too few others had (no compaction) keeps running in the batch, drawing other
    tokens; once the last row finishes the loop must stop there, not run on to max_new_tokens."""
    EOS, A, B = 7, 11, 12
    script = [[A, A], [EOS, A], [B, A], [B, EOS], [B, B], [B, B]]  # row 0 ends at step 1, row 1 at step 3
    steps = iter(script)
    monkeypatch.setattr(batch_generate, "_next_tokens", lambda logits, *a: torch.tensor(next(steps)[: logits.shape[0]]))
    monkeypatch.setattr(batch_generate, "_compact", lambda cache, keep: False)  # nobody leaves the batch
    forwards = []
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(1) or real_forward(*a, **k))
    got = generate_static(model, PROMPTS[:2], 6, eos_token_id=EOS, pad_token_id=PAD)
    assert got == [([A], True), ([A, A, A], True)]
    assert len(forwards) == 4  # the prefill and three steps: none after the last row's end-of-turn token
