"""How every stage loads its target: ``load_target`` (whole, tensor-parallel or over several devices, in the
dtype this machine runs fastest) and ``load_tokenizer`` (the tokenizer alone), both with ``target.chat_template``
applied.
"""

from __future__ import annotations

import logging

import torch

from specheads.errors import ConfigError
from specheads.hardware import RowsFor
from specheads.targets.chat_templates import apply as apply_chat_template
from specheads.targets.files import EMBEDDED_TARGET, TARGET_HINT, TargetLoadError, resolve_target_path
from specheads.targets.model import Target
from specheads.targets.parallel import (PARALLEL_MODES, ParallelLayout, finish_tensor_parallel, launch_rank_world,
                                        split_kwargs)
from specheads.targets.tokenizers import own_tokenizer

log = logging.getLogger(__name__)


def load_tokenizer(name_or_path: str = EMBEDDED_TARGET, chat_template: str | None = None):
    """The target's tokenizer; ``chat_template`` (``specheads.targets.chat_templates``) replaces or adds its template."""
    return apply_chat_template(own_tokenizer(name_or_path), chat_template)


def model_class(path: str):
    """The auto class that loads a target folder: ``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for
    a vision-language model whose causal-LM class would leave out its vision part: none covers Qwen2.5-VL and
    Qwen3-VL, and Llama 4's (``Llama4ForCausalLM``) is its language model alone, its vision tower's weights dropped."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        return AutoModelForCausalLM  # its own error, from the load
    vision = getattr(config, "vision_config", None) is not None
    whole = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if vision and whole is not None and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type) != whole:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def check_parallel(parallel: str | None) -> str:
    """``target.parallel`` as ``load_target`` reads it (None: ``none``), or a ``ConfigError`` naming the modes."""
    mode = str(parallel or "none").lower()
    if mode not in PARALLEL_MODES:
        raise ConfigError(f"target.parallel={parallel}: use one of {', '.join(PARALLEL_MODES)} (whole on "
                          "target.device; tensor parallel under torchrun; the layers spread over this process's GPUs)")
    return mode


def load_target(
    name_or_path: str = EMBEDDED_TARGET,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    parallel: str | None = "none",
    tp_size: int | None = None,
    max_memory: str | int | None = None,
    probe_rows: int | RowsFor = 256,
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
    forward (the stage's own: many for collection; for decoding a ``RowsFor``, the calls its exact forwards make
    in each dtype: ``decoding.exact.ExactDecodeCalls``) keeps float32 or casts it to bfloat16
    where that is faster (``hardware.choose_dtype``; never on a CPU without bfloat16 kernels). The choice and
    its figures are logged in one line and kept as ``Target.dtype_choice``. ``chat_template``: a template for
    the tokenizer (``specheads.targets.chat_templates``: a file, a shipped name, or a model that has one).
    """
    from specheads.hardware import resolve_device

    mode = check_parallel(parallel)
    device = resolve_device(device)
    choice, dtype = _asked_dtype(dtype, device, parallel)
    kwargs, layout = split_kwargs(mode, tp_size, max_memory)
    model, tokenizer = _load_model(name_or_path, dtype, kwargs, chat_template)
    if not kwargs:  # whole: none, or tp with groups of one
        model.to(device)
    if layout is not None:  # tp
        finish_tensor_parallel(model, layout, sharded=bool(kwargs))
    model.eval().requires_grad_(False)
    if choice is None:
        choice = _settle_cpu_dtype(model, mode, probe_rows)
    log.info("%s", choice.line("target dtype"))
    if layout is None:
        rank, world = launch_rank_world()
        layout = ParallelLayout(mode, world, rank, 1)
    target = Target(model, tokenizer, name=name_or_path, layout=layout)
    target.dtype_choice = choice
    return target


def _asked_dtype(dtype: torch.dtype | str, device, parallel: str | None):
    """The dtype choice as set, or the GPU's answer (None: auto on the CPU, decided on the model loaded in float32),
    and the dtype to load the model in."""
    from specheads.hardware import DTYPES, choose_dtype

    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    on_gpu = torch.device(device).type == "cuda" or (str(parallel) != "none" and torch.cuda.is_available())
    choice = None if dtype == "auto" and not on_gpu else choose_dtype(dtype, "cuda" if on_gpu else "cpu")
    return choice, DTYPES[choice.value] if choice else torch.float32


def _load_model(name_or_path: str, dtype: torch.dtype, kwargs: dict, chat_template: str | None):
    """The target's model and tokenizer (``chat_template`` applied) from its resolved path, or a
    ``TargetLoadError``."""
    from transformers import AutoTokenizer

    path = resolve_target_path(name_or_path)
    try:
        model = model_class(path).from_pretrained(path, dtype=dtype, **kwargs)
        tokenizer = apply_chat_template(AutoTokenizer.from_pretrained(path), chat_template)
    except OSError as e:
        raise TargetLoadError(f"cannot load target '{name_or_path}': {e}; {TARGET_HINT}") from e
    return model, tokenizer


def _settle_cpu_dtype(model, mode: str, probe_rows: int | RowsFor):
    """The CPU's dtype choice, the model cast to it: bfloat16 where a probe of this model's own layers is faster
    (and the CPU has its kernels); float32 for a target split on a CPU with them (its ranks must agree)."""
    from specheads.hardware import DTYPES, Choice, choose_dtype, cpu_bf16_supported

    choice = (choose_dtype("auto", "cpu", model, rows=probe_rows) if mode == "none" or not cpu_bf16_supported()
              else Choice("float32", "split target on the CPU (its ranks must agree)"))
    if choice.value != "float32":
        model.to(DTYPES[choice.value])
    return choice
