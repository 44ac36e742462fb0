"""What a recipe will cost before it runs: the feature store's bytes, the target's memory per device for
each parallel layout, and collection and training time from a short timed probe on this machine.

The target and the head are built on PyTorch's ``meta`` device from the target's config (a preset's
published ``architecture`` block, or the config of a local folder / cached hub id), so parameter counts
are those of the real modules and nothing is allocated. Times come from timing matrix products of the
target's own widths on the chosen device and dtype (the probe), multiplied by the forward and backward
FLOPs of the target and the head; attention's share (which grows with context length) is left out, so
they are lower bounds for long contexts.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from specheads.data.store import bytes_per_token, canonical_dtype
from specheads.errors import ConfigError

GiB = 2**30
LAYOUT_SIZES = (1, 2, 4, 8)


@dataclass
class TargetSize:
    """Parameter counts and widths of a target, read from its modules on the meta device."""

    params: int
    active_params: int  # in a token's matrix products: the experts it uses, no input embedding lookup
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    experts: int = 0  # routed experts per layer (0: dense)


@dataclass
class Plan:
    target: str
    method: str
    dtype: str
    num_samples: int
    tokens: int
    epochs: float
    target_size: TargetSize
    head_trainable: int
    store_bytes: int
    disk_free: int | None
    memory: dict[str, float]  # layout -> GiB per device (weights + one collection batch's activations)
    probe_flops: float  # FLOP/s measured on the probe's matrix products
    probe_device: str
    processes: int
    device_gib: float
    collect_s: float
    train_offline_s: float
    train_online_s: float
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def target_config(name_or_path: str, architecture: dict | None = None):
    """The target's ``transformers`` config: from the preset's ``architecture`` block when given (no files
    needed), else from the folder or cached hub id ``name_or_path`` (only its config.json is read)."""
    from transformers import AutoConfig

    if architecture:
        arch = dict(architecture)
        model_type = arch.pop("model_type")
        return AutoConfig.for_model(model_type, **arch)
    from specheads.targets import resolve_target_path

    path = resolve_target_path(name_or_path)
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as e:
        raise ConfigError(f"cannot read the config of target {name_or_path!r}: {e}. Give a local model folder, "
                          "a cached hub id, or a preset (conf/target/) with an architecture block") from None


def meta_target(config, name: str):
    """The target's modules on the meta device, wrapped as a ``Target`` (no weights, no memory)."""
    from transformers import AutoModelForCausalLM

    from specheads.targets import Target

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return Target(model, None, name=name)


def _is_expert(name: str) -> bool:
    return ".experts." in name or name.endswith(".experts") or ".experts_" in name


def target_size(target) -> TargetSize:
    config = target.config
    text = getattr(config, "text_config", None) or config
    total = active = 0
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None)
    per_token = getattr(text, "num_experts_per_tok", None) or getattr(text, "experts_per_token", None)
    embedding = target.model.get_input_embeddings().weight
    for name, p in target.model.named_parameters():
        n = p.numel()
        total += n
        if p is embedding and not target.config.tie_word_embeddings:
            continue  # a lookup, not a matrix product
        active += n * per_token / experts if (experts and per_token and _is_expert(name)) else n
    return TargetSize(params=total, active_params=int(active), hidden_size=target.hidden_size,
                      intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * target.hidden_size),
                      num_layers=target.num_layers, vocab_size=target.vocab_size, experts=int(experts or 0))


def head_parameters(method_name: str, target, settings: dict) -> tuple[int, Any]:
    """(trainable parameters, feature spec) of the head ``method_name`` would train on ``target``."""
    from specheads.methods import build_method

    settings = {k: v for k, v in settings.items() if k not in ("name", "vocab_data", "vocab_rows")}
    method = build_method(method_name, **settings)
    with torch.device("meta"):
        if method_name == "eagle3":  # its build needs the data to pick the draft vocabulary: size only here
            from specheads.models.eagle3 import Eagle3Config, Eagle3Model

            method.bind(target)
            head = Eagle3Model(Eagle3Config.from_target(target, method.draft_vocab_size, method.feature_spec.aux_layers,
                                                        method.fc_norm))
        else:
            head = method.build(target)
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    return trainable, method


def layout_memory(size: TargetSize, weight_bytes: int, batch_tokens: int, store_vectors: int) -> dict[str, float]:
    """GiB per device for each layout: weights split over the devices plus one collection batch's activations
    (float32 logits over the vocabulary, the stored hidden states, one MLP's intermediate; tensor parallel
    splits the MLP's share, the layer-split ``device_map`` runs one stage at a time)."""
    elem = weight_bytes / max(size.params, 1)
    logits = batch_tokens * size.vocab_size * 4
    hidden = batch_tokens * size.hidden_size * store_vectors * elem
    mlp = batch_tokens * size.intermediate_size * 2 * elem
    out = {}
    for n in LAYOUT_SIZES:
        weights = weight_bytes / n
        if n == 1:
            out["one device"] = (weights + logits + hidden + mlp) / GiB
        else:
            out[f"tp {n}"] = (weights + logits + hidden + mlp / n) / GiB
            out[f"device_map {n}"] = (weights + logits + hidden + mlp) / GiB
    return out


def probe_flops(size: TargetSize, dtype: torch.dtype, device: str, tokens: int = 256, repeats: int = 3) -> float:
    """FLOP/s of ``tokens`` x hidden @ hidden x intermediate products (the shapes a target layer's MLP runs)
    in ``dtype`` on ``device``: the best of ``repeats`` timed runs after one warm-up."""
    dev = torch.device(device)
    h, i = size.hidden_size, size.intermediate_size
    x = torch.randn(tokens, h, dtype=dtype, device=dev)
    w = torch.randn(h, i, dtype=dtype, device=dev)

    def run() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        (x @ w).sum().item()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    run()
    best = min(run() for _ in range(repeats))
    return 2.0 * tokens * h * i / max(best, 1e-9)


def _auto_dtype(size: TargetSize, device: str, tokens: int) -> str:
    """``target.dtype=auto`` for the plan: the stages' rule (``hardware.choose_dtype``) on the plan's probe."""
    from specheads.hardware import choose_dtype, cpu_bf16_supported

    if torch.device(device).type == "cuda" or not cpu_bf16_supported():
        return choose_dtype("auto", device).value
    rates = {name: probe_flops(size, getattr(torch, name), device, tokens) for name in ("float32", "bfloat16")}
    return max(rates, key=rates.get)


def make_plan(*, target_name: str, config, method_name: str, method_settings: dict, dtype: str, store_dtype: str,
              num_samples: int, tokens_per_sample: float, epochs: float, batch_tokens: int, device: str,
              processes: int = 1, device_gib: float = 80.0, probe_tokens: int = 256, disk_dir: str | Path | None = None) -> Plan:
    if num_samples <= 0 or tokens_per_sample <= 0 or epochs <= 0 or processes <= 0:
        raise ConfigError(f"plan needs positive sizes: num_samples={num_samples}, tokens_per_sample="
                          f"{tokens_per_sample}, epochs={epochs}, processes={processes}")
    store_dtype = canonical_dtype(store_dtype)
    target = meta_target(config, target_name)
    size = target_size(target)
    if str(dtype) == "auto":  # as the stages decide it: bfloat16 on a GPU, on a CPU the faster where it has bf16
        dtype = _auto_dtype(size, device, probe_tokens)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    trainable, method = head_parameters(method_name, target, method_settings)
    spec = method.feature_spec
    tokens = int(num_samples * tokens_per_sample)
    vectors = len(spec.aux_layers or ()) + int(spec.need_last)
    store = 0 if spec.online_only else tokens * bytes_per_token(size.hidden_size, len(spec.aux_layers or ()),
                                                                 spec.need_last, store_dtype)
    weight_bytes = size.params * torch.empty((), dtype=torch_dtype).element_size()
    rate = probe_flops(size, torch_dtype, device, probe_tokens) * processes  # data parallel: processes share the tokens
    target_fwd = 2.0 * size.active_params * tokens
    unroll = max(int(getattr(method, "ttt_steps", 1) or 1), 1)
    head_step = 6.0 * trainable * tokens * unroll * epochs
    collect_s = target_fwd / rate
    free = None
    if disk_dir is not None:
        probe = Path(disk_dir)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
    plan = Plan(target=target_name, method=method_name, dtype=str(dtype), num_samples=num_samples, tokens=tokens,
                epochs=epochs, target_size=size, head_trainable=trainable, store_bytes=store, disk_free=free,
                memory=layout_memory(size, weight_bytes, batch_tokens, vectors), probe_flops=rate / processes,
                probe_device=str(device), processes=processes, device_gib=device_gib, collect_s=collect_s, train_offline_s=head_step / rate,
                train_online_s=(head_step + target_fwd * epochs) / rate)
    plan.advice = advise(plan)
    return plan


def advise(plan: Plan) -> list[str]:
    advice = []
    if plan.store_bytes == 0:
        advice.append(f"{plan.method} trains the target itself: online training only (no store)")
    elif plan.disk_free is not None and plan.store_bytes + GiB > plan.disk_free:
        advice.append(f"the store ({plan.store_bytes / GiB:.1f} GiB) does not fit the {plan.disk_free / GiB:.1f} GiB "
                      "free: train online (specheads train without features_dir; pipeline offline=false), or store "
                      "fp8_e4m3 (collect.dtype=fp8_e4m3, about half of bfloat16)")
    else:
        advice.append("the store fits: collect once, then train offline (every epoch reads the store)")
    fits = [k for k, v in plan.memory.items() if v <= 0.9 * plan.device_gib]
    if fits:
        advice.append(f"smallest layout within 90% of a {plan.device_gib:g} GiB device: {fits[0]} "
                      "(target.parallel=none | tp | device_map)")
    else:
        advice.append(f"no layout of up to {LAYOUT_SIZES[-1]} devices fits {plan.device_gib:g} GiB: more nodes "
                      "(device_map over a node, tp within it) or a smaller collect.batch_tokens")
    return advice


def _human_time(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def format_plan(plan: Plan) -> str:
    s = plan.target_size
    moe = f" ({s.experts} experts per layer, {s.active_params / 1e9:.2f}B active per token)" if s.experts else ""
    lines = [
        f"plan for {plan.target} + {plan.method}: {plan.num_samples} samples, {plan.tokens / 1e6:.1f}M tokens, "
        f"{plan.epochs:g} epoch(s)",
        f"  target   {s.params / 1e9:.2f}B parameters{moe}, {s.num_layers} layers, hidden {s.hidden_size}, "
        f"vocabulary {s.vocab_size}",
        f"  head     {plan.head_trainable / 1e6:.1f}M trainable parameters",
        "  store    " + ("none (online only)" if plan.store_bytes == 0 else
                         f"{plan.store_bytes / GiB:.1f} GiB" + (f" ({plan.disk_free / GiB:.1f} GiB free)"
                                                                 if plan.disk_free is not None else "")),
        f"  memory per device ({plan.dtype} weights + one collection batch):",
    ]
    lines += [f"    {k:<14} {v:8.1f} GiB" for k, v in plan.memory.items()]
    lines += [
        f"  time with {plan.processes} data-parallel process(es), each at the probe's {plan.probe_flops / 1e12:.2f} "
        f"TFLOP/s on {plan.probe_device} (matrix products only; attention adds with context length):",
        f"    collect          {_human_time(plan.collect_s)}",
        f"    train offline    {_human_time(plan.train_offline_s)}",
        f"    train online     {_human_time(plan.train_online_s)}",
    ]
    lines += [f"  advice: {a}" for a in plan.advice]
    return "\n".join(lines)
