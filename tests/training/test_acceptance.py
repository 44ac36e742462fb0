"""Measured acceptance during training: held-out prompts, the chain estimate, and the engine hook."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import progression_rows, sources
from specheads.acceptance_math import estimate_tau
from specheads.training.acceptance import held_out_prompts, measure_acceptance


def test_held_out_prompts_stop_at_the_first_assistant_token():
    _, held = sources()
    prompts = held_out_prompts(held.batches(0), 5)
    rows = progression_rows(64)
    by_start = {tuple(ids[:4]): ids for ids in rows["input_ids"][48:]}
    assert len(prompts) == 5
    for p in prompts:
        assert len(p) == 4 and tuple(p) in by_start  # the 4 unmasked tokens of a held-out row
    assert held_out_prompts(held.batches(0), 3, max_prompt_tokens=2)[0] == prompts[0][-2:]


def test_chain_estimate_prefers_joint_accuracies():
    """The estimate beside the measured τ is acceptance_math.estimate_tau for the first k drafts."""
    joint = {"joint0_acc": 0.5, "joint1_acc": 0.2, "joint2_acc": 0.1, "step0_acc": 0.5, "step1_acc": 0.4}
    assert estimate_tau(joint, 2)[0] == pytest.approx(1 + 0.5 + 0.2)
    assert estimate_tau(joint, 9)[0] == pytest.approx(1.8)  # capped at the drafts measured
    marginal = {"head0_top1_acc": 0.5, "head1_top1_acc": 0.5, "head0_top5_acc": 0.9}
    assert estimate_tau(marginal, 2)[0] == pytest.approx(1 + 0.5 + 0.25)
    assert estimate_tau({"loss": 1.0}, 2)[0] is None


def test_engine_logs_measured_tau_equal_to_decoding_with_the_saved_head(tmp_path):
    from tests.conftest import make_tiny_target
    from specheads.decoding.drafters import TreeShape
    from specheads.decoding.generate import speculative_generate
    from specheads.decoding.head_drafters import MedusaDrafter
    from specheads.decoding.runner import TargetRunner
    from specheads.models.medusa import MedusaHeads
    from specheads.targets import eos_token_ids
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train
    from specheads.methods.medusa import Medusa1Method

    target = make_tiny_target("llama", hidden=32, layers=2, vocab=256)
    train_src, held = sources()
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=4, save_every=0, eval_every=0, wandb_mode="disabled",
                      progress=False, measure_prompts=3, measure_k=2, measure_tokens=10)
    summary = train(Medusa1Method(num_heads=2), target, train_src, cfg, OptimConfig(lr=1e-2), held)
    ev = summary["eval"]
    assert ev["measured_k"] == 2 and ev["measured_prompts"] == 3
    assert 1.0 <= ev["measured_tau"] <= 3.0
    assert ev["tau_gap"] == pytest.approx(ev["measured_tau"] - ev["tau_estimate_chain"])
    # The same decoding done independently with the saved head gives the same τ.
    heads = MedusaHeads.from_pretrained(tmp_path / "head").eval()
    runner, emitted, steps, reach = TargetRunner(target.model), 0, 0, [0, 0]
    for p in held_out_prompts(held.batches(0), 3):
        res = speculative_generate(runner, MedusaDrafter(heads, TreeShape("chain", k=2)), [p], 10, 0.0,
                                   "greedy", eos_token_ids(target))
        emitted, steps = emitted + res.stats[0].emitted, steps + res.stats[0].steps
        for d, a in enumerate(res.stats[0].accepted[:2]):
            reach[d] += a
    assert ev["measured_tau"] == pytest.approx(emitted / steps)
    # Per depth: the share of steps whose first d drafts were accepted (the shape choice reads it).
    assert [ev["measured_reach1"], ev["measured_reach2"]] == pytest.approx([r / steps for r in reach])
    from specheads.evaluation.shape_choice import measured_reach

    assert measured_reach(str(tmp_path / "head")) == pytest.approx([r / steps for r in reach])


def test_measure_acceptance_needs_a_drafter_hook():
    assert measure_acceptance(object(), torch.nn.Linear(1, 1), None, [[1, 2, 3]]) == {}


def test_fans_are_measured_for_heads_that_draft_trees_only():
    """measured_fan{w}_tau is the τ of decoding the same prompts with the w best first drafts (one
    draft forward, verified together), replayed on the chain's greedy outputs and equal to real fan
    decodes; Medusa, whose drafter makes chains, records no fan."""
    from tests.conftest import make_tiny_target
    from specheads.decoding.drafters import TreeShape
    from specheads.decoding.generate import speculative_generate
    from specheads.decoding.head_drafters import EagleDrafter
    from specheads.decoding.runner import TargetRunner
    from specheads.methods.eagle1 import Eagle1Method
    from specheads.methods.medusa import Medusa1Method
    from specheads.targets import eos_token_ids

    torch.manual_seed(0)
    target = make_tiny_target("llama", hidden=32, layers=2, vocab=256)
    prompts = held_out_prompts(sources()[1].batches(0), 3)
    method = Eagle1Method()
    model = method.build(target).eval()
    import specheads.training.acceptance as acceptance

    calls, real = [], acceptance.speculative_generate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(acceptance, "speculative_generate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        out = measure_acceptance(method, model, target, prompts, k=2, max_new_tokens=16, fans=(2, 3))
    assert len(calls) == len(prompts)  # the chain decodes; the fans are replayed on their outputs
    assert 1.0 < out["measured_fan2_tau"] <= out["measured_fan3_tau"]  # hits and misses both replayed
    for w in (2, 3):
        runner, emitted, steps = TargetRunner(target.model), 0, 0
        for p in prompts:
            s = speculative_generate(runner, EagleDrafter(model, TreeShape("dynamic", depth=1, topk=w, total_tokens=w),
                                                          "eagle1"), [p], 16, 0.0, "greedy", eos_token_ids(target)).stats[0]
            emitted, steps = emitted + s.emitted, steps + s.steps
        assert out[f"measured_fan{w}_tau"] == pytest.approx(emitted / steps)
    assert "measured_fan2_tau" not in measure_acceptance(method, model, target, prompts, k=2, max_new_tokens=10)
    medusa = Medusa1Method(num_heads=2)
    heads = medusa.build(target).eval()
    got = measure_acceptance(medusa, heads, target, prompts, k=2, max_new_tokens=10, fans=(2,))
    assert "measured_tau" in got and not any(k.startswith("measured_fan") for k in got)


def test_a_cpu_target_decodes_packed_while_measured_and_is_unpacked_after(monkeypatch):
    """Only τ is measured, so the target's linear layers take oneDNN's prepacked layout (faster few-row
    forwards) for the measurement; training resumes on the plain modules."""
    import specheads.training.acceptance as acceptance
    from tests.conftest import make_tiny_target
    from specheads.decoding.cpu_linears import can_pack, packed_count
    from specheads.methods.eagle1 import Eagle1Method

    torch.manual_seed(0)
    target = make_tiny_target("llama", hidden=32, layers=2, vocab=256, dtype=torch.float32)
    assert can_pack(target.model)  # a float32 CPU model where oneDNN is available
    prompts = held_out_prompts(sources()[1].batches(0), 2)
    method = Eagle1Method()
    model = method.build(target).eval()
    seen, real = [], acceptance.speculative_generate
    monkeypatch.setattr(acceptance, "speculative_generate",
                        lambda runner, *a, **kw: seen.append(packed_count(runner.model)) or real(runner, *a, **kw))
    out = measure_acceptance(method, model, target, prompts, k=2, max_new_tokens=6, fans=(2,))
    assert out["measured_tau"] >= 1 and seen and all(n > 0 for n in seen)
    assert packed_count(target.model) == 0


def test_offline_training_frees_the_targets_layers_and_reloads_them_to_measure(tmp_path):
    # A feature store's batches carry their features: training reads only the target's embedding, norm and
    # LM head, so its decoder layers are freed (an 8B target's ~15 GB) and reloaded for the measured decode.
    from tests.conftest import make_tiny_target
    from specheads.data.features import add_features
    from specheads.methods.medusa import Medusa1Method
    from specheads.training.batches import IterableSource
    from specheads.training.config import OptimConfig, TrainConfig
    from specheads.training.engine import train

    def tiny():
        return make_tiny_target("llama", hidden=32, layers=2, vocab=256)

    method = Medusa1Method(num_heads=2)
    train_src, held = sources()
    whole = tiny()
    with torch.no_grad():
        stored = {name: [add_features(load(), whole, method.feature_spec) for load in src.batches(0)]
                  for name, src in (("train", train_src), ("held", held))}
    offline = {name: IterableSource(lambda epoch, rows=rows: rows) for name, rows in stored.items()}
    forwards = []

    class Watched(Medusa1Method):  # records whether the target's layers held weights at each training step
        def loss(self, model, batch, target):
            forwards.append(target.layers_released)
            return super().loss(model, batch, target)

    runs = {}
    for free in (False, True):
        target, reloads = tiny(), []

        def reload():
            reloads.append(1)
            return tiny()

        cfg = TrainConfig(output_dir=str(tmp_path / str(free)), max_steps=4, save_every=0, eval_every=0,
                          wandb_mode="disabled", progress=False, measure_prompts=3, measure_k=2, measure_tokens=10)
        forwards.clear()
        runs[free] = train(Watched(num_heads=2), target, offline["train"], cfg, OptimConfig(lr=1e-2), offline["held"],
                           reload_target=reload if free else None)
        assert forwards and all(f == free for f in forwards)
        assert target.layers_released == free and len(reloads) == (1 if free else 0)
    assert runs[True]["final_loss"] == runs[False]["final_loss"]
    assert runs[True]["eval"]["measured_tau"] == runs[False]["eval"]["measured_tau"]
    assert runs[True]["eval"]["measured_prompts"] == 3


def test_release_layers_refuses_a_split_target():
    from tests.conftest import make_tiny_target
    from specheads.targets import ParallelLayout

    target = make_tiny_target("llama", hidden=32, layers=2, vocab=256)
    target.layout = ParallelLayout("device_map", 1, 0, 1)
    with pytest.raises(ValueError, match="split"):
        target.release_layers(lambda: target)
