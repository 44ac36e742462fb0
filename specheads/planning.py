"""What a recipe will cost before it runs: the feature store's bytes, the target's memory per device for
each parallel layout, and collection and training time from a short timed probe on this machine.

The target and the head are built on PyTorch's ``meta`` device from the target's config (a preset's
published ``architecture`` block, or the config of a local folder / cached hub id), so parameter counts
are those of the real modules and nothing is allocated. Times come from timing matrix products of the
target's own widths on the chosen device and dtype (the probe), multiplied by the forward and backward
FLOPs of the target and the head. Attention's score and value products grow with the row (``AttentionCost``): a
token at position t reads t keys, so a token of a 16k-token row costs more than one of a 2k-token row; they are
priced at rows of the plan's tokens per sample, at the same probe's rate.

The dtype is the one the stages will load the target in (``hardware.choose_dtype``: as set, a GPU's answer, or
on a CPU float32 unless it has bfloat16 kernels and a probe of the model's own linear shapes finds bfloat16
faster). The LM head is costed apart (``LMHeadCost``), with its own timed product: a 262k-token vocabulary makes
it most of a small target's forward (Gemma 3 270M: 63 % of its matrix-product FLOPs). Collection computes it
``TARGET_CHUNK`` rows at a time and keeps only the argmax, so its memory is one chunk's logits, not a batch's;
training's loss computes it again on the columns it needs (a draft vocabulary, or all of them).
"""

from __future__ import annotations

import math
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import torch.nn.functional as F

from specheads.data.store import bytes_per_token, canonical_dtype, fits_on_disk
from specheads.errors import ConfigError
from specheads.families import family, find
from specheads.ranges import check_number
from specheads.targets import TARGET_CHUNK

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
    lm_head_params: int = 0  # the output projection, hidden x vocabulary (among active_params, tied or not)
    tied: bool = False  # the LM head shares the input embedding's matrix
    softcap: bool = False  # final_logit_softcapping: logits pass through tanh (a second logits-sized tensor)

    @property
    def decoder_params(self) -> int:
        """Active parameters of the decoder layers' matrix products (the LM head's taken out)."""
        return self.active_params - self.lm_head_params


@dataclass
class LMHeadCost:
    """What the target's LM head (hidden x vocabulary) costs: FLOPs, measured time and memory.

    flops_share: of a target forward's matrix-product FLOPs (``2 x active params`` per token);
    time_share: of collection's predicted time (its product timed apart: ``probe_flops``);
    collect_bytes: collection's logits, ``chunk_rows`` x vocabulary x element size (x2 with soft-capping):
    it keeps only the argmax, ``TARGET_CHUNK`` rows at a time;
    train_columns / online_columns: LM-head columns the training loss computes per trained row from a store /
    with the target in the loop (a draft vocabulary, the whole vocabulary, or 0: labels are stored ids);
    train_bytes: the loss's target rows for one batch of ``train_tokens`` tokens (a chunk's float32 logits plus
    the kept float32 distribution, ``probs_width`` columns per row; an upper bound: only loss rows are kept)."""

    params: int
    flops_share: float
    probe_flops: float
    time_share: float
    chunk_rows: int
    collect_bytes: int
    train_columns: int
    online_columns: int
    probs_width: int
    train_tokens: int
    train_bytes: int


@dataclass
class AttentionCost:
    """Attention's score and value products, which grow with the row (the matrix products do not): every row
    ``row_tokens`` long, causal (a token at position t reads t keys; a sliding-window layer at most its window; a
    linear-attention layer none). target_flops: per token of a target forward; head_flops: per token of one
    training-time-test step of the head, forward and backward; collect_s, train_s: their time at the probe's rate,
    included in the plan's collect_s and train_offline_s (train_online_s adds the target's share each epoch)."""

    row_tokens: float
    target_flops: float
    head_flops: float
    collect_s: float
    train_s: float


def mean_keys(row_tokens: float, window: int | None = None) -> float:
    """The keys a token reads on average in a causal row of ``row_tokens`` (positions 1..T read min(t, window))."""
    T = float(row_tokens)
    if window is None or window >= T:
        return (T + 1) / 2
    return (window * (window + 1) / 2 + (T - window) * window) / T


def target_attention_flops(config, row_tokens: float) -> float:
    """FLOPs of a target forward's attention products per token (``4 x heads x head_dim x keys`` per layer: scores
    and values), over each layer's keys: ``config.layer_types`` names sliding-window and linear-attention layers."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    width = heads * int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    types = getattr(text, "layer_types", None) or ["full_attention"] * int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    total = 0.0
    for kind in types:
        if kind == "sliding_attention" and window:
            total += 4 * width * mean_keys(row_tokens, int(window))
        elif "linear" not in kind:  # linear attention keeps a state, no keys
            total += 4 * width * mean_keys(row_tokens)
    return total


def head_attention_flops(head, row_tokens: float) -> float:
    """FLOPs per token of one training-time-test step of ``head``'s attention, forward and backward (3 x the
    forward's): each draft attention layer (a ``q_proj``) reads the row's keys causally (a later step's own
    diagonal keys are a handful per token, left out)."""
    widths = [m.out_features for name, m in head.named_modules()
              if name.endswith("q_proj") and hasattr(m, "out_features")]
    return 3 * sum(4 * w * mean_keys(row_tokens) for w in widths)


@dataclass
class Plan:
    target: str
    method: str
    dtype: str
    dtype_reason: str  # why this dtype (hardware.choose_dtype's reason: as set, GPU, this CPU's kernels, a probe)
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
    lm_head: LMHeadCost | None = None
    attention: AttentionCost | None = None
    engine: dict | None = None  # collection by vLLM (plan.engine=vllm): its measured rate, start-up and time
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
    head = target.model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    for name, p in target.model.named_parameters():
        n = p.numel()
        total += n
        if p is embedding and not target.config.tie_word_embeddings:
            continue  # a lookup, not a matrix product
        active += n * per_token / experts if (experts and per_token and _is_expert(name)) else n
    return TargetSize(params=total, active_params=int(active), hidden_size=target.hidden_size,
                      intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * target.hidden_size),
                      num_layers=target.num_layers, vocab_size=target.vocab_size, experts=int(experts or 0),
                      lm_head_params=head.weight.numel() if head is not None else 0, tied=tied,
                      softcap=bool(getattr(text, "final_logit_softcapping", None)))


def head_parameters(method_name: str, target, settings: dict) -> tuple[int, Any, Any]:
    """(trainable parameters, method, the head on the meta device) of the head ``method_name`` would train on
    ``target``."""
    from specheads.methods import build_method

    settings = {k: v for k, v in settings.items() if k not in ("name", "vocab_data", "vocab_rows")}
    method = build_method(method_name, **settings)
    with torch.device("meta"):
        if family(method_name).draft_vocab:  # its build needs the data to pick the draft vocabulary: size only here
            method.bind(target)
            head = method.make_model(target)
        else:
            head = method.build(target)
    trainable = sum(p.numel() for p in head.parameters() if p.requires_grad)
    return trainable, method, head


def layout_memory(size: TargetSize, weight_bytes: int, batch_tokens: int, store_vectors: int,
                  logits_bytes: int) -> dict[str, float]:
    """GiB per device for each layout: weights split over the devices plus one collection batch's activations
    (``logits_bytes``: one chunk of LM-head logits, ``collect_logits_bytes``; the stored hidden states, one MLP's
    intermediate). Tensor parallel splits the MLP's share and the decoder's weights but keeps the input embedding
    and the LM head whole on every rank (``load_target``); the layer-split ``device_map`` runs one stage at a
    time."""
    elem = weight_bytes / max(size.params, 1)
    hidden = batch_tokens * size.hidden_size * store_vectors * elem
    mlp = batch_tokens * size.intermediate_size * 2 * elem
    vocab = size.lm_head_params * (1 if size.tied else 2) * elem  # embedding and LM head, whole on each tp rank
    out = {}
    for n in LAYOUT_SIZES:
        if n == 1:
            out["one device"] = (weight_bytes + logits_bytes + hidden + mlp) / GiB
        else:
            out[f"tp {n}"] = ((weight_bytes - vocab) / n + vocab + logits_bytes + hidden + mlp / n) / GiB
            out[f"device_map {n}"] = (weight_bytes / n + logits_bytes + hidden + mlp) / GiB
    return out


def collect_logits_bytes(size: TargetSize, batch_tokens: int, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, bytes) of the logits collection holds at once: ``target_argmax`` runs the LM head on at most
    ``TARGET_CHUNK`` rows at a time, in the target's dtype (a soft-capped model builds a second such tensor),
    and keeps only each row's argmax (4 bytes a token in the store)."""
    rows = min(batch_tokens, TARGET_CHUNK)
    elem = torch.empty((), dtype=dtype).element_size()
    return rows, rows * size.vocab_size * elem * (2 if size.softcap else 1)


def label_columns(method_name: str, method, size: TargetSize) -> tuple[int, int, int]:
    """(columns from a store, columns online, kept distribution width): the target LM-head work of ``method``'s
    training loss per trained row (``specheads.methods``). EAGLE-3 reads the stored argmax and scores its draft
    vocabulary's columns only (online: all, then keeps the draft's); EAGLE-1 and self-distilled Medusa keep the
    full distribution; DFlash and Medusa on the data's tokens need none (DFlash online: the argmax)."""
    V = size.vocab_size
    fam = find(method_name)
    columns = fam.label_columns if fam is not None else "full"  # unknown: the full distribution, the dearest case
    if columns == "draft":
        draft = min(int(getattr(method, "draft_vocab_size", None) or V), V)
        return draft, V, draft
    if columns == "labels":
        distilled = getattr(method, "labels", "data") == "target" or getattr(method, "target_loss", None) == "kl"
        return (V, V, V) if distilled else (0, 0, 0)
    if columns == "argmax":
        return (0, 0, 0) if getattr(method, "labels", "target") == "data" else (0, V, 0)
    return V, V, V


def train_label_bytes(train_tokens: int, columns: int, probs_width: int) -> int:
    """One training batch's target rows: a chunk of float32 logits over ``columns`` plus the float32
    distribution kept for every row (``target_probs``)."""
    return (min(train_tokens, TARGET_CHUNK) * columns + train_tokens * probs_width) * 4


def _best_seconds(fn, dev: torch.device, repeats: int) -> float:
    """The best of ``repeats`` timed calls of ``fn`` after one warm-up (synchronised on a GPU)."""
    def run() -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    run()
    return max(min(run() for _ in range(repeats)), 1e-9)


def probe_flops(size: TargetSize, dtype: torch.dtype, device: str, tokens: int = 256, repeats: int = 3) -> float:
    """FLOP/s of ``tokens`` x hidden @ hidden x intermediate products (the shapes a target layer's MLP runs)
    in ``dtype`` on ``device``: the best of ``repeats`` timed runs after one warm-up."""
    dev = torch.device(device)
    h, i = size.hidden_size, size.intermediate_size
    x = torch.randn(tokens, h, dtype=dtype, device=dev)
    w = torch.randn(h, i, dtype=dtype, device=dev)
    return 2.0 * tokens * h * i / _best_seconds(lambda: (x @ w).sum().item(), dev, repeats)


PROBE_ELEMENTS = 2**24  # the largest weight a probe builds (~16M: 64 MiB in float32); wider ones are sliced


def probe_lm_head_flops(size: TargetSize, dtype: torch.dtype, device: str, tokens: int = 256,
                        repeats: int = 2) -> float:
    """FLOP/s of the LM head as collection runs it: ``tokens`` rows of hidden states against a slice of the
    vocabulary's rows (``F.linear``), then each row's argmax, in ``dtype`` on ``device``. A slice of
    ``PROBE_ELEMENTS`` weights (at least 4096 rows) is as wide a product as the whole head and keeps the probe
    short."""
    dev = torch.device(device)
    h = size.hidden_size
    cols = min(size.vocab_size, max(4096, PROBE_ELEMENTS // h))
    x = torch.randn(tokens, h, dtype=dtype, device=dev)
    w = torch.randn(cols, h, dtype=dtype, device=dev)
    return 2.0 * tokens * h * cols / _best_seconds(lambda: F.linear(x, w).max(-1).indices.sum().item(), dev, repeats)


def probe_shapes(shapes: Counter) -> Counter:
    """``shapes`` with every weight over ``PROBE_ELEMENTS`` cut into as many narrower slices as it takes (the same
    FLOPs in total), so probing a 70B target's LM head (1.05B weights) builds 64 MiB weights, not 4 GiB."""
    out: Counter = Counter()
    for (fan_in, fan_out), n in shapes.items():
        k = max(1, -(-fan_in * fan_out // PROBE_ELEMENTS))
        out[(fan_in, max(1, fan_out // k))] += n * k
    return out


def stage_dtype(requested: str, target, device: str):
    """The dtype the stages will load the target in (``hardware.choose_dtype``, a ``Choice``): ``auto`` on a CPU
    with bfloat16 kernels probes random weights of the target's own linear shapes (``probe_shapes``), its LM head
    among them, at the rows ``load_target`` probes."""
    from specheads.hardware import choose_dtype, linear_shapes

    return choose_dtype(str(requested), device, shapes=probe_shapes(linear_shapes(target.model)))


def check_sizes(sizes: dict[str, Any], counts: tuple[str, ...] = ()) -> None:
    """Refuse a size that is not a positive finite number (an integer >= 1 for the names in ``counts``), by
    ``ranges.check_number``: one ``ConfigError`` naming the first bad one as ``sizes`` names it."""
    for name, value in sizes.items():
        check_number(name, value, ">= 1" if name in counts else "> 0", integer=name in counts)


def make_plan(*, target_name: str, config, method_name: str, method_settings: dict, dtype: str, store_dtype: str,
              num_samples: int, tokens_per_sample: float, epochs: float, batch_tokens: int, device: str,
              processes: int = 1, device_gib: float = 80.0, probe_tokens: int = 256, disk_dir: str | Path | None = None,
              train_tokens: int = 4096, engine: str | None = None, engine_python: str | None = None) -> Plan:
    _check_plan_settings(num_samples, tokens_per_sample, epochs, processes, device_gib, probe_tokens, train_tokens,
                         batch_tokens, engine)
    store_dtype = canonical_dtype(store_dtype)
    target = meta_target(config, target_name)
    size = target_size(target)
    choice = stage_dtype(str(dtype).removeprefix("torch."), target, device)  # as the stages will decide it
    dtype, torch_dtype = choice.value, getattr(torch, choice.value)
    trainable, method, head = head_parameters(method_name, target, method_settings)
    spec = method.feature_spec
    tokens = int(num_samples * tokens_per_sample)
    vectors = len(spec.aux_layers or ()) + int(spec.need_last)
    store = 0 if spec.online_only else tokens * bytes_per_token(size.hidden_size, len(spec.aux_layers or ()),
                                                                 spec.need_last, store_dtype)
    weight_bytes = size.params * torch.empty((), dtype=torch_dtype).element_size()
    rate = probe_flops(size, torch_dtype, device, probe_tokens) * processes  # data parallel: processes share the tokens
    head_rate = probe_lm_head_flops(size, torch_dtype, device, probe_tokens) * processes
    target_attention = target_attention_flops(config, tokens_per_sample)
    attention_s = target_attention * tokens / rate
    decoder_s = 2.0 * size.decoder_params * tokens / rate + attention_s
    lm_head_s = 2.0 * size.lm_head_params * tokens / head_rate  # every position's argmax
    unroll = max(int(getattr(method, "ttt_steps", 1) or 1), 1)
    head_attention = head_attention_flops(head, tokens_per_sample)
    head_step = (6.0 * trainable + head_attention) * tokens * unroll * epochs
    offline_cols, online_cols, width = label_columns(method_name, method, size)
    labels_s = 2.0 * size.hidden_size * tokens * epochs / head_rate  # per LM-head column the loss computes
    # a row longer than collect.batch_tokens is a batch of its own (specheads.data.features): the batch is the row
    batch_tokens = max(batch_tokens, math.ceil(tokens_per_sample))
    chunk_rows, logits_bytes = collect_logits_bytes(size, batch_tokens, torch_dtype)
    lm_head = LMHeadCost(params=size.lm_head_params, flops_share=size.lm_head_params / max(size.active_params, 1),
                         probe_flops=head_rate / processes, time_share=lm_head_s / (decoder_s + lm_head_s),
                         chunk_rows=chunk_rows, collect_bytes=logits_bytes, train_columns=offline_cols,
                         online_columns=online_cols, probs_width=width, train_tokens=train_tokens,
                         train_bytes=train_label_bytes(train_tokens, online_cols if spec.online_only else offline_cols,
                                                       width))
    free = _disk_free(disk_dir)
    plan = Plan(target=target_name, method=method_name, dtype=dtype, dtype_reason=choice.reason,
                num_samples=num_samples, tokens=tokens, epochs=epochs, target_size=size, head_trainable=trainable,
                store_bytes=store, disk_free=free,
                memory=layout_memory(size, weight_bytes, batch_tokens, vectors, logits_bytes),
                probe_flops=rate / processes, probe_device=str(device), processes=processes, device_gib=device_gib,
                collect_s=decoder_s + lm_head_s, train_offline_s=head_step / rate + offline_cols * labels_s,
                train_online_s=head_step / rate + epochs * decoder_s + online_cols * labels_s, lm_head=lm_head,
                attention=AttentionCost(row_tokens=float(tokens_per_sample), target_flops=target_attention,
                                        head_flops=head_attention, collect_s=attention_s,
                                        train_s=head_attention * tokens * unroll * epochs / rate))
    if engine == "vllm" and not spec.online_only:
        plan.engine = _engine_collect(config, target, spec, engine_python, tokens, processes)
    plan.advice = advise(plan)
    return plan


def _check_plan_settings(num_samples, tokens_per_sample, epochs, processes, device_gib, probe_tokens, train_tokens,
                         batch_tokens, engine) -> None:
    """Refuse a size that is not a positive number (``check_sizes``) or an engine other than hf or vllm."""
    check_sizes({"num_samples": num_samples, "tokens_per_sample": tokens_per_sample, "epochs": epochs,
                 "processes": processes, "device_gib": device_gib, "probe_tokens": probe_tokens,
                 "train_tokens": train_tokens, "batch_tokens": batch_tokens})
    if engine not in (None, "hf", "vllm"):
        raise ConfigError(f"plan.engine={engine}: use vllm (time vLLM's collection too) or leave it null")


def _disk_free(disk_dir: str | Path | None) -> int | None:
    """Free bytes on the disk that holds ``disk_dir`` (its nearest existing folder); None without one."""
    if disk_dir is None:
        return None
    probe = Path(disk_dir)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _engine_collect(config, target, spec, engine_python: str | None, tokens: int, processes: int) -> dict:
    """vLLM's collection rate for this target and spec, probed, and the seconds it would collect ``tokens`` in."""
    from specheads.data.engine_features import engine_collect_rate

    probe = engine_collect_rate(config, type(target.model).__name__, spec.aux_layers or (), spec.need_last,
                                python=engine_python)
    return {**probe, "collect_s": probe["load_s"] + tokens / (probe["tokens_per_s"] * processes)}


def advise(plan: Plan) -> list[str]:
    advice = []
    if plan.dtype == "bfloat16" and plan.probe_device == "cpu" and not _cpu_bf16():
        advice.append(f"target.dtype=bfloat16 on a CPU without bfloat16 kernels: its products take a slow generic "
                      f"path (the probe: {_rate(plan.probe_flops)}); target.dtype=auto loads float32 here")
    h = plan.lm_head
    if h is not None and h.train_bytes > 0.25 * plan.device_gib * GiB:
        advice.append(f"{plan.method}'s loss keeps the target's distribution over {h.probs_width} columns per "
                      f"trained row: {h.train_bytes / GiB:.1f} GiB per batch of {h.train_tokens} tokens; lower "
                      "train.max_tokens (or train EAGLE-3, which keeps its draft vocabulary's columns only)")
    if plan.store_bytes == 0:
        advice.append(f"{plan.method} trains the target itself: online training only (no store)")
    elif plan.disk_free is not None and not fits_on_disk(plan.store_bytes, plan.disk_free):
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


def _cpu_bf16() -> bool:
    from specheads.hardware import cpu_bf16_supported

    return cpu_bf16_supported()


def _rate(flops: float) -> str:
    """A FLOP rate readable at any size: ``0.03 TFLOP/s`` reads as nothing, ``31.2 GFLOP/s`` does not."""
    return f"{flops / 1e12:.2f} TFLOP/s" if flops >= 1e11 else f"{flops / 1e9:.1f} GFLOP/s"


def _bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.0f} MiB"


def _row(plan: Plan) -> str:
    return f"{plan.attention.row_tokens:.0f}" if plan.attention else "?"


def _attention_share(plan: Plan) -> str:
    """Attention's share of collection's and offline training's time, as the plan prices them."""
    a = plan.attention
    if a is None:
        return "not priced"
    return (f"{a.collect_s / max(plan.collect_s, 1e-12):.0%} of collection, "
            f"{a.train_s / max(plan.train_offline_s, 1e-12):.0%} of offline training")


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
        f"  dtype    {plan.dtype} ({plan.dtype_reason})",
    ]
    h = plan.lm_head
    if h is not None:
        cols = {0: "none (token ids)", s.vocab_size: f"all {s.vocab_size}"}
        lines += [
            f"  LM head  {s.hidden_size} x {s.vocab_size}: {h.flops_share:.0%} of a forward's matrix-product FLOPs, "
            f"{h.time_share:.0%} of collection's time (its product at {_rate(h.probe_flops)})",
            f"           collection keeps the argmax only, {h.chunk_rows} rows of logits at a time: "
            f"{_bytes(h.collect_bytes)}",
            f"           training's target columns per row: {cols.get(h.train_columns, h.train_columns)} from the "
            f"store, {cols.get(h.online_columns, h.online_columns)} online; "
            f"{_bytes(h.train_bytes)} per batch of {h.train_tokens} tokens",
        ]
    lines += [f"  memory per device ({plan.dtype} weights + one collection batch):"]
    lines += [f"    {k:<14} {v:8.1f} GiB" for k, v in plan.memory.items()]
    lines += [
        f"  time with {plan.processes} data-parallel process(es), each at the probe's {_rate(plan.probe_flops)} "
        f"on {plan.probe_device} (matrix products, and attention over rows of {_row(plan)} tokens):",
        f"    collect          {_human_time(plan.collect_s)}",
        *([f"    collect by vLLM  {_human_time(plan.engine['collect_s'])} (vLLM {plan.engine['version']} measured here "
           f"on random weights of this shape, {plan.engine['dtype']}: {plan.engine['tokens_per_s']:.0f} tokens/s "
           f"after a {plan.engine['load_s']:.0f} s start; collect engine=vllm)"] if plan.engine else []),
        f"    train offline    {_human_time(plan.train_offline_s)}",
        f"    train online     {_human_time(plan.train_online_s)}",
        f"    attention        {_attention_share(plan)} (a token's share grows with its row)",
    ]
    lines += [f"  advice: {a}" for a in plan.advice]
    return "\n".join(lines)
