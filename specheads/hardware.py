"""Where and in what precision a stage runs on the machine at hand: one home for the device and dtype choices.

A setting of ``auto`` is decided here, at run time, on the machine in front of the user:

- ``resolve_device("auto")``: a GPU when one is present, else the CPU.
- ``cpu_bf16_supported()``: whether oneDNN has bfloat16 kernels on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT
  or AMX). Without them PyTorch's bfloat16 matrix products take a slow generic path (a (512 x 576) by (576 x 2304)
  product measured 8.7x slower than float32 on a 2-core AVX2 EPYC) and oneDNN's weight prepacking refuses to run.
  ``SPECHEADS_CPU_BF16=0`` / ``1`` forces the answer (tests exercise both sides of the check).
- ``choose_dtype``: on a GPU bfloat16 (float16 where bfloat16 is missing); on the CPU a timed probe of the
  real model's own linear layers in float32 and in bfloat16, at the row count of the stage's forwards, picks
  bfloat16 only where it is faster (never where the CPU lacks bfloat16 kernels).
- ``choose_mixed_precision``: training's autocast, by the same kind of probe over forward and backward.

Each choice is returned with its figures (``Choice``) so the stage prints one line and records it.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_ENV = "SPECHEADS_CPU_BF16"
# a dtype's name and its weight per (in, out) shape -> the layer per shape as the stage will run it (a weight or a
# callable module) and the row counts of the calls one forward makes to each layer; one with a ``describe()``
# method names what it timed in the choice's reason
RowsFor = Callable[[str, dict], tuple[dict, Sequence[int]]]


# Dense (no sparsity) peak TFLOP/s of a GPU's tensor cores in bfloat16 and of its float32 units (no TF32), from the
# vendor's data sheets (SXM parts): the share of the chip's peak a benchmark reports (``peak_tflops``)
GPU_PEAK_TFLOPS = {"H200": {"bfloat16": 989.4, "float32": 66.9}, "H100": {"bfloat16": 989.4, "float32": 66.9},
                   "A100": {"bfloat16": 312.0, "float32": 19.5}, "L40S": {"bfloat16": 362.05, "float32": 91.6}}


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """The peak TFLOP/s of the GPU named ``device_name`` (``torch.cuda.get_device_name()``) in ``dtype``
    (``bfloat16`` / ``float32``), or None for a device not in ``GPU_PEAK_TFLOPS`` (a CPU among them)."""
    for kind, peaks in GPU_PEAK_TFLOPS.items():
        if kind in str(device_name).upper():
            return peaks.get(dtype)
    return None


def resolve_device(device: str | torch.device | None, setting: str = "target.device") -> str:
    """``auto`` (or None): ``cuda`` when a GPU is present, else ``cpu``; ``cpu``, ``cuda`` or ``cuda:N`` as given,
    once this machine is known to have it. Anything else is a ``ConfigError`` naming ``setting``, raised here, where
    every stage resolves its device, before a target loads."""
    from specheads.errors import ConfigError

    if device is None or str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        kind = None
    backend = getattr(torch, kind.type, None) if kind is not None else None  # torch.mps, torch.xpu, ...
    if kind is not None and kind.type not in ("cpu", "cuda") and getattr(backend, "is_available", lambda: False)():
        return str(device)  # another accelerator torch has here: the stages were not tried on it, but it is one
    if kind is None or kind.type not in ("cpu", "cuda"):
        raise ConfigError(f"{setting}={device}: not a device here; use auto (a GPU when present, else the CPU), "
                          "cpu, cuda or cuda:N")
    if kind.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{setting}={device}: this machine has no CUDA device (torch.cuda.is_available() is "
                              "False); use auto or cpu")
        count = torch.cuda.device_count()
        if kind.index is not None and kind.index >= count:
            raise ConfigError(f"{setting}={device}: this machine has {count} CUDA device(s) (cuda:0..cuda:"
                              f"{count - 1}); use auto, cuda or one of those")
    return str(device)


def cpu_bf16_supported() -> bool:
    """True where oneDNN runs bfloat16 natively on this CPU; ``SPECHEADS_CPU_BF16=0|1`` forces the answer."""
    forced = os.environ.get(BF16_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


# The CPU flags (as /proc/cpuinfo names them) each instruction set needs before a process may be made to dispatch it:
# PyTorch's AVX-512 kernels and oneDNN's AVX512_CORE need F, BW, VL and DQ; oneDNN's AVX512_CORE_BF16 also the
# bfloat16 instructions. ``ATEN_CPU_CAPABILITY`` is not a cap but an order (PyTorch takes it without looking at the
# CPU), so forcing a set the CPU lacks kills the process with SIGILL: ask ``cpu_can_run`` first.
ISA_FLAGS = {"avx2": ("avx2", "fma"),
             "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
             "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The instruction-set flags of this CPU as the kernel lists them (the first ``flags`` line of ``cpuinfo``), or
    None where that file is missing or has no such line (not Linux on x86)."""
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return frozenset(line.split(":", 1)[1].split()) if line is not None else None


def cpu_can_run(isa: str, flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether this CPU (or one with ``flags``) has every flag ``ISA_FLAGS[isa]`` names, and, when not, why (the flags
    it lacks, or that its flags cannot be read): a test forces only the sets the hardware has."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return False, "this CPU's flags cannot be read (no flags line in /proc/cpuinfo)"
    missing = [flag for flag in ISA_FLAGS[isa] if flag not in flags]
    if missing:
        return False, f"this CPU lacks {', '.join(missing)}: forcing {isa} would kill the process (SIGILL)"
    return True, ""


def cpu_description() -> str:
    """The CPU's model name and the instruction set PyTorch dispatches (for reports and benchmarks)."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    import platform

    name = name or platform.processor() or platform.machine()
    isa = torch.backends.cpu.get_cpu_capability()
    return f"{name} ({os.cpu_count()} cores, {isa}, bf16 kernels {'yes' if cpu_bf16_supported() else 'no'})"


def machine_description(device: str | torch.device) -> str:
    """The GPU's name for a CUDA device, else ``cpu_description()``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_description()


@dataclass
class Choice:
    """A precision decided for this machine, with the figures behind it (``seconds``: per dtype, one probe)."""

    value: str
    reason: str
    seconds: dict[str, float] = field(default_factory=dict)

    def line(self, what: str) -> str:
        figures = ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in self.seconds.items())
        return f"{what}: {self.value} ({self.reason}{'; ' + figures if figures else ''})"

    def record(self) -> dict:
        return {"value": self.value, "reason": self.reason, "probe_ms": {k: round(1000 * v, 2) for k, v in
                                                                          self.seconds.items()}}


def linear_shapes(model: nn.Module) -> Counter:
    """How many ``nn.Linear`` layers (or prepacked ones) of each (in, out) shape the model has."""
    shapes: Counter = Counter()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Linear) or (type(m).__name__ == "PackedLinear" and w is not None):
            shapes[(w.shape[1], w.shape[0])] += 1
    return shapes


def _median_seconds(fn, reps: int) -> float:
    fn()  # warm-up (oneDNN primitive creation, first-touch)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _forward_seconds(weights: dict, shapes: Counter, dtype: torch.dtype, rows: int | Sequence[int], reps: int,
                     backward: bool) -> float:
    """Seconds for one pass over every linear layer of ``shapes`` (each distinct shape timed once, weighted
    by its count), ``rows`` input rows (or one call per entry of a sequence of row counts), in ``dtype``
    (weights in float32 under bfloat16 autocast for training)."""
    total = 0.0
    calls = [rows] if isinstance(rows, int) else list(rows)
    for shape, count in shapes.items():
        w = weights[shape]
        if backward:
            x = torch.randn(calls[0], shape[0], dtype=torch.float32).requires_grad_(True)

            def step():
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                    y = nn.functional.linear(x, w)
                y.float().sum().backward()
                w.grad = x.grad = None
        else:
            xs = [torch.randn(n, shape[0], dtype=dtype) for n in calls]
            linear = w if callable(w) else (lambda x, w=w: nn.functional.linear(x, w))

            def step():
                with torch.no_grad():
                    for x in xs:
                        linear(x)
        total += count * _median_seconds(step, reps)
    return total


def probe_seconds(shapes: Counter, weights: dict | None, rows: int | RowsFor, reps: int = 3, backward: bool = False,
                  dtypes=("float32", "bfloat16")) -> dict[str, float]:
    """Time one pass over ``shapes``' linear layers per dtype; ``weights``: float32 weight per shape (the real
    model's, or random ones of its shapes when None). bfloat16 copies are made per shape, one at a time.
    ``rows``: input rows per call, or (``RowsFor``) a function of the dtype's name and its weights per shape
    giving the layers as they will run and the row counts of the calls one forward makes to each."""
    out = {}
    for name in dtypes:
        dtype = DTYPES[name]
        per = {}
        for shape in shapes:
            w = weights[shape] if weights else torch.randn(shape[1], shape[0]) * shape[0] ** -0.5
            w = w.detach().float()
            if backward:
                w = w.clone().requires_grad_(True)
            elif dtype != torch.float32:
                w = w.to(dtype)
            per[shape] = w
        calls = rows
        if callable(rows):
            per, calls = rows(name, per)
        out[name] = _forward_seconds(per, shapes, dtype, calls, reps, backward)
    return out


def choose_dtype(requested: str, device: str | torch.device, model: nn.Module | None = None, rows: int | RowsFor = 256,
                 reps: int = 3, shapes: Counter | None = None) -> Choice:
    """The target's dtype for a stage: ``requested`` itself unless it is ``auto``.

    ``auto``: on a GPU bfloat16 (float16 where the GPU lacks bfloat16); on the CPU float32 where the CPU lacks
    bfloat16 kernels, else a probe of ``model``'s own linear layers (float32 weights) at ``rows`` rows per
    forward picks bfloat16 only where it is faster (``rows`` a ``RowsFor``: the layers and calls as the stage
    will run them in each dtype, e.g. exact decoding's padded calls, ``decoding.exact.ExactDecodeCalls``).
    ``shapes`` (``linear_shapes`` of a model not loaded, e.g. on the meta device: ``specheads plan``) probes
    random weights of those shapes instead. Without either the CPU
    keeps float32.
    """
    requested = str(requested)
    if requested != "auto":
        if requested not in DTYPES:
            from specheads.errors import ConfigError

            raise ConfigError(f"target.dtype={requested!r}: use auto, {', '.join(DTYPES)}")
        return Choice(requested, "as set")
    if torch.device(resolve_device(device)).type == "cuda":
        if torch.cuda.is_bf16_supported():
            return Choice("bfloat16", "GPU")
        return Choice("float16", "GPU without bfloat16")
    if not cpu_bf16_supported():
        return Choice("float32", "this CPU has no bfloat16 kernels")
    if model is None and not shapes:
        return Choice("float32", "CPU, nothing to probe")
    weights = None
    if model is not None:
        shapes, weights = linear_shapes(model), {}
        for m in model.modules():
            w = getattr(m, "weight", None)
            if w is not None and w.dim() == 2 and (w.shape[1], w.shape[0]) in shapes:
                weights.setdefault((w.shape[1], w.shape[0]), w)
    seconds = probe_seconds(shapes, weights, rows, reps)
    pick = "bfloat16" if seconds["bfloat16"] < seconds["float32"] else "float32"
    how = getattr(rows, "describe", None)
    return Choice(pick, f"timed probe of the model's linear layers {how() if how else f'at {rows} rows'}", seconds)


def choose_mixed_precision(requested: str, shapes: Counter | None = None, rows: int = 2048, reps: int = 2,
                           probe: bool = True) -> Choice:
    """Training's autocast (``no`` | ``bf16`` | ``fp16``): ``requested`` unless ``auto``.

    ``auto``: on a GPU bf16 where supported (else no); on the CPU ``no`` where the CPU lacks bfloat16 kernels,
    else a probe of forward + backward over ``shapes`` (the head's linear layers) at ``rows`` rows picks bf16
    only where it is faster. ``probe=False`` (several processes, which must agree) decides by the check alone.
    """
    if requested != "auto":
        return Choice(requested, "as set")
    if torch.cuda.is_available():
        return Choice("bf16" if torch.cuda.is_bf16_supported() else "no", "GPU")
    if not cpu_bf16_supported():
        return Choice("no", "this CPU has no bfloat16 kernels")
    if not probe or not shapes:
        return Choice("bf16", "CPU with bfloat16 kernels")
    seconds = probe_seconds(shapes, None, rows, reps, backward=True)
    pick = "bf16" if seconds["bfloat16"] < seconds["float32"] else "no"
    return Choice(pick, f"timed forward + backward of the head's linear layers at {rows} rows", seconds)


def decoder_layer_shapes(config) -> Counter:
    """The (in, out) shapes of one decoder layer's linear layers of a transformers config (a draft head's
    layer mirrors its target's): q, k, v, o and the gated MLP's three."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = text.hidden_size
    heads = getattr(text, "num_attention_heads", 1) or 1
    head_dim = getattr(text, "head_dim", None) or h // heads
    kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    inter = getattr(text, "intermediate_size", None) or 4 * h
    return Counter({(h, heads * head_dim): 1, (h, kv): 2, (heads * head_dim, h): 1, (h, inter): 2, (inter, h): 1})
