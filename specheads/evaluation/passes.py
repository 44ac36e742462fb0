"""The evaluation's two passes over the same prompts: the fast pass is timed, the exact pass judges.

**Fast pass**: the target decodes as users' decoding loops and serving engines run it: its own attention (or the
grouped-query SDPA of ``decoding.grouped_attention``) and its linear layers as the kernels choose (no row floor),
plain and speculative decoding alike. Every speed and acceptance figure comes from it: tokens/s, speed-ups, α, τ,
the verify cost curve and the shape chosen from it, the batch speeds. Exact forwards' padding made a verify forward
cost about 1.6 plain forwards on a 2-core AVX2 CPU: timed there, a head looked slower than plain decoding while
the same head decoded faster, and still identically, in the kernels users run.

**Exact pass** (exact forwards on: ``exact_forward=on``, or ``auto`` on a CPU target): the same prompts in
batch-invariant forwards (``decoding.exact``: float64 attention, linear calls padded to the row floor, proven on
this machine before any decode). Plain greedy decoding of each prompt is the reference (a turn-2 prompt carries its
turn-1 reference answer, so both passes decode the same prompts); each row that runs at T = 0 then decodes every
prompt greedily once more, untimed, each decode stopped at its first token off the reference. Its verdict is the
lossless column: any difference is a failure, with the target's logit margin there.

**Numerical divergence**: in the fast pass a verify forward over several tokens may round a logit otherwise than
a one-token forward does, and where the target's top two logits lie that close the greedy token flips. A fast-pass
greedy output that differs from the fast plain output while the exact pass is identical is reported as such, with
the target's top-2 margin at the first differing position, not as a lossless failure.

``exact_forward=off`` (and ``auto`` on a GPU): no exact pass; the lossless column is the fast pass's comparison
(every difference a mismatch, the margin beside it) and the report says that its verdict is the fast pass's alone.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from specheads.data.benchmarks import EvalPrompt
from specheads.decoding.exact import ATTENTION_NAME, ProofScope, make_exact, row_floor_set, set_row_floor
from specheads.decoding.generate import speculative_generate
from specheads.decoding.grouped_attention import use_grouped_attention
from specheads.decoding.vision_prompts import prompt_images
from specheads.evaluation.prompts import encode, turn_id
from specheads.evaluation.spec import draft_rows
from specheads.targets import Target

# the report's figures and the pass each comes from (report.json's ``passes.figures``)
FAST_FIGURES = ("tokens_per_s", "speedup", "alpha", "tau", "verify_cost_curve", "shape_choice", "batch")


@dataclass
class Kernels:
    """How the target computes in each pass: ``fast_attention`` (the attention implementation of the fast pass, its
    linear layers unpadded) and ``exact_attention`` (the exact pass's, padded to the row floor), None without an
    exact pass."""

    model: nn.Module
    fast_attention: str
    exact_attention: str | None = None

    @property
    def exact_pass(self) -> bool:
        return self.exact_attention is not None

    def use_fast(self) -> None:
        """The fast kernels from now on: what the evaluation decodes in outside ``exact()``."""
        _set_attention(self.model, self.fast_attention)
        set_row_floor(self.model, False)

    @contextmanager
    def exact(self):
        """The exact forwards inside the block (the model's earlier attention and floor come back after it)."""
        if not self.exact_pass:
            raise RuntimeError("no exact pass: exact forwards are off")
        before = self.model.config._attn_implementation
        _set_attention(self.model, self.exact_attention)
        try:
            with row_floor_set(self.model, True):
                yield
        finally:
            _set_attention(self.model, before)

    @contextmanager
    def fast(self):
        """The fast kernels inside the block (the set-up's timings run in them before the proof)."""
        before = self.model.config._attn_implementation
        _set_attention(self.model, self.fast_attention)
        try:
            with row_floor_set(self.model, False):
                yield
        finally:
            _set_attention(self.model, before)

    def record(self) -> dict:
        """The report's ``passes``: each pass's kernels and what it gives."""
        fast = {"attention": self.fast_attention, "row_floor": False, "timed": True, "gives": list(FAST_FIGURES)}
        exact = {"attention": self.exact_attention, "row_floor": True, "timed": False, "gives": ["lossless"]} \
            if self.exact_pass else None
        figures = {**{k: "fast" for k in FAST_FIGURES}, "lossless": "exact" if self.exact_pass else "fast"}
        return {"fast": fast, "exact": exact, "figures": figures}


def _set_attention(model: nn.Module, name: str) -> None:
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def prepare_kernels(model: nn.Module, exact_forward: str, grouped_attention: bool) -> tuple[Kernels, dict]:
    """Set the target up for both passes, before any forward: the fast attention (grouped-query SDPA where
    ``grouped_attention`` and the model takes it, else the model's own), then exact forwards per ``exact_forward``
    (``decoding.exact.make_exact``: float64 attention, bfloat16 CPU weights prepacked). Returns the kernels and
    ``make_exact``'s record (its ``attention``: the exact pass's, or the fast one without an exact pass). The model
    is left on the exact attention, if any, for ``settle_exact`` to prove; ``Kernels.use_fast`` switches after."""
    if grouped_attention:
        use_grouped_attention(model)
    fast = model.config._attn_implementation
    record = make_exact(model, exact_forward)
    return Kernels(model, fast, ATTENTION_NAME if record["attention"] == ATTENTION_NAME else None), record


def reference_decode(kernels: Kernels, runner, prompt_ids, max_new_tokens: int, eos) -> list[int] | None:
    """The exact pass's plain greedy decode of one prompt (the lossless reference), None without an exact pass."""
    if not kernels.exact_pass:
        return None
    with kernels.exact():
        return speculative_generate(runner, None, [prompt_ids], max_new_tokens, 0.0, "greedy", eos).tokens[0]


def timed_reference_decode(kernels: Kernels, runner, prompt_ids, max_new_tokens: int, eos) -> float | None:
    """Seconds of one ``reference_decode`` (what the time budget prices the exact pass's decodes from), None
    without an exact pass."""
    if not kernels.exact_pass:
        return None
    t = time.perf_counter()
    reference_decode(kernels, runner, prompt_ids, max_new_tokens, eos)
    return time.perf_counter() - t


def exact_pass(kernels: Kernels, target, runner, drafter, prompts, ids: dict, max_new_tokens: int, verify: str,
               eos, progress: Callable[[str], None], name: str) -> list[dict]:
    """The exact pass of one row: each prompt decoded greedily by ``drafter`` in exact forwards, untimed, stopped at
    its first token off the reference (``ids["tokens"]``). Returns the mismatches (``first_divergence``, with
    ``prompt``), one progress report per prompt."""
    out = []
    with kernels.exact():
        for i, (p, pid, want) in enumerate(zip(prompts, ids["prompt_ids"], ids["tokens"])):
            res = speculative_generate(runner, drafter, [pid], max_new_tokens, 0.0, verify, eos,
                                       stop=lambda b, got, want=want: got != want[:len(got)])
            m = first_divergence(target, pid, want, res.tokens[0])
            if m:
                out.append({"prompt": p.id, **m})
            progress(f"{name} exact pass {i + 1}/{len(prompts)}")
    return out


def first_divergence(target, prompt_ids, want, got) -> dict | None:
    """First difference of speculative (``got``) from plain greedy output (``want``), with the target's top-2 logit
    margin there (in the kernels the model runs now) and its margin between the two tokens; None when identical."""
    n = min(len(want), len(got))
    i = next((j for j in range(n) if want[j] != got[j]), None)
    if i is None:
        return None if len(want) == len(got) else {"index": n, "reason": f"lengths {len(want)} vs {len(got)}"}
    ids = torch.tensor([list(prompt_ids) + list(want[:i])], device=target.device)
    with torch.no_grad():
        logits = target.model(ids, **_pixel_inputs(target, prompt_ids, ids)).logits[0, -1]
    top = logits.float().topk(2)
    return {"index": i, "plain": int(want[i]), "speculative": int(got[i]),
            "margin": float(top.values[0] - top.values[1]),
            "margin_vs_speculative": float(logits[want[i]] - logits[got[i]])}


def _pixel_inputs(target, prompt_ids, ids: torch.Tensor) -> dict:
    """The multimodal model's inputs for an image prompt's images (``vision_prompts.ImagePrompt``), {} for text: the
    margin at a divergence is the one the target decoded with, its images in their tokens."""
    images = prompt_images(prompt_ids)
    if images is None:
        return {}
    dtype = next(target.model.parameters()).dtype
    return {"pixel_values": images["pixel_values"].to(target.device, dtype),
            "image_grid_thw": images["image_grid_thw"].to(target.device),
            "mm_token_type_ids": (ids == target.model.config.image_token_id).int()}


def lossless_verdict(kernels: Kernels, checked: int, fast_differences: list[dict], exact_mismatches: list[dict]) -> dict:
    """A row's lossless record: {"checked", "pass" (the pass that judged: exact, or fast without an exact pass),
    "exact" (the verdict), "mismatches" (failures), "divergences" (fast-pass differences the exact pass does not
    have: numerical, at the target's top-2 margin)}."""
    if not kernels.exact_pass:
        return {"checked": checked, "pass": "fast", "exact": not fast_differences, "mismatches": fast_differences,
                "divergences": []}
    failed = {m["prompt"] for m in exact_mismatches}
    return {"checked": checked, "pass": "exact", "exact": not exact_mismatches, "mismatches": exact_mismatches,
            "divergences": [d for d in fast_differences if d["prompt"] not in failed]}


def proof_scope(cfg, prompts: list[EvalPrompt], target: Target) -> ProofScope:
    """What the evaluation of ``cfg`` (an ``EvalConfig``) verifies, for the exact forwards' proof: the largest draft of any method, the largest
    batch, and the longest context (each prompt's turns through the chat template, the earlier turns' answers
    counted at ``max_new_tokens`` each, plus the new tokens), at most the target's context."""
    longest = 0
    for p in prompts:
        try:
            earlier = {turn_id(p, t): "" for t in range(p.turn)}
            n = len(encode(p, target.tokenizer, earlier, cfg.chat_template_kwargs))
        except (KeyError, ValueError):  # no chat template: the prompt's own ids, or nothing to measure
            n = len(p.input_ids or ())
        longest = max(longest, n + cfg.max_new_tokens * (p.turn + 1))
    limit = getattr(target.model.config, "max_position_embeddings", None) or longest
    return ProofScope(size=max((draft_rows(m) for m in cfg.methods), default=0),
                      batch=max(cfg.batch_sizes, default=1), context=min(longest, limit))
