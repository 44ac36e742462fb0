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


def _syncs_per_step(model, head, B: int) -> float:
    """Synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode``) per step of a batch of B rows drafted by an
    EAGLE-3 dynamic tree and verified in one batched call."""
    import warnings

    from specheads.decoding.head_drafters import EagleDrafter

    g = torch.Generator().manual_seed(B)
    prompts = torch.randint(0, model.config.vocab_size, (B, 12), generator=g).tolist()
    drafter = EagleDrafter(head, TreeShape("dynamic", depth=3, topk=2, total_tokens=6), "eagle3")
    runner = TargetRunner(model)
    speculative_generate(runner, drafter, prompts, 4, verify_backend="auto")  # warm-up: kernels compiled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            res = speculative_generate(runner, drafter, prompts, 8, verify_backend="auto")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert syncs > 0  # the mode reports (a step needs the verdicts on the host at least once)
    return syncs / len(res.batch_forward_sizes)


def test_batched_step_waits_for_the_gpu_as_often_at_any_batch_size():
    """A step's host waits (copies to the host, ``.item()``, ``.tolist()``) do not grow with the batch: drafting,
    verification and commits move a whole batch's values at once (a copy per row and tree level cost a wait
    each, which is what kept batching from paying on a GPU)."""
    from specheads.models.eagle3 import Eagle3Config, Eagle3Model
    from specheads.targets import Target

    m = peaky_model(layers=4).float().cuda()
    target = Target(m, name="tiny")
    torch.manual_seed(0)
    head = Eagle3Model(Eagle3Config.from_target(target, draft_vocab_size=target.vocab_size)).cuda().eval()
    head.set_draft_vocab(torch.zeros(target.vocab_size, dtype=torch.long).cuda(),
                         torch.ones(target.vocab_size, dtype=torch.bool).cuda())
    head.attach(target)
    small, large = _syncs_per_step(m, head, 2), _syncs_per_step(m, head, 16)
    assert large <= small + 2, f"{small:.1f} host waits per step at batch 2, {large:.1f} at batch 16"
