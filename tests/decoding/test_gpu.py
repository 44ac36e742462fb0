"""The engine on CUDA: greedy exactness and a sampled run (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import peaky_model, reference_greedy
from specheads.decoding.drafters import ModelDrafter, TreeShape
from specheads.decoding.generate import speculative_generate
from specheads.decoding.runner import TargetRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_cuda_greedy_exact_and_sampling_runs(attn):
    m = peaky_model(attn=attn)
    prompts = [[5, 9, 13, 2, 7], [1, 2, 3]]
    ref = [reference_greedy(m, p, 12) for p in prompts]
    m = m.cuda()
    for shape in (TreeShape("chain", k=3), TreeShape("dynamic", depth=3, topk=2, total_tokens=5)):
        res = speculative_generate(TargetRunner(m), ModelDrafter(m, shape), prompts, 12)
        assert res.tokens == ref
    g = torch.Generator().manual_seed(0)
    res = speculative_generate(TargetRunner(m), ModelDrafter(m, TreeShape("chain", k=3)), prompts, 12,
                               temperature=1.0, generator=g)
    assert all(len(t) == 12 for t in res.tokens)
