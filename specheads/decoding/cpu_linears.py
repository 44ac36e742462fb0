"""Linear layers prepacked for oneDNN on the CPU, and the measured choice of whether to use them.

An unpacked CPU ``nn.Linear`` hands its weight to the BLAS in PyTorch's layout on every call. At the
handful of rows a decode step feeds, that path is slow and, worse for speculative decoding, uneven
in the row count: on the 2-core AMD EPYC (AVX-512, no AMX) the float32 SmolLM2 LM head (576 x 49152)
took 9.6 ms for one row, 33 ms for three and 17.8 ms for four, so a target forward over 3 tokens cost
1.95 one-token forwards and the evaluator's shape choice could only afford a chain of one. The same
weights reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) took
4.1 ms for one row and ~7 ms for 2 to 8, and the whole forward became flat: one token 55.5 vs 64.5 ms,
v(2) 1.10, v(3) 1.08, v(4) 1.07, v(8) 1.19 (unpacked: 1.68, 1.95, 1.48, 1.35; one process, 8
interleaved rounds, context 300). On a CPU with AMX an earlier measurement found packed float32 slower
at one row, so ``choose_cpu_linears`` measures both layouts on the machine at hand and keeps the packed
one only where its one-token forward is not slower: plain decoding, the baseline of every speed-up,
never runs on the slower layout.

The reorder takes a batch hint, the row count oneDNN lays the weight out for. Laid out for one row, the
weight is slow again from two rows on. The same EPYC, 2 threads, SmolLM2 float32, context 300, the three
layouts interleaved in one process (``BATCH_HINT``): held to AVX2 (ATen, oneDNN and MKL), one token 50.4 /
46.9 / 45.6 ms for hints 1 / 2 / 4, v(2) 1.37 / 1.09 / 1.12, v(4) 1.44 / 1.20 / 1.21, v(8) 1.61 / 1.36 / 1.39;
with AVX-512, one token 49.3 / 46.8 / 46.4 ms, v(4) 1.20 / 1.00 / 1.01; one thread held to AVX2, one token
64.7 / 64.1 / 64.7 ms, v(2) 1.53 / 1.07 / 1.07. The LM head alone (576 x 49152, AVX2, 2 threads): 5.0 / 8.9 /
9.4 ms for 1 / 2 / 4 rows laid out for one, 5.9 / 6.0 / 6.5 ms laid out for four.
``scripts/bench/bench_verify_cost.py`` measures the curve of the layout ``choose_cpu_linears`` keeps.

A ``PackedLinear`` keeps the original parameter as ``weight`` (drafters that borrow the LM head's rows
keep working) beside the packed copy; its results equal ``nn.Linear``'s up to float rounding (bitwise
in bfloat16, where oneDNN's row results do not depend on the row count; see ``exact.py``).
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

from specheads.decoding.runner import TargetRunner
from specheads.errors import one_line
from specheads.hardware import cpu_bf16_supported

log = logging.getLogger(__name__)

CPU_LINEAR_MODES = ("auto", "packed", "plain")
BATCH_HINT = 4
"""The rows oneDNN lays a packed weight out for: a verify forward's few rows (a chain, a small tree, a batch of
four prompts' one token each) at about the cost of one; ``choose_cpu_linears`` still times this layout's
one-token forward against the plain layers before keeping it."""


class PackedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight also lives in oneDNN's blocked layout (CPU inference only)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.batch_hint = batch_hint
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.use_packed = True  # False: multiply as ``nn.Linear`` does (``choose_cpu_linears`` times both)

    def __deepcopy__(self, memo):
        """A copy packed from the copied weight: the packed tensor is opaque to ``copy.deepcopy`` (its storage
        cannot be read), so a copy of a packed model (a target after an evaluation chose the packed layout)
        would otherwise fail."""
        import copy

        lin = self.unpacked()
        lin.weight, lin.bias = copy.deepcopy(self.weight, memo), copy.deepcopy(self.bias, memo)
        twin = PackedLinear(lin, self.batch_hint)
        twin.use_packed, twin.training = self.use_packed, self.training
        memo[id(self)] = twin
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_packed:
            return nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        bias = None if self.bias is None else self.bias.detach()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def unpacked(self) -> nn.Linear:
        """The plain ``nn.Linear`` over the same parameters."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device="meta", dtype=self.weight.dtype)
        lin.weight, lin.bias = self.weight, self.bias
        return lin


def can_pack(model: nn.Module) -> bool:
    """Packing applies to a float32 model on the CPU where oneDNN is available, and to a bfloat16 one where
    the CPU also has oneDNN's bfloat16 kernels (``hardware.cpu_bf16_supported``: without AVX-512 or
    AVX-NE-CONVERT the bfloat16 reorder refuses to run)."""
    p = next(model.parameters())
    if p.dtype == torch.bfloat16 and not cpu_bf16_supported():
        return False
    return (p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _swap(model: nn.Module, kind: type, make) -> int:
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))
                n += 1
    return n


def pack_cpu_linears(model: nn.Module) -> int:
    """Replace every plain ``nn.Linear`` by a ``PackedLinear`` (in place); returns how many.

    Where oneDNN still refuses the reorder (a CPU whose bfloat16 support the check misjudged, or one forced
    with ``SPECHEADS_CPU_BF16=1``), the model is left with its plain layers and 0 is returned: slower, never
    a crash."""
    if not can_pack(model):
        raise ValueError("pack_cpu_linears needs a float32 model, or a bfloat16 one on a CPU with bfloat16 "
                         "kernels, on a CPU with oneDNN")
    try:
        return _swap(model, nn.Linear, PackedLinear)
    except RuntimeError as e:
        unpack_cpu_linears(model)
        log.warning("oneDNN could not prepack the linear layers (%s); keeping plain ones", one_line(e))
        return 0


def unpack_cpu_linears(model: nn.Module) -> int:
    """Undo ``pack_cpu_linears`` (the packed copies are freed); returns how many were restored."""
    return _swap(model, PackedLinear, PackedLinear.unpacked)


def pack_like(module: nn.Module, target: nn.Module) -> int:
    """Pack ``module``'s linear layers (a drafter's) where ``target``'s are packed: the layout measured
    faster for the target's one-token forwards serves the drafter's few-row forwards too. Returns how many."""
    if not packed_count(target) or not can_pack(module):
        return 0
    return pack_cpu_linears(module)


def packed_count(model: nn.Module) -> int:
    return sum(type(m) is PackedLinear for m in model.modules())


def _one_token_seconds(runner, token: int, reps: int) -> float:
    """Median of ``reps`` one-token forwards after the runner's committed context (one more warms up)."""
    return statistics.median([runner.timed_chain([token]) for _ in range(reps + 1)][1:])


def choose_cpu_linears(model: nn.Module, mode: str = "auto", context: int = 256, rounds: int = 5,
                       reps: int = 3) -> dict:
    """Pack ``model``'s linear layers (``packed``), leave them (``plain``) or measure (``auto``, in place).

    ``auto`` on a CPU with oneDNN times a one-token forward after ``context`` tokens with both layouts,
    ``rounds`` interleaved rounds of ``reps`` forwards each, and keeps the packed layout only where its
    median is not slower; elsewhere (GPU, float16, no oneDNN) it leaves the model as it is. A model that
    is already packed (``exact.make_exact`` packs bfloat16 CPU targets) stays packed. Returns what was
    done, for the report: {"linears": "packed" | "plain", "packed_linears": n, "one_token_ms": {...}}.
    """
    if mode not in CPU_LINEAR_MODES:
        raise ValueError(f"cpu_linears={mode!r}: use one of {', '.join(CPU_LINEAR_MODES)}")
    done = packed_count(model)
    if done or mode == "plain" or not can_pack(model):
        if mode == "packed" and not done:
            raise ValueError("cpu_linears=packed needs a float32 model (bfloat16 where the CPU has bfloat16 kernels) on a CPU with oneDNN")
        return {"linears": "packed" if done else "plain", "packed_linears": done, "one_token_ms": None}
    n = pack_cpu_linears(model)
    if mode == "packed":
        return {"linears": "packed", "packed_linears": n, "one_token_ms": None}
    vocab = model.config.vocab_size
    prompt = [(17 + 31 * i) % vocab for i in range(context)]
    runner = TargetRunner(model)
    runner.prefill([prompt])  # the context both layouts are timed after
    layers = [m for m in model.modules() if type(m) is PackedLinear]
    times: dict[str, list[float]] = {"packed": [], "plain": []}
    for _ in range(rounds):
        for layout in ("packed", "plain"):
            for m in layers:
                m.use_packed = layout == "packed"
            times[layout].append(_one_token_seconds(runner, prompt[-1], reps))
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    keep = "packed" if ms["packed"] <= ms["plain"] else "plain"
    for m in layers:
        m.use_packed = True
    if keep == "plain":
        unpack_cpu_linears(model)  # the packed copies are freed
    log.info("CPU linear layers: one-token forward %.1f ms packed vs %.1f ms plain -> %s",
             ms["packed"], ms["plain"], keep)
    return {"linears": keep, "packed_linears": n if keep == "packed" else 0, "one_token_ms": ms}

