"""A causal LM with a KV cache that scores draft trees in one forward and keeps only accepted entries.

The cache holds *committed* entries (tokens of the sequence) followed by *scratch* entries
(draft-tree nodes fed since the last commit). Every forward appends scratch entries; each new
entry names its parent (an earlier scratch entry or ``-1`` = the end of the committed context),
attends to all valid committed entries plus its scratch ancestors and itself, and sits at
position ``parent position + 1``. ``commit`` keeps a chosen list of scratch entries per row
(the accepted path) and drops the rest; ``discard`` drops all scratch entries.

Rows of a batch may commit different numbers of entries; the shorter rows get *holes* (slots
marked invalid in ``valid`` and masked out of attention), so one forward serves the whole batch.

The mask goes to the Hugging Face model as a 4D float additive mask ``(B, 1, q, kv)``, which
transformers returns as-is for eager and SDPA attention; positions go as explicit
``position_ids``. Since a given mask replaces the model's own, the sliding window of a family that has
one (Mistral, Phi-3, Gemma-2/3, gpt-oss: ``AttentionLayout``) is applied here, by position (a key at
position k is seen from position p when p - k < window, as transformers' ``sliding_window_overlay``),
as one mask when every layer slides, else one mask per layer type (``{"full_attention": ...,
"sliding_attention": ...}``, which those models' forwards take). The cache keeps every entry of every
layer (a sliding layer's transformers cache drops old entries, which tree commits cannot address).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch
from torch import nn

from specheads.decoding.slots import TreeSlots
from specheads.decoding.vision_prompts import MropePositions, joined_images, mrope_positions
from specheads.errors import UserError
from specheads.targets import (UnsupportedTargetError, capture_layer_inputs, model_family, output_logits,
                               recurrent_layer_types, text_decoder)

ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


class HybridTargetError(UserError):
    """A target with recurrent (linear-attention, state-space) layers: the evaluator verifies with attention masks."""


@dataclass(frozen=True)
class AttentionLayout:
    """How a target's layers attend: ``window`` (tokens) of its sliding layers or None; ``chunk`` (tokens) of its
    chunked layers or None (Llama 4: a token sees the earlier tokens of its own ``attention_chunk_size`` block);
    ``per_type``: the model takes one mask per layer type (its config lists ``layer_types``), else one mask for
    all layers."""

    window: int | None = None
    per_type: bool = False
    chunk: int | None = None

    @classmethod
    def of(cls, config) -> "AttentionLayout":
        """Read from a transformers config; raises ``UnsupportedTargetError`` for layer kinds tree verification
        does not model (KV sharing, ...), or sliding (chunked) layers of different widths."""
        from transformers.cache_utils import get_layer_types_and_kwargs

        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        kinds, kwargs = get_layer_types_and_kwargs(text)
        other = sorted(set(kinds) - set(ATTENTION_KINDS))
        if other:
            raise UnsupportedTargetError(f"{model_family(config)}: tree verification supports full, sliding-window "
                                         f"and chunked attention layers, this target has {other} layers")
        widths = {}
        for kind in ("sliding_attention", "chunked_attention"):
            found = {kw["sliding_window"] for k, kw in zip(kinds, kwargs) if k == kind}
            if len(found) > 1:
                raise UnsupportedTargetError(f"{model_family(config)}: {kind} layers of different widths "
                                             f"{sorted(found)} (tree verification applies one)")
            widths[kind] = found.pop() if found else None
        per_type = getattr(text, "layer_types", None) is not None
        for kind, width in widths.items():
            if width is not None and not per_type and set(kinds) != {kind}:
                raise UnsupportedTargetError(f"{model_family(config)}: some layers are {kind} but the config lists "
                                             "no layer_types, so the model cannot take a mask per layer type")
        return cls(widths["sliding_attention"], per_type, widths["chunked_attention"])


PREFILL_CHUNK = 512  # prompt tokens per prefill forward: longer prompts are fed in chunks (``TargetRunner.prefill``)


@dataclass
class ForwardOutput:
    """logits: (B, q, V) or None; hidden_last: (B, q, H) post-norm; hidden_aux: (B, q, k*H) or None; mrope: a
    prefill's M-RoPE positions where its prompts hold images (what an M-RoPE drafter rotates by), else None."""

    logits: torch.Tensor | None
    hidden_last: torch.Tensor
    hidden_aux: torch.Tensor | None
    mrope: MropePositions | None = None


class TargetRunner:
    """KV-cached tree forwards over a Hugging Face causal LM (``model.model`` + ``lm_head``).

    model: a ``*ForCausalLM``; aux_layers: decoder-layer inputs to return (see ``specheads.targets``).
    ``forward_calls`` counts model forwards (one per ``forward``, whatever the batch size).
    """

    def __init__(self, model: nn.Module, aux_layers: tuple[int, ...] = ()):
        recurrent = recurrent_layer_types(model.config)
        if recurrent:
            raise HybridTargetError(
                f"target {type(model).__name__} has {', '.join(recurrent)} layers, whose recurrent state a draft "
                "tree's forward cannot verify and roll back here (attention layers only); measure its head in vLLM "
                "with specheads serve-eval, which also checks greedy output against plain decoding")
        self.model = model
        self.decoder = text_decoder(model)
        self.lm_head = model.get_output_embeddings()
        self.aux_layers = tuple(aux_layers)
        self.attention = AttentionLayout.of(model.config)
        self.forward_calls = 0
        self.batch_size = 0
        self.mrope: MropePositions | None = None  # set by a prefill of image prompts (``vision_prompts``)
        # transformers 5 renamed ``past_key_values`` to ``cache``; accept either.
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ------------------------------------------------------------------ state
    def reset(self, batch_size: int) -> None:
        """Empty cache for ``batch_size`` rows."""
        from transformers import DynamicCache

        self.batch_size = batch_size
        self.cache = DynamicCache()  # no config: full layers everywhere (a sliding layer's would drop entries)
        self.slots = TreeSlots(batch_size, self.device)
        self.mrope = None

    @property
    def scratch_size(self) -> int:
        return self.slots.scratch

    @property
    def num_tokens(self) -> torch.Tensor:
        return self.slots.num_tokens

    # ------------------------------------------------------------------ forward
    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """(B, q, kv) bool -> (B, 1, q, kv) additive float mask in the model's dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]

    def _masks(self, allowed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The model's attention mask(s) for q entries at positions ``pos`` (B, q) with ``allowed`` (B, q, kv)."""
        window, chunk = self.attention.window, self.attention.chunk
        if window is None and chunk is None:
            return self._additive(allowed)
        keys = self.slots.key_positions()[:, None, :]
        masks = {"full_attention": self._additive(allowed)}
        if window is not None:
            masks["sliding_attention"] = self._additive(allowed & (pos[:, :, None] - keys < window))
        if chunk is not None:
            masks["chunked_attention"] = self._additive(allowed & (pos[:, :, None] // chunk == keys // chunk))
        if not self.attention.per_type:
            return masks["sliding_attention" if window is not None else "chunked_attention"]
        return masks

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, parents: torch.Tensor, live: torch.Tensor | None = None,
                logits: bool = True, logits_at: torch.Tensor | None = None, images: dict | None = None) -> ForwardOutput:
        """Feed q scratch entries per row in one model forward.

        tokens (B, q) long; parents (B, q) long (scratch index, earlier or in this call, or -1);
        live (B, q) bool marks real entries (padding is computed but never attended to by others).
        logits_at: optional (B, r) indices into the q new entries: logits only there (B, r, V).
        images: the pixel inputs of the image tokens among ``tokens`` (``vision_prompts.joined_images``): the
        forward then runs the multimodal model, whose vision encoder fills them (an image prompt's prefill).
        Positions are the slots' (a token's index in its row), or the target's M-RoPE positions there after a
        prefill of image prompts (``MropePositions.at``).
        """
        if tokens.shape != parents.shape or tokens.shape[0] != self.batch_size:
            raise ValueError(f"tokens {tuple(tokens.shape)} / parents {tuple(parents.shape)} "
                             f"do not match the batch size {self.batch_size}")
        if live is None:
            live = torch.ones_like(tokens, dtype=torch.bool)
        pos, allowed = self.slots.extend(parents, live)
        positions = pos if self.mrope is None else self.mrope.at(pos)
        kwargs = dict(input_ids=tokens, attention_mask=self._masks(allowed, pos), position_ids=positions,
                      use_cache=True, **{self._cache_kw: self.cache})
        with capture_layer_inputs(self.decoder.layers, self.aux_layers) as captured:
            if images is None:
                last = self.decoder(**kwargs).last_hidden_state
            else:
                last = self._multimodal_forward(kwargs, self._image_kwargs(tokens, images))
        self.forward_calls += 1
        aux = torch.cat([captured[i] for i in self.aux_layers], -1) if self.aux_layers else None
        lg = None
        if logits:
            sel = last if logits_at is None else last.gather(
                1, logits_at[..., None].expand(-1, -1, last.shape[-1]))
            lg = output_logits(self.model.config, self.lm_head, sel)
        return ForwardOutput(lg, last, aux)

    def _multimodal_forward(self, kwargs: dict, pixels: dict) -> torch.Tensor:
        """The whole multimodal model's forward (its vision encoder fills the image tokens; logits at one position
        only), its decoder's last hidden state read as it leaves the decoder: the whole model, since each family
        nests its parts differently (Qwen-VL's ``model``, Llama 4's ``language_model`` beside its vision tower)."""
        seen = {}
        handle = self.decoder.register_forward_hook(lambda m, a, out: seen.update(last=out.last_hidden_state))
        try:
            self.model(**kwargs, **pixels, logits_to_keep=1)
        finally:
            handle.remove()
        return seen["last"]

    def _image_kwargs(self, tokens: torch.Tensor, images: dict) -> dict:
        """The multimodal model's pixel inputs for a forward over ``tokens``, in its dtype and on its device (and
        where the family's images have patch grids, M-RoPE's, the grids and which tokens are the images')."""
        kwargs = {"pixel_values": images["pixel_values"].to(self.device, self.dtype)}
        if images.get("image_grid_thw") is not None:
            kwargs.update(image_grid_thw=images["image_grid_thw"].to(self.device),
                          mm_token_type_ids=(tokens == self.model.config.image_token_id).int())
        return kwargs

    def forward_chain(self, tokens: list[list[int]], **kw) -> ForwardOutput:
        """Feed per-row token lists as chains after each row's last live scratch entry (or the
        committed context). Rows may differ in length (right padding, marked not live)."""
        q = max(len(t) for t in tokens)
        if q == 0:
            raise ValueError("forward_chain got no tokens for any row")
        lens = torch.tensor([len(t) for t in tokens])
        par, live = self.slots.chain_parents(lens, q)
        tok = torch.zeros(self.batch_size, q, dtype=torch.long, device=self.device)
        tok[live] = torch.tensor([x for t in tokens for x in t], dtype=torch.long, device=self.device)
        return self.forward(tok, par, live, **kw)

    # ------------------------------------------------------------------ keep / drop
    def commit(self, keep: list[list[int]]) -> None:
        """Keep, per row, these scratch entries (in order, a root-to-leaf path) and drop the rest.

        The kept entries are gathered and written over the first scratch slots in place, then the
        cache is cut after them: nothing else moves (a copy of the whole cache per layer and step,
        as a concatenation would make, cost ~0.03 plain decoding steps on SmolLM2 on a CPU)."""
        c, idx = self.slots.commit(keep)
        if idx is None:
            if c:
                self.cache.crop(-c)
            return
        m = idx.shape[1]
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                g = t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
                t[:, :, c:c + m] = g
                setattr(layer, name, t[:, :, :c + m])

    def timed_chain(self, tokens: list[int]) -> float:
        """Seconds of one forward over ``tokens`` fed as a chain after the committed context (batch 1),
        dropped afterwards: what the verify cost curve and the CPU layout choice time."""
        n = len(tokens)
        tok = torch.tensor([tokens], device=self.device)
        par = (torch.arange(n, device=self.device) - 1)[None]
        t0 = time.perf_counter()
        self.forward(tok, par)
        dt = time.perf_counter() - t0
        self.discard()
        return dt

    def discard(self) -> None:
        """Drop every scratch entry (back to the committed context)."""
        s = self.slots.discard()
        if s:
            self.cache.crop(-s)

    def rewind(self, committed: int) -> None:
        """Back to the first ``committed`` committed slots (scratch dropped too): the cache and the slots cut
        there, so the next forward sees exactly the context a fresh prefill of those tokens left."""
        self.discard()
        drop = self.slots.committed - committed
        self.slots.truncate(committed)
        if drop:
            self.cache.crop(-drop)

    # ------------------------------------------------------------------ convenience
    def prefill(self, prompts: list[list[int]], chunk: int = PREFILL_CHUNK) -> ForwardOutput:
        """Commit ``prompt[:-1]`` for every row (the last prompt token stays pending, see generate.py), in forwards
        of at most ``chunk`` tokens a row, each committed before the next: a long prompt's masks and attention
        scores are (chunk, context), never (context, context). A prompt within one chunk is one forward.

        Prompts that carry images (``vision_prompts.ImagePrompt``) are prefilled in one forward of the multimodal
        model (its vision encoder fills each image's tokens in the forward that holds them), at the target's M-RoPE
        positions, which every later forward continues (``MropePositions``).

        Returns the hidden states for those positions (right padded), no logits.
        """
        if any(len(p) < 2 for p in prompts):
            raise ValueError("every prompt needs at least 2 tokens (the last one is fed by the first step)")
        self.reset(len(prompts))
        images = joined_images(prompts)
        if images is not None:
            return self._prefill_images(prompts, images)
        rows = [list(p[:-1]) for p in prompts]
        parts = []
        for start in range(0, max(map(len, rows)), chunk):
            pieces = [r[start:start + chunk] for r in rows]
            parts.append(self.forward_chain(pieces, logits=False))
            self.commit([list(range(len(x))) for x in pieces])
        if len(parts) == 1:
            return parts[0]
        # each chunk's rows start at its first position: joined along the tokens, a row's states stay in order
        aux = torch.cat([o.hidden_aux for o in parts], 1) if parts[0].hidden_aux is not None else None
        return ForwardOutput(None, torch.cat([o.hidden_last for o in parts], 1), aux)

    def _prefill_images(self, prompts, images: dict) -> ForwardOutput:
        """``prefill`` of a batch holding images: one forward over every row's ``prompt[:-1]`` with the pixel inputs,
        at the positions the target computes for the prompts (kept for the forwards after it)."""
        self.mrope = mrope_positions(self.model, prompts, self.device)
        rows = [list(p[:-1]) for p in prompts]
        out = self.forward_chain(rows, logits=False, images=images)
        self.commit([list(range(len(r))) for r in rows])
        return ForwardOutput(None, out.hidden_last, out.hidden_aux, self.mrope)
