"""Every method's loss runs inside ``TrainingModule.forward``, so a DDP wrapper sees (and syncs) it.

Issue 11: the engine handed the DDP-wrapped model to ``Method.loss``, which read ``t2d`` / ``decode``
off the wrapper (AttributeError on the first step). Here each method's module is wrapped in a real
``DistributedDataParallel`` (a one-process gloo group) and trained one step through the wrapper's
forward: gradients reach every trainable parameter and equal the unwrapped module's.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from specheads.data.features import add_features
from specheads.methods import TrainingModule, build_method
from tests.conftest import make_tiny_target
from tests.training.engine_helpers import progression_rows

V = 256


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _batch(target, method):
    rows = progression_rows(2, length=16, vocab=V)
    ids = torch.tensor([r[:12] for r in rows["input_ids"]])
    mask = torch.tensor([m[:12] for m in rows["loss_mask"]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    return add_features(batch, target, method.feature_spec)


def _method(name):
    kw = {"medusa1": dict(num_heads=2), "medusa2": dict(num_heads=2, lora_r=4),
          "eagle1": dict(eval_steps=2), "eagle3": dict(draft_vocab_size=64, ttt_steps=2,
                                                       vocab_data=[{"input_ids": list(range(V)), "loss_mask": [1] * V}]),
          "peagle": dict(draft_vocab_size=64, num_depths=3, num_layers=2,
                         vocab_data=[{"input_ids": list(range(V)), "loss_mask": [1] * V}]),
          "dspark": dict(block_size=4, anchors=4, num_layers=2, markov_rank=8),
          "domino": dict(block_size=4, anchors=4, num_layers=2, lambda_base_start=0.5)}
    return build_method(name, **kw[name])


@pytest.mark.parametrize("name", ["medusa1", "medusa2", "eagle1", "eagle3", "peagle", "dspark", "domino"])
def test_loss_through_a_ddp_wrapper_matches_the_plain_module(group, name):
    from torch.nn.parallel import DistributedDataParallel as DDP

    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        target = make_tiny_target("llama", hidden=32, layers=4, vocab=V)
        method = _method(name)
        module = TrainingModule(method, method.build(target), target)
        batch = _batch(target, method)
        if wrap:
            module = DDP(module, find_unused_parameters=bool(getattr(method, "find_unused_parameters", False)))
        out = module(batch)
        out.loss.backward()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        assert named and all(p.grad is not None for _, p in named), name
        grads.append({n.removeprefix("module."): p.grad.clone() for n, p in named})
        held = module(batch, evaluate=True)
        assert held and all(k.endswith(("_correct", "_total", "_sum", "_count")) for k in held)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], msg=n)
