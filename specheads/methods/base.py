"""The contract between the training engine and a head family, and the module the engine trains.

The engine (``specheads.training.engine``) knows nothing about Medusa or EAGLE: it asks a
``Method`` which features it needs, for the trainable module, for a loss on a batch and for
held-out metrics, and how to save the result. Each family implements one ``Method``
(``specheads.methods.<family>``); the models themselves (``specheads.models``) know nothing of training.

``TrainingModule`` is what the engine hands to Accelerate: its ``forward`` runs the method's whole
loss (or held-out) computation, so whatever wrapper Accelerate puts around it (DDP, DeepSpeed
ZeRO-2/3, FSDP) sees every parameter use inside its own ``forward``: DDP averages the gradients,
ZeRO-3 and FSDP gather the shards the computation touches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from specheads.data.store import ARGMAX_KEY, POSITIONS_KEY, FeatureSpec  # noqa: F401  (the methods' names for them)
from specheads.targets import Target, check_aux_layers, default_eagle3_layers


@dataclass
class StepOutput:
    """loss: scalar to back-propagate; metrics: floats for the logs (e.g. per-head accuracy)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class FusedLayers:
    """What the methods that fuse target layers (EAGLE-3, DFlash) share: ``aux_layers`` as set, or the default
    ``(2, N//2, N-3)`` once ``bind(target)`` has told the target's depth ``N``."""

    aux_layers: tuple[int, ...] | None = None
    _num_target_layers: int | None = None
    trains_image_rows = False  # FeatureSpec.image_rows: a store of image rows is refused unless the method sets it

    @property
    def feature_spec(self) -> FeatureSpec:
        """Needs the target's layer count when ``aux_layers`` is unset: call ``bind(target)`` or ``build`` first."""
        if self.aux_layers is None:
            if self._num_target_layers is None:
                raise RuntimeError(f"{type(self).__name__}.feature_spec: aux_layers is unset; call bind(target) or "
                                   "build(target) first")
            return FeatureSpec(aux_layers=default_eagle3_layers(self._num_target_layers), need_last=True,
                               image_rows=self.trains_image_rows)
        return FeatureSpec(aux_layers=tuple(self.aux_layers), need_last=True, image_rows=self.trains_image_rows)

    def bind(self, target: Target):
        """Learn the target's layer count; aux layers it does not have are refused here, before any work."""
        check_aux_layers(self.aux_layers, target, "method.aux_layers")
        self._num_target_layers = target.num_layers
        return self


class Method(Protocol):
    """One head family. A batch is a dict of tensors:

    input_ids (B, T) long, attention_mask (B, T) long, loss_mask (B, T) long (1 on assistant tokens),
    hidden_last (B, T, H) when ``feature_spec.need_last`` (and, from a feature store or online features,
    ``ARGMAX_KEY`` (B, T) long: the target's argmax over its whole vocabulary),
    hidden_aux (B, T, len(aux_layers) * H) when ``feature_spec.aux_layers``.
    """

    name: str
    feature_spec: FeatureSpec

    def build(self, target: Target) -> nn.Module:
        """The trainable module (heads; for Medusa-2 heads plus the adapted target)."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], target: Target) -> StepOutput:
        """Training loss on one batch (model in train mode)."""

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch: dict[str, torch.Tensor], target: Target) -> dict[str, float]:
        """Held-out metrics on one batch: top-1/top-k accuracy per head or unrolled step, as sums and
        counts so the engine can average over batches (keys ending in ``_correct`` / ``_total``)."""

    def save(self, model: nn.Module, out_dir: str, target: Target) -> None:
        """Write the trained head as a ``save_pretrained`` folder (loadable by ``from_pretrained``)."""


class TrainingModule(nn.Module):
    """``model`` (the method's trainable module) plus the method's loss, as one ``forward``.

    ``forward(batch)`` -> ``StepOutput`` (``Method.loss``); ``forward(batch, evaluate=True)`` ->
    held-out sums (``Method.evaluate``). The frozen target is held outside ``parameters()`` (it is
    not trained, so no wrapper shards or syncs it); a method that trains the target (Medusa-2) puts
    it inside ``model``.
    """

    def __init__(self, method: Method, model: nn.Module, target: Target):
        super().__init__()
        self.model = model
        self.__dict__["method"] = method
        self.__dict__["target"] = target

    def forward(self, batch: dict[str, torch.Tensor], evaluate: bool = False):
        if evaluate:
            with torch.no_grad():
                return self.method.evaluate(self.model, batch, self.target)
        return self.method.loss(self.model, batch, self.target)
