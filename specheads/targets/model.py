"""The ``Target`` wrapper: a frozen causal LM and what the heads read from it (shapes, embeddings, LM head,
logits, the hidden states at aux layers and ``last``; layer convention: ``specheads.targets``), and the facts
that identify it (``config_hash``, ``eos_token_ids``). ``specheads.targets.loading`` builds one.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from specheads.errors import ConfigError, SpecheadsError
from specheads.targets.parallel import ParallelLayout
from specheads.targets.tokenizers import tokenizer_fingerprint


class UnsupportedTargetError(SpecheadsError, ValueError):
    """A stage cannot serve this target's architecture (the message names the family and the reason)."""


def model_family(config) -> str:
    """The transformers ``model_type`` of a target config (its text config for a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", None) or "unknown")


# layer types whose state is a recurrence, not a key/value cache (Qwen3-Next / Qwen3.5's Gated DeltaNet, Mamba)
RECURRENT_LAYERS = ("linear_attention", "mamba", "mamba2", "conv")


def recurrent_layer_types(config) -> list[str]:
    """The recurrent layer types among a config's ``layer_types`` (a config object or config.json dict; a
    multimodal config's ``text_config`` read): [] for a target of attention layers only."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    text = get("text_config")
    if text is not None:
        return recurrent_layer_types(text)
    return sorted({t for t in get("layer_types") or () if t in RECURRENT_LAYERS})


def logit_softcap(config) -> float | None:
    """The cap of the target's final logits (``final_logit_softcapping``, Gemma-2's), None when uncapped."""
    return getattr(config, "final_logit_softcapping", None) or None


def output_logits(config, lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from post-norm hidden states: ``lm_head(hidden)``, soft-capped as the model's own
    forward does when its config sets ``final_logit_softcapping`` (Gemma-2: ``cap * tanh(logits / cap)``).
    The cap is monotonic, so the argmax is ``lm_head``'s either way; distributions (soft labels, sampling,
    verification at a temperature) need it."""
    logits = lm_head(hidden)
    cap = logit_softcap(config)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


TARGET_CHUNK = 1024
"""Rows of target logits built at a time: the only full-vocabulary tensor collection holds (it keeps the argmax)."""


@torch.no_grad()
def target_argmax(logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  chunk: int = TARGET_CHUNK) -> torch.Tensor:
    """(..., H) hidden -> (...) argmax of ``logits_fn`` (e.g. ``target.logits``), ``chunk`` rows at a time.

    ``max(-1).indices`` is the argmax (the first maximal index on ties, as ``argmax``), and on a CPU
    in bfloat16 2.4x faster (1024 x 49152 logits: 43 vs 103 ms; 6 % of a collection forward)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=hidden.device)
    for s in range(0, flat.shape[0], chunk):
        out[s:s + chunk] = logits_fn(flat[s:s + chunk]).max(-1).indices
    return out.view(hidden.shape[:-1])


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high fusion layers (inputs of decoder layers, see ``specheads.targets``).

    Always three distinct, ascending layers: (2, N//2, N-3) from 7 layers up (the EAGLE-3 default);
    smaller test models get (1, N//2, N-1), and 3 layers (0, 1, 2).
    """
    if num_layers < 3:
        raise ValueError(f"EAGLE-3 fuses three distinct layers; a target with {num_layers} layers has too few")
    if num_layers == 3:
        return (0, 1, 2)
    if num_layers < 7:
        return (1, num_layers // 2, num_layers - 1)
    return (2, num_layers // 2, num_layers - 3)


def check_aux_layers(aux_layers, target: "Target", setting: str = "aux_layers") -> None:
    """Refuse aux layers the target does not have (a ``ConfigError`` naming them), before any work."""
    bad = [i for i in (aux_layers or ()) if not 0 <= int(i) < target.num_layers]
    if bad:
        raise ConfigError(f"{setting} {list(aux_layers)}: layer(s) {bad} out of range for target '{target.name}' "
                          f"with {target.num_layers} decoder layers (0..{target.num_layers - 1})")


@dataclass
class TargetFeatures:
    """Hidden states read from one target forward pass.

    aux:  tuple of (B, T, H), one per requested aux layer (inputs of those decoder layers)
    last: (B, T, H) post-norm last hidden state, or None when not requested
    argmax: (B, T) the LM head's argmax over ``last`` when the forward computed it (a serving engine's), else None
    positions: (B, T, 3) the 3-D M-RoPE positions (temporal, height, width) the language model ran at, for a target
        that uses M-RoPE (Qwen2-VL family), else None
    """

    aux: tuple[torch.Tensor, ...]
    last: torch.Tensor | None
    argmax: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def uses_mrope(config) -> bool:
    """Whether a target's language model rotates by 3-D (M-RoPE) positions: its rope settings name an
    ``mrope_section``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return isinstance(rope, dict) and rope.get("mrope_section") is not None


@contextmanager
def text_sizes_on_config(model: nn.Module) -> Iterator[None]:
    """A multimodal model's vocabulary size readable on its own config inside the block (``config.vocab_size``, as a
    causal LM's), taken from its text config: the decoding set-up (the exact forwards' proof, the CPU kernels'
    timings) reads it there. Removed again after the block, so the config (and its hash) stays as loaded."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    missing = text is not config and "vocab_size" not in config.__dict__
    if missing:
        config.vocab_size = text.vocab_size
    try:
        yield
    finally:
        if missing:
            del config.vocab_size


def text_decoder(model: nn.Module) -> nn.Module:
    """The module that holds a target's decoder layers (``.layers``; its forward gives ``last_hidden_state``).

    ``get_decoder()`` answers that for most models; a multimodal Llama 4 answers its text ``Llama4ForCausalLM``
    (whose ``base_model_prefix`` names no attribute it has), whose own ``model`` is the text decoder."""
    decoder = model.get_decoder()
    while not hasattr(decoder, "layers") and isinstance(getattr(decoder, "model", None), nn.Module):
        decoder = decoder.model
    return decoder


def is_vision_language(config) -> bool:
    """Whether a target config has a vision part (a vision-language model's ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


class Target:
    """A frozen causal LM plus what the heads need from it (embeddings, LM head, hidden states).

    ``layout`` says how the model is split (``ParallelLayout``; unsplit by default).
    """

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "unnamed", layout: "ParallelLayout | None" = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.decoder = text_decoder(model)
        self.layers = self.decoder.layers
        self.layout = layout or ParallelLayout()
        self.dtype_choice = None  # how ``load_target`` chose the dtype (``hardware.Choice``), for reports

    @classmethod
    def tokenizer_only(cls, tokenizer, name: str) -> "Target":
        """A target known by its tokenizer alone (for stages that do not run the model)."""
        self = cls.__new__(cls)
        self.model = self.decoder = self.layers = None
        self.tokenizer, self.name, self.layout = tokenizer, name, ParallelLayout()
        return self

    # -- shape facts
    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        config = self.model.config
        return (config.get_text_config() if hasattr(config, "get_text_config") else config).hidden_size

    @property
    def vision_language(self) -> bool:
        """A vision-language target: its forward takes pixel inputs (``forward_features(..., pixel_values=...)``)."""
        return self.model is not None and is_vision_language(self.model.config)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embedding's device (the first device of a ``device_map`` split)."""
        weight = getattr(self.model.get_input_embeddings(), "weight", None)
        return weight.device if weight is not None else next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    # -- the decoder layers' memory
    def release_layers(self, reload: Callable[[], "Target"]) -> None:
        """Free the decoder layers' weights (moved to the meta device) until ``layers_loaded`` needs them.

        For training from a feature store, which reads only the embedding, the final norm and the LM head:
        an 8B target's layers are ~15 GB in bfloat16, SmolLM2's 424 MB in float32. ``reload`` makes a fresh
        whole target with this one's settings (``load_target``); its layers are taken while needed.
        """
        if self.layout.mode != "none":
            raise ValueError(f"release_layers: a {self.layout.mode} target is split; only a whole one can be reloaded")
        for layer in self.layers:
            layer.to("meta")
        self._reload = reload

    @property
    def layers_released(self) -> bool:
        return getattr(self, "_reload", None) is not None and next(self.layers.parameters()).is_meta

    @contextmanager
    def layers_loaded(self) -> Iterator["Target"]:
        """The target with its decoder layers in place (reloaded if ``release_layers`` freed them, and
        freed again on exit)."""
        if not self.layers_released:
            yield self
            return
        fresh = self._reload()
        for i, layer in enumerate(fresh.layers):
            self.layers[i] = layer
        del fresh
        try:
            yield self
        finally:
            for layer in self.layers:
                layer.to("meta")

    # -- identity
    def config_hash(self) -> str:
        return config_hash(self.model.config)

    def tokenizer_fingerprint(self) -> str:
        if self.tokenizer is None:
            return "none"
        return tokenizer_fingerprint(self.tokenizer)

    # -- features
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, H) raw token embeddings (as the drafter sees them; no model-specific scaling),
        on the device of ``input_ids``."""
        return self.raw_embedding(input_ids).to(input_ids.device)

    @property
    def raw_embedding(self) -> nn.Module:
        """The token embedding's table lookup without the scaling some families fold into the module
        (Gemma-3's ``Gemma3TextScaledWordEmbedding`` multiplies by sqrt(H)): what the engines hand a drafter
        (their target embedding layer is the plain table; the scale lives in the target's own forward)."""
        return RawEmbedding(self.embed_tokens)

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """(B, T, H) post-norm hidden -> (B, T, V) target logits (``output_logits``), on the device of ``last``,
        computed in the LM head's dtype (a bfloat16 target's head scores float32 features: stored or online)."""
        weight = getattr(self.lm_head, "weight", None)
        x = last.to(weight.device, weight.dtype) if weight is not None else last
        return output_logits(self.config, self.lm_head, x).to(last.device)

    @torch.no_grad()
    def forward_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        aux_layers: Sequence[int] = (),
        need_last: bool = True,
        **vision: torch.Tensor,
    ) -> TargetFeatures:
        """Run the decoder once (no LM head) and return the requested hidden states.

        input_ids: (B, T); attention_mask: (B, T) with 1 for real tokens (right padding). A vision-language
        target runs its whole multimodal model (``vision_forward``), with the rows' pixel inputs when ``vision``
        holds them (``pixel_values``, ``image_grid_thw``).
        """
        for i in aux_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"aux layer {i} out of range for a target with {self.num_layers} layers")
        if self.vision_language:
            return self.vision_forward(input_ids, attention_mask, aux_layers, need_last, **vision)
        with capture_layer_inputs(self.layers, aux_layers) as captured:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        # A device_map split leaves each layer's states on that layer's device: bring them to the input's.
        here = input_ids.device
        last = out.last_hidden_state.to(here) if need_last else None
        return TargetFeatures(aux=tuple(captured[i].to(here) for i in aux_layers), last=last)

    def vision_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, aux_layers: Sequence[int],
                       need_last: bool, pixel_values: torch.Tensor | None = None,
                       image_grid_thw: torch.Tensor | None = None) -> TargetFeatures:
        """A vision-language target's forward: its whole multimodal model (the vision encoder runs once per image,
        its features fill the image tokens; logits at one position only), the aux states read at the language
        model's layers, its last hidden state at the decoder's output, and the 3-D positions it ran at where it uses
        M-RoPE. The whole model, not a base module of it: each family nests its parts differently (Qwen-VL's
        ``model``, Llama 4's ``language_model`` beside its vision tower), and every one's forward fills its images.

        input_ids: (B, T) with each image's tokens in place; pixel_values: the images of every row in order
        (the image processor's layout, Qwen: (patches, C*T*P*P)); image_grid_thw: (n_images, 3) where the family's
        images have grids (M-RoPE's; none for Llama 4's tiles).
        """
        kwargs = self._pixel_kwargs(input_ids, pixel_values, image_grid_thw)
        seen: dict[str, torch.Tensor | None] = {}

        def positions_hook(module, args, kw):
            seen["positions"] = kw.get("position_ids")

        def output_hook(module, args, out):
            seen["last"] = out.last_hidden_state

        handles = [self.decoder.register_forward_pre_hook(positions_hook, with_kwargs=True),
                   self.decoder.register_forward_hook(output_hook)]
        try:
            with capture_layer_inputs(self.layers, aux_layers) as captured:
                self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1,
                           **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        here = input_ids.device
        positions = None
        if uses_mrope(self.config):
            positions = seen.get("positions")
            if positions is None:  # no image: the language model counts 0..T-1 on each of the three axes
                positions = torch.arange(input_ids.shape[1], device=here).expand(3, *input_ids.shape)
            positions = positions[-3:].permute(1, 2, 0).to(here)  # (3 or 4, B, T): the last three are M-RoPE's
        last = seen["last"].to(here) if need_last else None
        return TargetFeatures(aux=tuple(captured[i].to(here) for i in aux_layers), last=last, positions=positions)

    def _pixel_kwargs(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                      image_grid_thw: torch.Tensor | None) -> dict:
        """The multimodal forward's image inputs: the pixels, and where the family's images have patch grids
        (M-RoPE targets) the grids and which tokens are the images'; image tokens without pixels are refused."""
        image_token = getattr(self.config, "image_token_id", None)
        if pixel_values is None:
            if image_token is not None and bool((input_ids == image_token).any()):
                raise ValueError("the rows hold image tokens and no pixel inputs were given (pixel_values)")
            return {}
        kwargs = {"pixel_values": pixel_values.to(self.device, self.dtype)}
        if image_grid_thw is not None:
            kwargs.update(image_grid_thw=image_grid_thw.to(self.device),
                          mm_token_type_ids=(input_ids == image_token).int())
        return kwargs


class RawEmbedding(nn.Module):
    """A token embedding's plain table lookup, sharing (not copying) its weight: (B, T) -> (B, T, H)."""

    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.__dict__["embedding"] = embedding  # not a submodule: its weight stays the target's alone

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.embedding.weight)


def eos_token_ids(target: "Target") -> list[int]:
    """Every end-of-sequence id the target's generation config, model config or tokenizer names."""
    ids = set()
    for src in (getattr(target.model, "generation_config", None), getattr(target.model, "config", None),
                target.tokenizer):  # a tokenizer-only target (answers from an endpoint) has no model
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return sorted(ids)


@contextmanager
def capture_layer_inputs(layers: nn.ModuleList, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward pre-hooks recording the hidden-state input of each chosen decoder layer."""
    captured: dict[int, torch.Tensor] = {}
    handles = []

    def make_hook(i: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[i] = hidden.detach()

        return hook

    for i in set(layer_ids):
        handles.append(layers[i].register_forward_pre_hook(make_hook(i), with_kwargs=True))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


def config_hash(config) -> str:
    """Hash of the architecture-defining parts of a model config (not its name, dtype or paths)."""
    d = config.to_dict()
    for k in ("_name_or_path", "torch_dtype", "dtype", "transformers_version", "architectures",
              "quantization_config", "_attn_implementation_autoset", "use_cache", "distributed_config"):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
