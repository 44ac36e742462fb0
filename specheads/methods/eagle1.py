"""EAGLE-1 as a training method: smooth-L1 on the next feature plus soft CE against the target.

The model (``specheads.models.eagle1.Eagle1Model``) is pure; this module holds its loss, held-out
metrics, drafter factory and save. The engine runs ``loss`` inside ``TrainingModule.forward``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specheads.decoding.head_drafters import EagleDrafter
from specheads.methods.base import ARGMAX_KEY, FeatureSpec, StepOutput
from specheads.methods.losses import feature_loss, soft_cross_entropy, target_probs, uniform_noise
from specheads.methods.ttt import default_positions, shift_tokens, step_rows, summarize_steps, unrolled_accuracy
from specheads.models.eagle1 import Eagle1Config, Eagle1Model
from specheads.targets import Target, target_argmax


class Eagle1Method:
    """EAGLE-1 training: smooth-L1 on the next feature + ``ce_weight`` x soft CE against the target.

    feature_weight / ce_weight: loss weights; noise_low / noise_high: uniform noise added to the
    input features in training; num_layers: drafter layers (1 in the paper and vLLM);
    eval_steps: unrolled steps scored by ``evaluate``; target_chunk / head_chunk: rows per chunk.
    """

    name = "eagle1"

    def __init__(self, feature_weight: float = 1.0, ce_weight: float = 0.1, noise_low: float = -0.1,
                 noise_high: float = 0.1, num_layers: int = 1, eval_steps: int = 5,
                 target_chunk: int = 1024, head_chunk: int = 1024):
        if noise_low > noise_high:
            raise ValueError(f"noise_low {noise_low} > noise_high {noise_high}")
        self.feature_weight, self.ce_weight = feature_weight, ce_weight
        self.noise_low, self.noise_high = noise_low, noise_high
        self.num_layers, self.eval_steps = num_layers, eval_steps
        self.target_chunk, self.head_chunk = target_chunk, head_chunk
        self.feature_spec = FeatureSpec(aux_layers=(), need_last=True)

    def build(self, target: Target) -> Eagle1Model:
        return Eagle1Model(Eagle1Config.from_target(target, self.num_layers)).to(target.device).attach(target)

    def loss(self, model: Eagle1Model, batch: dict, target: Target) -> StepOutput:
        last = batch["hidden_last"]
        ids = batch["input_ids"]
        h_in = uniform_noise(last, self.noise_low, self.noise_high) if model.training else last
        pred = model.decode(model.fuse(h_in), shift_tokens(ids, 1), default_positions(ids))
        b, t = step_rows(batch, 0)
        n = max(b.numel(), 1)
        true_next = last[b, t + 1]
        f_loss = feature_loss(pred[b, t], true_next) / n
        probs, argmax = target_probs(target.logits, true_next, None, self.target_chunk)
        ce_sum, draft_argmax = soft_cross_entropy(model.logits, pred[b, t], probs, chunk=self.head_chunk)
        ce = ce_sum / n
        loss = self.feature_weight * f_loss + self.ce_weight * ce + 0.0 * pred.sum()
        acc = float((draft_argmax == argmax).float().mean()) if b.numel() else 0.0
        return StepOutput(loss=loss, metrics={"feature_loss": float(f_loss.detach()), "ce_loss": float(ce.detach()),
                                               "step0_acc": acc})

    @torch.no_grad()
    def evaluate(self, model: Eagle1Model, batch: dict, target: Target) -> dict[str, float]:
        """Top-1 agreement with the target argmax at each of ``eval_steps`` unrolled steps (sums and counts)."""
        argmax = batch.get(ARGMAX_KEY)
        if argmax is None:
            argmax = target_argmax(target.logits, batch["hidden_last"], self.target_chunk)
        return unrolled_accuracy(model, model.fuse(batch["hidden_last"]), batch, argmax, self.eval_steps, self.head_chunk)

    @staticmethod
    def summarize(metrics: dict[str, float]) -> dict[str, float]:
        """Engine hook: ``tau_estimate`` from the per-step accuracies (and ``tau_joint``)."""
        return summarize_steps(metrics)

    @staticmethod
    def drafter(model, shape):
        """The drafter the evaluator uses (measured acceptance during training)."""
        return EagleDrafter(model, shape, "eagle1")

    def save(self, model: Eagle1Model, out_dir: str, target: Target) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
