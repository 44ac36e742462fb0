"""Batch-invariant target forwards, so that speculative decoding stays exact on any CPU and in any precision.

Speculative decoding is lossless only if the target's logits for a token do not depend on how many
other tokens share its forward: a verify forward over a draft tree must give, for every node, bitwise
what a one-token forward after its accepted ancestors gives. Two kinds of operation break that:

- **Attention.** The scaled-dot-product kernels reduce over the keys in a blocking that depends on the
  number of queries. ``exact_attention`` computes softmax(q kᵀ·scale + mask) v in float64 and rounds the
  result to the model's dtype: different query counts still change the float64 sums in their last bits
  (~1e-16 relative), which a float32 or bfloat16 rounding turns into a different value only where the
  value lies that close to a rounding boundary (about 1e-9 per float32 element).
- **Linear layers.** oneDNN and the BLAS pick a kernel per row count: one row goes through a
  matrix-vector kernel, a few rows through another blocking, and the sums come out in other orders. On
  a 2-core AMD EPYC with AVX-512 and bfloat16 kernels every float32 row of a one-row call differed from
  the same row in a call of two or more, and two- or three-row calls from calls of four or more; in
  bfloat16 a one-row call differed from the others in a few elements of the layers whose input is over
  1024 wide (SmolLM2's MLP down-projection, 1536): the bfloat16 main job's report found 4 of 12 prompts
  decoded differently. The row counts from which a layer's rows no longer depend on the call are a fact
  of the machine, the kernel library and the thread count, so ``linear_row_floor`` measures them on the
  model's own layers, at run time, and ``apply_row_floor`` pads every smaller call up to that floor (and
  splits any call over ``MAX_ROWS`` rows into chunks): every row of every forward then goes through
  kernels proven to give it the same bits.

``make_exact(model, mode)`` switches the attention (before the linear layers' layout is chosen);
``prove_exact(model)``, once the layout and the thread count are set, measures and applies the row floor (a
kind of layer measured before on this machine, with the same kernels and settings, is recalled: ``remembered_form``),
then checks the whole model end to end (``tree_vs_sequential``: every node of random draft trees against
one-token forwards along its path, bitwise). The evaluator runs plain and speculative decodes alike in
this arithmetic in its exact pass, which judges losslessness; its timed fast pass runs the target's own attention
with the floor lifted (``row_floor_set``, ``evaluation.passes``), as users' decoding loops and engines do.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specheads.decoding.cpu_linears import PackedLinear, can_pack, pack_cpu_linears, packed_count
from specheads.decoding.runner import TargetRunner
from specheads.errors import UserError, one_line

log = logging.getLogger(__name__)

ATTENTION_NAME = "specheads_exact"
EXACT_MODES = ("auto", "on", "off")
# linear calls with more rows are split into chunks of this many; the row floor is proven up to it, at a cost of
# about MAX_ROWS² rows through each kind of layer (a 262k-token LM head is the dearest)
MAX_ROWS = 32
FLOOR_CAP = 16  # a floor above this is not offered: the padded one-token forward would cost more than it saves
_FLOOR_ATTR = "_specheads_row_floor"


def exact_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention interface: query (B, H, q, d), key/value (B, Hkv, kv, d), mask additive
    (B, 1, q, kv) float, boolean (True = attend) or None (causal, the q queries being the last q keys, unless
    ``is_causal=False`` is passed or the module's ``is_causal`` is False: no mask, as a vision encoder attends).
    Returns (B, q, H, dv) in the query's dtype. Like transformers' eager attention of the families that
    have them: ``softcap`` caps the scaled scores (``cap * tanh(s / cap)``, Gemma-2) before the mask;
    ``s_aux`` (gpt-oss's attention sinks, one logit per query head) is an extra softmax column, dropped
    after the softmax. A value head dim other than the query's (DeepSeek's MLA) is kept."""
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError(f"exact attention does not implement position_bias= (model {type(module).__name__}); "
                                  f"evaluate with exact_forward=off")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux", kwargs.get("sinks"))
    if dropout and module.training:
        raise ValueError("exact attention is for inference: dropout during training is not supported")
    b, h, q, d = query.shape
    hkv, kv = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    g = h // hkv
    # query head j*g + i reads key/value head j (transformers' repeat_kv order)
    qd = query.to(torch.float64).reshape(b, hkv, g * q, d)
    scores = torch.matmul(qd, key.to(torch.float64).transpose(-1, -2))
    scores.mul_(d ** -0.5 if scaling is None else scaling)
    if softcap:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores = scores.view(b, hkv, g, q, kv)
    if attention_mask is None:
        # None means causal unless the caller says otherwise (a vision encoder: is_causal=False, or a module whose
        # is_causal is False), as transformers' SDPA interface reads it
        is_causal = kwargs.get("is_causal")
        if getattr(module, "is_causal", True) if is_causal is None else is_causal:
            causal = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril(kv - q)
            scores.masked_fill_(~causal, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        scores.masked_fill_(~attention_mask[..., :kv].unsqueeze(2), float("-inf"))
    else:
        scores.add_(attention_mask[..., :kv].to(torch.float64).unsqueeze(2))
    scores = scores.view(b, hkv, g * q, kv)
    if sinks is not None:  # head j*g + i's sink logit, beside each of its q rows
        sink = sinks.to(torch.float64).view(1, hkv, g, 1).expand(b, hkv, g, q).reshape(b, hkv, g * q, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :kv]
    else:
        probs = torch.softmax(scores, -1)
    out = torch.matmul(probs, value.to(torch.float64))  # (B, Hkv, g*q, dv)
    return out.view(b, h, q, value.shape[-1]).transpose(1, 2).to(query.dtype).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, exact_attention)


def make_exact(model: nn.Module, mode: str = "auto") -> dict:
    """Make ``model``'s forwards batch-invariant for exact speculative decoding (in place).

    mode ``auto``: on for a model on the CPU, in every dtype (float32 rows move with the row count too),
    off on GPUs (the fused kernels and cuBLAS are another story: their verification is checked against
    the references by ``scripts/gpu_check.sh``); ``on`` / ``off`` force it. Returns what was done, for the
    report: {"attention": ..., "packed_linears": n}; ``prove_exact`` then adds the linear layers' row floor.
    """
    if mode not in EXACT_MODES:
        raise ValueError(f"exact_forward={mode!r}: use one of {', '.join(EXACT_MODES)}")
    p = next(model.parameters())
    on = mode == "on" or (mode == "auto" and p.device.type == "cpu")
    if not on:
        return {"attention": model.config._attn_implementation, "packed_linears": 0}
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
    packed = pack_cpu_linears(model) if can_pack(model) and p.dtype == torch.bfloat16 and not packed_count(model) else 0
    log.info("exact forwards: float64 attention, %d linear layers packed for oneDNN", packed)
    return {"attention": ATTENTION_NAME, "packed_linears": packed}


# ---------------------------------------------------------------- the linear layers' row floor


def linear_kind(m: nn.Module) -> str:
    """A linear layer's kind, by what picks its kernels: class, in x out, bias, dtype ("Linear 576x1536 float32")."""
    return "{} {}x{}{} {}".format(type(m).__name__, m.in_features, m.out_features, "+b" if m.bias is not None else "",
                                  str(m.weight.dtype).replace("torch.", ""))


def _linear_kinds(model: nn.Module) -> dict[str, nn.Module]:
    """One linear layer of each kind (``linear_kind``): layers of a kind run the same kernels."""
    kinds: dict[str, nn.Module] = {}
    for m in model.modules():
        if type(m) in (nn.Linear, PackedLinear):
            kinds.setdefault(linear_kind(m), m)
    return kinds


def _unfloored(m: nn.Module):
    state = getattr(m, _FLOOR_ATTR, None)
    return state["forward"] if state else m.forward


def layer_row_floor(forward, in_features: int, dtype: torch.dtype, device, max_rows: int = MAX_ROWS,
                    gen: torch.Generator | None = None) -> int:
    """The smallest row count ``f`` such that every call of ``forward`` (one linear layer as it runs) with ``f``
    to ``max_rows`` rows gives each row bitwise what a call over ``max_rows`` rows gives it, whatever its
    neighbours and its place in the call."""
    gen = gen or torch.Generator().manual_seed(0)
    with torch.no_grad():
        x = torch.randn(max_rows, in_features, generator=gen).to(device, dtype)
        ref = forward(x)
        for rows in range(max_rows - 1, 0, -1):  # from the top: the first failing count sets the floor
            # every row of the reference, in calls of ``rows`` rows at two alignments
            starts = sorted({min(s, max_rows - rows) for s in range(0, max_rows, rows)}
                            | {min(s, max_rows - rows) for s in range(rows // 2, max_rows, rows)})
            if any(not torch.equal(forward(x[s:s + rows]), ref[s:s + rows]) for s in starts):
                return rows + 1
    return 1


def linear_row_floor(model: nn.Module, max_rows: int = MAX_ROWS, seed: int = 0, forms: bool = False,
                     recall: bool = True) -> dict:
    """Measure, for each kind of linear layer of ``model`` (as it will run: layout, dtype, thread count
    already set), its ``layer_row_floor``. ``forms``: each kind's arithmetic form chosen too (``choose_form``,
    the copies of Wᵀ within a share of the memory available), the floor that form's, each kind's pick taken
    from what was remembered for its key where ``recall`` (``remembered_form``). Returns {"floor": the
    largest over kinds, "per_kind": {kind: f} (``linear_kind``), "seconds": s}, with ``forms``
    also "forms": {kind: form}, "form_ms": {kind: {form: ms}}, "memo": the kinds' key ids and "recalled": the
    kinds whose pick was remembered."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    kinds = _linear_kinds(model)
    if not forms:
        per_kind = {kind: layer_row_floor(_unfloored(m), m.in_features, m.weight.dtype, m.weight.device, max_rows,
                                          gen) for kind, m in kinds.items()}
        return {"floor": max(per_kind.values(), default=1), "per_kind": per_kind,
                "seconds": round(time.perf_counter() - t0, 2)}
    count = {kind: 0 for kind in kinds}
    for m in model.modules():
        if type(m) in (nn.Linear, PackedLinear):
            count[linear_kind(m)] += 1
    picks = choose_forms({kind: (m, count[kind]) for kind, m in kinds.items()}, max_rows, gen, recall)
    per_kind = {kind: pick["floor"] for kind, pick in picks.items()}
    return {"floor": max(per_kind.values(), default=1), "per_kind": per_kind,
            "forms": {kind: pick["form"] for kind, pick in picks.items()},
            "form_ms": {kind: pick["ms"] for kind, pick in picks.items()},
            "memo": [pick["memo"] for pick in picks.values()],
            "recalled": [kind for kind, pick in picks.items() if pick["recalled"]],
            "seconds": round(time.perf_counter() - t0, 2)}


def floor_and_chunk(floor: int, chunk: int = MAX_ROWS) -> tuple[int, int]:
    """How a layer whose row floor is ``floor`` runs: calls padded to ``floor`` rows, split into ``chunk``-row
    parts; a floor over ``FLOOR_CAP`` is not offered, and that layer runs every row alone (1, 1): the one-row
    kernel for every row, exact by construction."""
    return (1, 1) if floor > FLOOR_CAP else (floor, chunk)


def floor_calls(floor: int, tokens: int, chunk: int = MAX_ROWS) -> list[int]:
    """The row counts of the calls a linear layer gets for ``tokens`` rows under a row floor (``apply_row_floor``):
    chunks of ``chunk`` rows, a chunk under the floor padded to it; a floor over ``FLOOR_CAP`` runs every row alone."""
    floor, chunk = floor_and_chunk(floor, chunk)
    return [max(min(chunk, tokens - s), floor) for s in range(0, tokens, chunk)]


# ---------------------------------------------------------------- the linear layers' arithmetic form
# The same product x·Wᵀ can go through other kernels: with the weight as the GEMM's left operand ((W·xᵀ)ᵀ), or
# against a contiguous copy of Wᵀ (x·Wᵀ as a plain matrix product). Their row floors differ: held to AVX2,
# SmolLM2's float32 MLP and LM head need 16 rows through ``F.linear`` but 2 through x·Wᵀ-contiguous, where a
# 2-row call costs about what a one-row one does (LM head: 3.6 ms vs 11.9 ms for ``F.linear`` padded to 16).
# Exact decoding runs each kind of layer in the form whose padded calls are cheapest (``choose_form``); plain
# decodes that only time the baseline keep the layer's own forward (``row_floor_lifted``).
FORMS = ("linear", "xwt", "wxt")
FORM_TOKENS = (1, 8)  # the verify forwards a form is timed at: one token and a tree of 8
FORM_GAIN = 0.9  # another form replaces the layer's own only below this share of its cost
_FORM_MEMORY_SHARE = 0.25  # the copies of Wᵀ take at most this share of the memory available
# a layer over this many bytes keeps its own form: each form's floor search runs ~60 calls of 32 rows, which on
# Gemma 3's float32 LM head (262k x 640, 671 MB) at one thread took a minute per form
FORM_MAX_BYTES = 256 << 20


def _rows_form(product, bias):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = product(rows.contiguous()).contiguous()  # the layer's layout: what follows may read strides bitwise apart
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], -1)
    return forward


def form_forward(m: nn.Module, form: str):
    """``m`` (an ``nn.Linear``) computed in ``form``: ``linear`` its own forward, ``wxt`` (W·xᵀ)ᵀ, ``xwt`` x times
    a contiguous copy of Wᵀ (the copy held by the returned function)."""
    if form == "linear":
        return _unfloored(m)
    w = m.weight.detach()
    b = None if m.bias is None else m.bias.detach()
    if form == "wxt":
        return _rows_form(lambda rows: (w @ rows.T).T, b)
    if form == "xwt":
        wt = w.T.contiguous()
        return _rows_form(lambda rows: rows @ wt, b)
    raise ValueError(f"unknown linear form {form!r}: one of {', '.join(FORMS)}")


def _available_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with accelerate
        return 0


def _calls_seconds(forward, in_features: int, dtype, device, floor: int, reps: int = 5) -> float:
    from specheads.hardware import _median_seconds

    xs = [torch.randn(n, in_features).to(device, dtype) for t in FORM_TOKENS for n in floor_calls(floor, t)]

    def step():
        with torch.no_grad():
            for x in xs:
                forward(x)
    return _median_seconds(step, reps)


def choose_form(m: nn.Module, copy_budget: int | None = None, max_rows: int = MAX_ROWS,
                gen: torch.Generator | None = None) -> dict:
    """The arithmetic form for one kind of linear layer under exact forwards: each form's row floor
    (``layer_row_floor``) and the time of its padded calls for verify forwards of ``FORM_TOKENS`` tokens; the
    layer's own forward stays unless another is under ``FORM_GAIN`` of its cost. A layer that needs no padding
    (floor 1), is no plain ``nn.Linear`` (oneDNN-prepacked), is not on the CPU, is not float32 (the forms are
    measured, and proven under each forced instruction set by test_exact_isa.py, in float32 only) or is over
    ``FORM_MAX_BYTES`` keeps its own. ``copy_budget``: bytes the copy of Wᵀ may take (``xwt`` left out when
    over). The forms are tried in the order of ``FORMS`` after the layer's own; once one with a floor of 2 or
    less is taken, the rest are not measured. Returns {"form", "floor", "forward", "ms": {form: ms}, "floors"}."""
    own = _unfloored(m)
    dtype, device = m.weight.dtype, m.weight.device
    floor = layer_row_floor(own, m.in_features, dtype, device, max_rows, gen)
    pick = {"form": "linear", "floor": floor, "forward": own, "floors": {"linear": floor}, "ms": {}}
    size = m.weight.numel() * m.weight.element_size()
    if (floor == 1 or type(m) is not nn.Linear or dtype != torch.float32 or device.type != "cpu"
            or size > FORM_MAX_BYTES):
        return pick
    costs = {"linear": _calls_seconds(own, m.in_features, dtype, device, floor)}
    for form in FORMS[1:]:
        if pick["form"] != "linear" and pick["floor"] <= 2:
            break
        if form == "xwt" and copy_budget is not None and size > copy_budget:
            continue
        forward = form_forward(m, form)
        f = layer_row_floor(forward, m.in_features, dtype, device, max_rows, gen)
        pick["floors"][form] = f
        costs[form] = _calls_seconds(forward, m.in_features, dtype, device, f)
        if costs[form] < FORM_GAIN * costs["linear"] and costs[form] < costs.get(pick["form"], float("inf")):
            pick.update(form=form, floor=f, forward=forward)
    pick["ms"] = {k: round(1000 * v, 3) for k, v in costs.items()}
    return pick


def choose_forms(layers: dict, max_rows: int = MAX_ROWS, gen: torch.Generator | None = None,
                 recall: bool = True) -> dict:
    """``choose_form`` for each of ``layers`` ({key: (layer, how many layers of the model it stands for)}), the
    copies of Wᵀ within ``_FORM_MEMORY_SHARE`` of the memory available, the first layers first; each kind's pick
    is remembered (``remembered_form``) and, where ``recall``, taken from what was remembered for the same key.
    Returns {key: choose_form's pick, with "memo" (its key's id) and "recalled" (bool)}."""
    budget = int(_FORM_MEMORY_SHARE * _available_bytes())
    picks = {}
    for key, (m, count) in layers.items():
        picks[key] = remembered_form(m, budget // count, max_rows, gen, recall)
        if picks[key]["form"] == "xwt":
            budget -= count * m.weight.numel() * m.weight.element_size()
    return picks


# ---------------------------------------------------------------- the measured forms, remembered
# A kind's row floor and form are facts of the layer's kernels on this machine: what picks them (the layer's class,
# shape, bias, dtype and device), the kernel library and its settings (torch's version, the instruction set it and
# oneDNN are held to, the matmul precision), the thread count and the CPU itself. ``form_key`` names all of them,
# so the search (``choose_form``: the dearest part of an evaluation's set-up on a real target, most of all for a
# large LM head) runs once per key: in process, and across processes through one file per key under the cache
# folder, written whole (a temporary file renamed over it) and checked when read (its key and a checksum; a file
# that fails is logged and measured again). Nothing remembered skips the proof: ``prove_exact`` proves the model
# in what was recalled, and a recalled floor the proof refutes is forgotten and measured again.
_MEMO_VERSION = 1
# environment settings that change which kernels run, or how they sum
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS",
              "DNNL_CPU_ISA_HINTS", "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS",
              "MKL_CBWR", "MKL_DEBUG_CPU_TYPE", "OPENBLAS_CORETYPE", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "SPECHEADS_CPU_BF16")
MEMO_FOLDER = "row_floors"  # under ``targets.files.cache_root()`` (``memo_dir``)
_FORM_MEMO: dict[str, dict] = {}  # key id -> {"form", "floor", "floors", "ms"}


@functools.lru_cache(maxsize=1)
def cpu_identity() -> dict:
    """This CPU's model name and flags (``/proc/cpuinfo``'s first processor; ``platform`` where there is none)."""
    first: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip() and first:
                    break
                field, _, value = line.partition(":")
                first.setdefault(field.strip(), value.strip())
    except OSError:
        pass
    return {"machine": platform.machine(), "name": first.get("model name") or first.get("Processor") or
            platform.processor(), "flags": first.get("flags") or first.get("Features") or ""}


def form_key(m: nn.Module, copy_allowed: bool, max_rows: int = MAX_ROWS) -> dict:
    """Everything ``choose_form``'s pick for ``m`` depends on but the weights' values: the layer's kind
    (``linear_kind``: class, so packed or not, shape, bias, dtype) and device, the search's own settings, whether
    the copy of Wᵀ was within budget, and the kernels' settings on this machine now (thread count, torch, the
    instruction set it runs, ``KERNEL_ENV``, the CPU's name and flags)."""
    device = m.weight.device
    return {"version": _MEMO_VERSION, "kind": linear_kind(m), "batch_hint": getattr(m, "batch_hint", None),
            "device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "max_rows": max_rows, "copy_allowed": copy_allowed, "forms": list(FORMS), "form_tokens": list(FORM_TOKENS),
            "form_gain": FORM_GAIN, "form_max_bytes": FORM_MAX_BYTES, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "mkldnn": torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "env": {k: os.environ.get(k) for k in KERNEL_ENV}, "cpu": cpu_identity()}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def memo_dir() -> Path:
    """The folder of the remembered picks, one file per key (``MEMO_FOLDER`` under ``targets.files.cache_root()``:
    ``$SPECHEADS_CACHE`` or ``~/.cache/specheads``)."""
    from specheads.targets.files import cache_root

    return cache_root() / MEMO_FOLDER


def _memo_path(key_id: str) -> Path:
    return memo_dir() / f"{key_id[:32]}.json"


def _valid_pick(pick) -> bool:
    return (isinstance(pick, dict) and pick.get("form") in FORMS and type(pick.get("floor")) is int
            and 1 <= pick["floor"] <= MAX_ROWS + 1 and isinstance(pick.get("floors"), dict)
            and isinstance(pick.get("ms"), dict))


def recall_form(key: dict) -> dict | None:
    """The pick remembered for ``key`` (``form_key``): this process's, else the cache file's where it is whole
    and for this very key (a file that is not is logged and ignored), else None."""
    key_id = _digest(key)
    if key_id in _FORM_MEMO:
        return _FORM_MEMO[key_id]
    path = _memo_path(key_id)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("row floor cache %s is unreadable (%s): ignored, measuring again", path, one_line(e))
        return None
    if not (isinstance(data, dict) and data.get("key") == key and _valid_pick(data.get("pick"))
            and data.get("sha256") == _digest([data["key"], data["pick"]])):
        log.warning("row floor cache %s is corrupt or for another key: ignored, measuring again", path)
        return None
    _FORM_MEMO[key_id] = data["pick"]
    return data["pick"]


def remember_form(key: dict, pick: dict) -> str:
    """Remember ``pick`` (``choose_form``'s) for ``key``: in this process, and in its cache file, written to a
    temporary file renamed over it (a reader sees the old file or the new one, whole). Returns the key's id."""
    key_id = _digest(key)
    kept = {"form": pick["form"], "floor": pick["floor"], "floors": dict(pick["floors"]), "ms": dict(pick["ms"])}
    _FORM_MEMO[key_id] = kept
    path = _memo_path(key_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.stem, suffix=".tmp", delete=False) as f:
            json.dump({"key": key, "pick": kept, "sha256": _digest([key, kept])}, f, sort_keys=True)
        os.replace(f.name, path)
    except OSError as e:  # a read-only cache: remembered in this process only
        log.info("row floor cache %s not written (%s)", path, one_line(e))
    return key_id


def forget_forms(key_ids) -> None:
    """Forget the picks of ``key_ids`` (``remember_form``'s), in this process and in the cache."""
    for key_id in key_ids:
        _FORM_MEMO.pop(key_id, None)
        _memo_path(key_id).unlink(missing_ok=True)


def remembered_form(m: nn.Module, copy_budget: int | None = None, max_rows: int = MAX_ROWS,
                    gen: torch.Generator | None = None, recall: bool = True) -> dict:
    """``choose_form(m, ...)``, taken from what was remembered for its key (``form_key``) where ``recall`` and
    there is one (its form's forward made again for ``m``), else measured and remembered. The pick has "memo"
    (its key's id, for ``forget_forms``) and "recalled"."""
    size = m.weight.numel() * m.weight.element_size()
    key = form_key(m, copy_budget is None or size <= copy_budget, max_rows)
    known = recall_form(key) if recall else None
    if known is not None:
        return {**known, "forward": form_forward(m, known["form"]), "memo": _digest(key), "recalled": True}
    pick = choose_form(m, copy_budget, max_rows, gen)
    return {**pick, "memo": remember_form(key, pick), "recalled": False}


class ExactDecodeCalls:
    """For ``hardware.choose_dtype`` on a target that will decode with exact forwards: per dtype, the linear
    layers as decoding runs them (oneDNN-prepacked in bfloat16 where the CPU can, as ``make_exact`` does), each in
    its arithmetic form (``choose_form``), and the calls a verify forward of ``tokens`` tokens makes to each,
    padded to the largest row floor measured on those layers in their forms (as ``prove_exact`` pads them). A
    float32 floor of 16 on a CPU whose bfloat16 floor is 1 makes float32 decoding dearer than a probe at ``tokens``
    rows says (the main job measured a one-token forward of 76 ms padded, 40 ms unpadded)."""

    def __init__(self, tokens: int = 4):
        self.tokens = tokens
        self.floors: dict[str, int] = {}

    def __call__(self, dtype: str, weights: dict) -> tuple[dict, list[int]]:
        layers = {}
        for shape, w in weights.items():
            lin = nn.Linear(shape[0], shape[1], bias=False, device="meta", dtype=w.dtype)
            lin.weight = nn.Parameter(w, requires_grad=False)
            layers[shape] = lin
            if w.dtype == torch.bfloat16 and can_pack(lin):
                try:
                    layers[shape] = PackedLinear(lin)
                except RuntimeError:  # oneDNN refused the reorder: plain, as pack_cpu_linears falls back
                    pass
        # each layer in its form, all padded to the largest floor, as ``prove_exact`` runs them
        picks = choose_forms({shape: (m, 1) for shape, m in layers.items()})
        layers = {shape: pick["forward"] for shape, pick in picks.items()}
        self.floors[dtype] = floor = max((pick["floor"] for pick in picks.values()), default=1)
        return layers, floor_calls(floor, self.tokens)

    def describe(self) -> str:
        floors = ", ".join(f"{d} {f}" for d, f in self.floors.items())
        return f"as exact decoding runs them, {self.tokens} tokens per forward (row floor {floors})"


def _floored_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    state = module.__dict__[_FLOOR_ATTR]
    if not state["on"]:
        return state["forward"](x)
    forward = state["exact"] or state["forward"]  # the layer's form under exact forwards (``choose_form``)
    floor, chunk = state["floor"], state["chunk"]
    rows = x.reshape(-1, x.shape[-1])  # one contiguous 2-D call per part, as the floor was measured (a 3-D call
    n = rows.shape[0]                  # may take other kernels)
    if n <= chunk:  # one call: a decoding forward's usual case
        if n >= floor:
            return forward(rows.contiguous()).reshape(*x.shape[:-1], -1)
        padded = (rows.expand(floor, -1).contiguous() if n == 1  # copies of the first row: any rows do
                  else torch.cat((rows, rows[:1].expand(floor - n, -1))))
        return forward(padded)[:n].reshape(*x.shape[:-1], -1)
    outs = []
    for s in range(0, n, chunk):
        part = rows[s:s + chunk]
        k = part.shape[0]
        if k < floor:
            part = torch.cat([part, part[:1].expand(floor - k, -1)])
        outs.append(forward(part.contiguous())[:k])
    return torch.cat(outs).view(*x.shape[:-1], -1)


def apply_row_floor(model: nn.Module, floor: int, chunk: int = MAX_ROWS, forms: dict[str, str] | None = None) -> int:
    """Make every linear layer of ``model`` run calls of fewer than ``floor`` rows padded to ``floor`` and
    calls of more than ``chunk`` rows in chunks (``floor = chunk = 1``: every row alone, the one-row kernel
    for all). One floor for every kind, the largest measured: a bfloat16 LM head whose own measured floor was 1,
    padded to 1 while the other layers got 2, left 1 of 42 tree nodes unequal in test_exact_isa.py's wider check
    (AVX-512 without bfloat16 kernels). ``forms``: {kind: form} (``linear_kind``, ``form_forward``), the form each
    kind computes in while the floor is on. In place, on the modules as they are (apply after the layout is
    chosen); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) in (nn.Linear, PackedLinear):
            forward = _unfloored(m)
            form = (forms or {}).get(linear_kind(m), "linear")
            setattr(m, _FLOOR_ATTR, {"forward": forward, "floor": floor, "chunk": chunk, "on": True,
                                     "exact": None if form == "linear" else form_forward(m, form)})
            m.forward = _floored_forward.__get__(m)
            n += 1
    return n


def remove_row_floor(model: nn.Module) -> None:
    """Undo ``apply_row_floor``."""
    for m in model.modules():
        state = getattr(m, _FLOOR_ATTR, None)
        if state:
            m.forward = state["forward"]
            delattr(m, _FLOOR_ATTR)


def _floor_states(model: nn.Module) -> list[dict]:
    return [s for s in (getattr(m, _FLOOR_ATTR, None) for m in model.modules()) if s]


def set_row_floor(model: nn.Module, on: bool) -> None:
    """From now on, ``model``'s floored linear layers run padded and chunked (``on``) or as the kernels choose (not
    ``on``: no padding, no chunks, the layer's own form)."""
    for s in _floor_states(model):
        s["on"] = on


@contextmanager
def row_floor_set(model: nn.Module, on: bool):
    """``set_row_floor`` inside the block; each layer's earlier setting comes back after it."""
    states = _floor_states(model)
    before = [s["on"] for s in states]
    for s in states:
        s["on"] = on
    try:
        yield
    finally:
        for s, was in zip(states, before):
            s["on"] = was


def row_floor_lifted(model: nn.Module):
    """``row_floor_set(model, False)``: the linear layers as the kernels choose inside the block (the evaluator's
    fast pass, ``evaluation.passes``, decodes so; a timing that must match it lifts the floor)."""
    return row_floor_set(model, False)


def row_floor_is_on(model: nn.Module) -> bool:
    """Whether any of ``model``'s linear layers runs padded to a row floor now."""
    return any(s["on"] for s in _floor_states(model))


# ---------------------------------------------------------------- the end-to-end proof


@dataclass(frozen=True)
class ProofScope:
    """What a run will verify, for ``prove_exact`` to prove: ``size``, the most rows a verify forward feeds one row of
    the batch (its largest draft and the pending token); ``batch``, the most rows one forward batches; ``context``,
    the longest context a verify forward sees (the longest prompt and the new tokens).

    The proof checks one tree of ``min(size, MAX_ROWS + 1)`` nodes at ``context`` against one-token forwards, and a
    forward of ``batch`` rows (the proven trees, padded and with holes) against each tree's own forward. Why that
    bound implies every larger tree: a linear call of more than ``MAX_ROWS`` rows is split into chunks of at most
    ``MAX_ROWS`` (the last padded to the floor), each a row count ``linear_row_floor`` measured row-invariant, so
    a tree of ``MAX_ROWS + 1`` nodes already crosses the chunk boundary the larger ones cross; attention computes
    every query alone in float64 over the same keys whatever the query count. Batches larger than proven go
    through the same chunks. Contexts shorter than ``context`` are checked at 48 tokens and at ``context``."""

    size: int = 0
    batch: int = 1
    context: int = 0

    def cases(self) -> list[tuple[int, int]]:
        """The (context, tree size) pair this scope adds to the proof, if any."""
        if self.size < 1 or self.context < 2:
            return []
        return [(self.context, min(self.size, MAX_ROWS + 1))]


def _path(parents: list[int], i: int) -> list[int]:
    """Node ``i``'s root-to-node path (node indices, root first)."""
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def tree_vs_sequential(model: nn.Module, contexts=(40, 150), sizes=(3, 6, 12), seed: int = 0,
                       vocab: int | None = None, reference_parents=None, cases=None, batch: int = 1) -> dict:
    """Every node of random draft trees: its logits from one verify forward of the tree against a one-token
    forward after each of its ancestors (committed one by one, as plain decoding does), compared bitwise.
    ``cases``: (context length, tree size) pairs (default: every context with every size). ``batch`` > 1: then
    one verify forward of ``batch`` rows at once, each row one of the cases' (context, tree) already checked (in
    turn; contexts of other lengths leave holes, trees of other sizes padding), must give every node bitwise its
    batch-1 tree logits, and so, by the check above, its one-token logits. ``reference_parents(parents) ->
    parents`` decodes the one-token reference along other paths (a control that must fail). Returns {"nodes",
    "unequal", "largest_difference", "moved", "batch", "batch_nodes", "batch_unequal"} (moved: nodes whose
    reference path differs from their tree path; nodes and unequal count the batched rows' nodes too)."""
    rng = random.Random(seed)
    vocab = vocab or model.config.vocab_size
    cases = list(cases) if cases is not None else [(length, n) for length in contexts for n in sizes]
    r = TargetRunner(model)
    unequal = total = moved = batch_nodes = batch_unequal = 0
    worst = 0.0
    checked: list[tuple[list[int], list[int], list[int], torch.Tensor]] = []
    with torch.no_grad():
        for length, n in cases:
            prompt, toks, parents, ref, context, tree = _random_tree_forward(r, rng, vocab, length, n,
                                                                             reference_parents)
            checked.append((prompt, toks, parents, tree))
            nodes, case_moved, case_unequal, worst = _one_token_walks(r, context, toks, parents, ref, tree, worst)
            total += nodes
            moved += case_moved
            unequal += case_unequal
        if batch > 1:
            batch_nodes, batch_unequal, worst = _batched_vs_trees(r, checked, batch, worst)
    return {"nodes": total + batch_nodes, "unequal": unequal + batch_unequal, "largest_difference": worst,
            "moved": moved, "batch": batch, "batch_nodes": batch_nodes, "batch_unequal": batch_unequal}


def _random_tree_forward(r: TargetRunner, rng: random.Random, vocab: int, length: int, n: int, reference_parents):
    """A random prompt of ``length`` tokens prefilled and a random tree of ``n`` nodes verified after it in one
    forward; returns the prompt, the tree's tokens and parents, the reference's parents, the committed context and
    the tree's logits."""
    prompt = [rng.randrange(vocab) for _ in range(length)]
    toks = [rng.randrange(vocab) for _ in range(n)]
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    ref = reference_parents(parents) if reference_parents else parents
    r.prefill([prompt])
    context = r.slots.committed
    tree = r.forward(torch.tensor([toks]), torch.tensor([parents])).logits[0]
    return prompt, toks, parents, ref, context, tree


def _one_token_walks(r: TargetRunner, context, toks: list[int], parents: list[int], ref: list[int],
                     tree: torch.Tensor, worst: float) -> tuple[int, int, int, float]:
    """Each node's one-token logits along the reference tree against its tree logits; returns the nodes compared,
    those whose reference path moved, those unequal, and ``worst`` raised to the largest difference."""
    nodes = moved = unequal = 0
    # one walk per leaf of the reference tree: each node's one-token logits are taken once, on the first
    # walk that passes it (what a one-token forward after its ancestors gives, whichever leaf it leads to);
    # each walk starts from the prompt's prefill, rewound to (``TargetRunner.rewind``), not made again
    seen: set[int] = set()
    for leaf in (i for i in range(len(toks)) if i not in set(ref)):
        r.rewind(context)
        for j in _path(ref, leaf):
            one = r.forward(torch.tensor([[toks[j]]]), torch.tensor([[-1]])).logits[0, 0]
            r.commit([[0]])
            if j in seen:
                continue
            seen.add(j)
            nodes += 1
            moved += _path(ref, j) != _path(parents, j)
            unequal += not torch.equal(one, tree[j])
            worst = max(worst, float((one.float() - tree[j].float()).abs().max()))
    return nodes, moved, unequal, worst


def _batched_vs_trees(r: TargetRunner, checked: list, batch: int, worst: float) -> tuple[int, int, float]:
    """One verify forward of ``batch`` rows, each a checked case's (prompt, tree) in turn, against each tree's own
    batch-1 logits; returns the nodes compared, those unequal, and ``worst`` raised to the largest difference."""
    batch_nodes = batch_unequal = 0
    rows = [checked[b % len(checked)] for b in range(batch)]
    q = max(len(toks) for _, toks, _, _ in rows)
    tok = torch.zeros(batch, q, dtype=torch.long)
    par = torch.full((batch, q), -1, dtype=torch.long)
    live = torch.zeros(batch, q, dtype=torch.bool)
    for b, (_, toks, parents, _) in enumerate(rows):
        tok[b, :len(toks)], par[b, :len(toks)], live[b, :len(toks)] = (torch.tensor(toks),
                                                                       torch.tensor(parents), True)
    r.prefill([prompt for prompt, _, _, _ in rows])
    out = r.forward(tok, par, live).logits
    for b, (_, toks, _, tree) in enumerate(rows):
        for i in range(len(toks)):
            batch_nodes += 1
            batch_unequal += not torch.equal(out[b, i], tree[i])
            worst = max(worst, float((out[b, i].float() - tree[i].float()).abs().max()))
    return batch_nodes, batch_unequal, worst


def _one_token_ms(model: nn.Module, rounds: int = 3, reps: int = 2) -> dict[str, float]:
    """Median one-token forward (ms) after a 64-token context, floored and with the floor lifted, in
    interleaved rounds (a shared machine's drift falls on both alike)."""
    vocab = model.config.vocab_size
    prompt = [(17 + 31 * i) % vocab for i in range(64)]
    r = TargetRunner(model)
    r.prefill([prompt])
    times: dict[str, list[float]] = {"floored": [], "lifted": []}
    for _ in range(rounds):
        r.timed_chain([prompt[-1]])  # warm-up
        times["floored"] += [r.timed_chain([prompt[-1]]) for _ in range(reps)]
        with row_floor_lifted(model):
            r.timed_chain([prompt[-1]])
            times["lifted"] += [r.timed_chain([prompt[-1]]) for _ in range(reps)]
    return {k: round(1000 * statistics.median(v), 2) for k, v in times.items()}


def prove_exact(model: nn.Module, check_sizes=(3, 8), check_contexts=(48,), max_rows: int = MAX_ROWS,
                given: dict | None = None, scope: ProofScope | None = None) -> dict:
    """Measure and apply the row floor of ``model``'s linear layers (exact forwards on, ``make_exact``), then
    prove the whole model: random draft trees verified in one forward against one-token forwards, bitwise.
    Each kind of layer computes in its form (``choose_form``), every one padded to the largest floor; a floor
    above ``FLOOR_CAP`` is refused (every row then runs alone, which is exact by construction); a failed proof
    says so (``proven`` False) and the caller falls back. A kind's floor and form remembered for its key
    (``remembered_form``: the same kind of layer on the same machine and kernels) are applied without measuring;
    the proof runs all the same, and where it fails on a remembered floor, the floors are forgotten, measured
    again and proven again; floors that stay unproven are forgotten. Returns the record for the report:
    {"row_floor", "row_chunk", "row_floor_per_kind" (measured, in each kind's form), "row_form", "row_form_ms",
    "floor_seconds", "floor_recalled" (the kinds whose floor was remembered), "one_token_ms": {"floored",
    "lifted"}, "proof": {...}, "proven"}. ``given``: an earlier record of this model on this machine (an
    interrupted evaluation's) whose floor, chunks and forms are applied as they were, not measured again (a noisy
    timing could choose another form); the proof runs all the same. ``scope``: what the run will verify
    (``ProofScope``), proven on top of ``check_sizes`` x ``check_contexts``."""
    cases = [(length, n) for length in check_contexts for n in check_sizes] + (scope or ProofScope()).cases()
    batch = (scope or ProofScope()).batch
    if given is not None:
        measured = {"per_kind": given.get("row_floor_per_kind"), "forms": given.get("row_form") or {},
                    "form_ms": given.get("row_form_ms"), "seconds": 0.0, "memo": [], "recalled": []}
        floor, chunk = given["row_floor"], given["row_chunk"]
    else:
        measured = linear_row_floor(model, max_rows, forms=True)
        floor, chunk = floor_and_chunk(measured["floor"], max_rows)
    proof = _floored_proof(model, floor, chunk, measured["forms"], cases, batch)
    if proof["unequal"] and measured["recalled"]:
        log.warning("exact forwards: the remembered row floors of %s fail the proof (%d of %d nodes unequal); "
                    "measuring them again", ", ".join(measured["recalled"]), proof["unequal"], proof["nodes"])
        forget_forms(measured["memo"])
        measured = linear_row_floor(model, max_rows, forms=True, recall=False)
        floor, chunk = floor_and_chunk(measured["floor"], max_rows)
        proof = _floored_proof(model, floor, chunk, measured["forms"], cases, batch)
    if proof["unequal"]:
        forget_forms(measured["memo"])  # not proven here: the next proof measures them again
    ms = _one_token_ms(model)
    record = {"row_floor": floor, "row_chunk": chunk, "row_floor_per_kind": measured["per_kind"],
              "row_form": measured["forms"], "row_form_ms": measured["form_ms"],
              "floor_seconds": measured["seconds"], "floor_recalled": measured["recalled"], "one_token_ms": ms,
              "proof": proof, "proven": proof["unequal"] == 0}
    log.info("exact forwards: linear row floor %d (chunks of %d%s), one-token forward %.1f ms floored vs %.1f ms; "
             "proof: %d of %d tree nodes bitwise equal to one-token forwards", floor, chunk,
             f"; {len(measured['recalled'])} kinds remembered" if measured["recalled"] else "", ms["floored"],
             ms["lifted"], proof["nodes"] - proof["unequal"], proof["nodes"])
    return record


def _floored_proof(model: nn.Module, floor: int, chunk: int, forms: dict, cases: list, batch: int) -> dict:
    """Apply the row floor (each kind in its form, all at the largest floor) and run ``tree_vs_sequential``'s
    proof over ``cases`` and ``batch``; returns its record with "cases" and "seconds"."""
    apply_row_floor(model, floor, chunk, forms)
    t0 = time.perf_counter()
    proof = tree_vs_sequential(model, cases=cases, batch=batch)
    proof["cases"] = [list(case) for case in cases]
    proof["seconds"] = round(time.perf_counter() - t0, 2)
    return proof


class ExactnessError(UserError):
    """Exact forwards could not be proven on this machine, not even in float32: no lossless verdict would hold."""


def settle_exact(model: nn.Module, cpu_linears: str = "auto", given: dict | None = None,
                 scope: ProofScope | None = None) -> dict:
    """Prove exact forwards on ``model`` as it will decode (after ``make_exact``, the layout and the thread
    count) and fall back where the proof fails: a reduced-precision model goes to float32 (its layout chosen
    again) and is proven again, and the record says why; a float32 model (at first or after the fallback) that
    is still not proven raises ``ExactnessError`` (one line, before any decode). Exact forwards off: nothing to
    prove ({}). Returns ``prove_exact``'s record, with ``fallback`` {"from", "reason", "first"} where it fell back.
    ``given``: an earlier record to apply as it was (``prove_exact``), where it has a row floor and no fallback.
    ``scope``: the sizes, batch and context the run verifies (``ProofScope``)."""
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        return {}
    usable = given if given and given.get("row_floor") and not given.get("fallback") else None
    record = prove_exact(model, given=usable, scope=scope)
    dtype = next(model.parameters()).dtype
    if record["proven"]:
        return record
    if dtype == torch.float32:
        raise ExactnessError(_unproven(record, "float32"))
    from specheads.decoding.cpu_linears import choose_cpu_linears, unpack_cpu_linears

    reason = (f"{str(dtype).replace('torch.', '')} forwards not proven exact on this machine: "
              f"{record['proof']['unequal']} of {record['proof']['nodes']} tree nodes differ from one-token forwards")
    log.warning("%s; decoding in float32 instead", reason)
    remove_row_floor(model)
    unpack_cpu_linears(model)
    model.float()
    linears = choose_cpu_linears(model, cpu_linears)
    again = prove_exact(model, scope=scope)
    if not again["proven"]:
        raise ExactnessError(_unproven(again, f"float32 (after {reason})"))
    again["fallback"] = {"from": str(dtype).replace("torch.", ""), "to": "float32", "reason": reason,
                         "first": record, "cpu_linears": linears}
    return again


def _unproven(record: dict, what: str) -> str:
    proof = record["proof"]
    return (f"exact forwards not proven in {what}: {proof['unequal']} of {proof['nodes']} nodes of draft trees "
            f"(context x size {proof.get('cases')}, batch {proof.get('batch', 1)}) differ from one-token forwards, "
            "so no lossless verdict would hold; evaluate with exact_forward=off (speculative and plain decoding "
            "then compared in the kernels' own arithmetic)")
