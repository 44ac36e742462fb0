"""Image prompts in decoding: a prompt's token ids that carry its images (``ImagePrompt``), and the target's M-RoPE
positions of a prefilled batch (``MropePositions``).

A vision-language target (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) reads an image prompt in its prefill only: the vision
encoder's features fill the image tokens there, and its language model rotates every prompt token by 3-D positions
(temporal, height, width) that ``get_rope_index`` computes from the images' patch grids. An image's tokens take
fewer positions than tokens, so every position after it is offset: the model's ``rope_deltas`` (the highest prompt
position + 1 - the prompt's length). Transformers' ``generate`` decodes each later token at its index + that delta on
all three axes; ``MropePositions.at`` gives the same for any slot the runner or an EAGLE drafter feeds (committed
prompt tokens: their own 3-D positions; everything after: index + delta), so a verify forward over a draft tree sees
each node at the position a one-token forward in ``generate`` would give it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specheads.targets.model import uses_mrope


class ImagePrompt(list):
    """A prompt's token ids (each image's tokens in place) with its images: ``pixel_values`` (the image processor's
    patches of every image, in order), ``image_grid_thw`` (n, 3), and the images' references ``refs`` (where
    ``pixel_values`` are read from when they are not there yet).

    A list, so that whatever reads a prompt as token ids (drafters, lengths, n-gram lookups, a resumed evaluation's
    pickle) reads it unchanged, and ``list(prompt)`` is its text part alone; ``TargetRunner.prefill`` reads the
    images."""

    def __init__(self, ids: Sequence[int], pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | None = None, refs: Sequence[str] = ()):
        super().__init__(int(x) for x in ids)
        self.pixel_values = pixel_values
        self.image_grid_thw = image_grid_thw
        self.refs = list(refs)

    def copy(self) -> "ImagePrompt":
        return ImagePrompt(self, self.pixel_values, self.image_grid_thw, self.refs)


def prompt_images(prompt) -> dict | None:
    """The pixel inputs a prompt carries ({"pixel_values", "image_grid_thw"}), None for a text prompt."""
    pixels = getattr(prompt, "pixel_values", None)
    if pixels is None:
        if getattr(prompt, "refs", None):
            raise ValueError("an image prompt reached decoding without its pixel inputs (read its images first: "
                             "evaluation.prompts.read_prompt_images)")
        return None
    return {"pixel_values": pixels, "image_grid_thw": prompt.image_grid_thw}


def joined_images(prompts: Sequence) -> dict | None:
    """The pixel inputs of a batch, every row's images in row order (the order the model fills image tokens in:
    row by row, left to right), None when no row has an image."""
    found = [prompt_images(p) for p in prompts]
    found = [f for f in found if f is not None]
    if not found:
        return None
    return {k: torch.cat([f[k] for f in found]) for k in ("pixel_values", "image_grid_thw") if found[0][k] is not None}


@dataclass
class MropePositions:
    """The 3-D positions of a prefilled batch: ``table`` (3, B, L) each row's prompt positions (right padded),
    ``lengths`` (B,) its prompt length, ``delta`` (B,) its offset after the prompt (the model's ``rope_deltas``)."""

    table: torch.Tensor
    lengths: torch.Tensor
    delta: torch.Tensor

    def at(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, q) 1-D slot positions (a token's index in its row) -> (3, B, q) the target's positions there."""
        pos = pos.to(self.table.device)
        idx = pos.clamp(0, self.table.shape[2] - 1)
        prompt = self.table.gather(2, idx[None].expand(3, -1, -1))
        after = (pos + self.delta[:, None])[None].expand(3, -1, -1)
        return torch.where((pos < self.lengths[:, None])[None], prompt, after)


def mrope_positions(model, prompts: Sequence[Sequence[int]], device) -> MropePositions | None:
    """The M-RoPE positions of a batch of prompts (``MropePositions``) as the multimodal ``model`` (a transformers
    ``*ForConditionalGeneration``) computes them in ``generate``: ``get_rope_index`` on each row's tokens and images;
    a row without images counts 0.. on every axis. None where no row has an image, or the target rotates by 1-D
    positions (Llama 4: its image tokens take one position each, as text)."""
    if not uses_mrope(model.config) or all(prompt_images(p) is None for p in prompts):
        return None
    image_token = model.config.image_token_id
    B, L = len(prompts), max(len(p) for p in prompts)
    table = torch.arange(L, device=device).expand(3, B, L).clone()
    delta = torch.zeros(B, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        images = prompt_images(p)
        if images is None:
            continue
        ids = torch.tensor([list(p)], device=device)
        pos, d = model.model.get_rope_index(ids, mm_token_type_ids=(ids == image_token).int(),
                                            image_grid_thw=images["image_grid_thw"].to(device))
        table[:, b, : len(p)] = pos[:, 0]
        delta[b] = int(d.reshape(-1)[0])
    return MropePositions(table, torch.tensor([len(p) for p in prompts], device=device), delta)
