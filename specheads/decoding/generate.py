"""Speculative and plain decoding loops on one ``TargetRunner`` (so speed-ups compare like with like).

Invariant between steps: the target cache holds every token of each sequence except the last
one (the *pending* token). A step feeds [pending] + the draft tree in ONE target forward for the
whole batch, verifies each row, commits the pending token and the accepted path, and appends the
accepted tokens plus the target's bonus token (the new pending token). Plain decoding is the same
step with an empty draft.

Draft forwards are counted, not declared: ``ForwardCounter`` hooks the modules a drafter names as its draft network
(``Drafter.draft_modules``) and counts their calls in each step, so "one draft forward per step" is what ran.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from specheads.decoding.drafters import Drafter, NoDrafter
from specheads.decoding.runner import TargetRunner
from specheads.decoding.tree import DraftTree
from specheads.decoding.verify import Verdict, verify

VerifyFn = Callable[[str, torch.Tensor, DraftTree, float, torch.Generator | None], Verdict]


@dataclass
class RowStats:
    """Counts for one request, on exactly the tokens that reach the output.

    steps: target forwards; emitted: tokens appended to the output (a step's accepted path plus its
    bonus token, cut where the output ends at ``max_new_tokens`` or EOS). tested/accepted are per
    draft depth (index 0 = depth 1): the drafts verified for output position d of a step count only
    when that position reaches the output. A draft beyond the cap or after EOS never reaches the
    output and counts as neither accepted nor rejected, so τ = emitted / steps and α = accepted ÷
    tested describe the output that was produced. nodes_by_depth: draft tree nodes per depth (all
    steps), draft_forwards/draft_nodes: what drafting cost (whether or not it reached the output); draft_forwards
    counts the draft network's forward calls in the row's steps (``ForwardCounter``: a batched forward counts once
    for every row it drafted for).
    """

    steps: int = 0
    emitted: int = 0
    tested: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_forwards: int = 0
    draft_nodes: int = 0
    nodes_by_depth: list[int] = field(default_factory=list)

    def add(self, v: Verdict, tree: DraftTree, emitted: int | None = None, draft_forwards: int = 0) -> None:
        """One step; ``emitted``: how many of its ``v.tokens_emitted`` tokens reached the output;
        ``draft_forwards``: the draft forwards the step ran (counted by ``ForwardCounter``)."""
        n = v.tokens_emitted if emitted is None else min(emitted, v.tokens_emitted)
        self.steps += 1
        self.emitted += n
        self.draft_forwards += draft_forwards
        self.draft_nodes += tree.size
        depth: list[int] = []
        for p in tree.parents.tolist():
            depth.append(1 if p < 0 else depth[p] + 1)
            while len(self.nodes_by_depth) < depth[-1]:
                self.nodes_by_depth.append(0)
            self.nodes_by_depth[depth[-1] - 1] += 1
        for d, (t, a) in enumerate(zip(v.tested[:n], v.accepted[:n])):
            while len(self.tested) <= d:
                self.tested.append(0); self.accepted.append(0)
            self.tested[d] += t
            self.accepted[d] += a


@dataclass
class GenerationResult:
    """tokens: new tokens per row; stats per row; timings in seconds; forward counts for the batch.

    A step's time splits into ``draft_time`` (the drafter's proposals), ``target_time`` (the verification forward),
    ``verify_time`` (the accept/reject decisions) and the rest of ``wall_time - prefill_time`` (committing the kept
    cache entries, feeding the drafter, the counts). On a GPU these are host times unless the call asked for
    ``sync``: work a phase queued is otherwise paid by whichever phase next waits for the device.
    ``draft_forwards_by_step``: the draft network's forward calls in each step, for the whole batch (counted).
    """

    tokens: list[list[int]]
    stats: list[RowStats]
    target_forwards: int
    prefill_time: float
    target_time: float
    draft_time: float
    wall_time: float
    batch_forward_sizes: list[int] = field(default_factory=list)
    verify_time: float = 0.0
    draft_forwards_by_step: list[int] = field(default_factory=list)


class ForwardCounter:
    """Counts the forward calls of ``modules``: a forward pre-hook on each adds one to a Python int (no device work,
    no wait). A context manager: the hooks are removed on exit.

    A hook counts only calls of the module it was registered on: a shallow copy of a module (``shallow_model``'s
    decoder) shares its hook table with the original, whose own calls (the target's) must not count. Nothing counts
    while ``paused``: the decoding loop pauses it over the target's verification forward, which runs the very modules
    of a drafter that drafts with the target itself (``ModelDrafter(target)``).
    """

    def __init__(self, modules: Iterable[nn.Module]):
        self.count = 0
        self._on = True
        self._handles = []
        seen: set[int] = set()
        for m in modules:
            if id(m) not in seen:
                seen.add(id(m))
                self._handles.append(m.register_forward_pre_hook(self._hook(m)))

    def _hook(self, module: nn.Module):
        def hook(mod, args):
            if self._on and mod is module:
                self.count += 1
        return hook

    @contextmanager
    def paused(self):
        self._on = False
        try:
            yield
        finally:
            self._on = True

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "ForwardCounter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def speculative_generate(runner: TargetRunner, drafter: Drafter | None, prompts: Sequence[Sequence[int]],
                         max_new_tokens: int, temperature: float = 0.0, method: str = "auto",
                         eos_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                         verify_fn: VerifyFn = verify, verify_backend: str | None = None,
                         sync: bool = False, stop: Callable[[int, list[int]], bool] | None = None) -> GenerationResult:
    """Decode a batch of prompts with ``drafter`` (None = plain decoding). Returns new tokens and stats.

    verify_backend: None verifies row by row with ``verify_fn`` (the exact references); ``auto``,
    ``torch`` or ``triton`` verifies greedy steps (T = 0) of the whole batch in one call of
    ``verify_greedy_batched`` (``auto`` = the fused Triton kernel on CUDA, else the batched
    reference). Sampling steps always go row by row through ``verify_fn``.
    sync: wait for the device at each phase's end (CUDA), so that the timings split a step by where its device
    time went (a benchmark's setting: each wait costs a little).
    stop(b, new_tokens): called after each step of each active row with its new tokens so far; True ends that row
    there (the evaluator's exact pass stops a decode at its first token that differs from the reference).
    """
    drafter = drafter or NoDrafter()
    runner.aux_layers = tuple(drafter.aux_layers)
    wait = _device_wait(runner.device) if sync else (lambda: None)
    t_start = time.perf_counter()
    _prefill(runner, drafter, prompts, wait)
    prefill_time = time.perf_counter() - t_start
    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    stats = [RowStats() for _ in prompts]
    active = [max_new_tokens > 0 for _ in prompts]
    eos = set(eos_ids)
    target_time = draft_time = verify_time = 0.0
    forwards0 = runner.forward_calls
    sizes: list[int] = []
    by_step: list[int] = []
    counter = ForwardCounter(drafter.draft_modules())  # the draft forwards that ran, step by step
    try:
        while any(active):
            counted = counter.count
            trees, out, dt, tt = _draft_and_forward(runner, drafter, counter, seqs, active, temperature, generator,
                                                    wait)
            draft_time += dt
            target_time += tt
            sizes.append(sum(1 + trees[b].fed for b in range(len(seqs)) if active[b]))
            _observe_extra_nodes(drafter, out.logits, trees, active)
            t3 = time.perf_counter()
            keeps, news, verdicts = _step_verdicts(out.logits, trees, active, method, temperature, generator,
                                                   verify_fn, verify_backend)
            verify_time += time.perf_counter() - t3
            runner.commit(keeps)
            emitted = _advance_rows(drafter, out, keeps, news, seqs, new, active, max_new_tokens, eos, stop)
            by_step.append(counter.count - counted)  # propose, observe_forward and observe: the whole step
            for b, n in emitted.items():
                stats[b].add(verdicts[b], trees[b], n, by_step[-1])
            wait()
    finally:
        counter.close()
    return GenerationResult(new, stats, runner.forward_calls - forwards0, prefill_time, target_time,
                            draft_time, time.perf_counter() - t_start, sizes, verify_time, by_step)


def _prefill(runner: TargetRunner, drafter: Drafter, prompts: Sequence[Sequence[int]],
             wait: Callable[[], None]) -> None:
    """Prefill the target on the prompts (with the images an image prompt carries: ``vision_prompts``) and start
    the drafter on its features."""
    feats = runner.prefill(list(prompts))
    drafter.start([list(p) for p in prompts], feats)
    wait()


def _draft_and_forward(runner: TargetRunner, drafter: Drafter, counter: ForwardCounter, seqs, active: list[bool],
                       temperature: float, generator: torch.Generator | None, wait: Callable[[], None]):
    """A step's drafts and its target forward over them; returns the trees, the forward's output and the seconds
    each took (the counter paused over the target's forward: not a draft forward, whatever modules it shares)."""
    t0 = time.perf_counter()
    trees = drafter.propose(seqs, active, temperature, generator)
    wait()
    t1 = time.perf_counter()
    with counter.paused():
        out = _verify_forward(runner, seqs, trees, active)
    wait()
    t2 = time.perf_counter()
    return trees, out, t1 - t0, t2 - t1


def _observe_extra_nodes(drafter: Drafter, logits: torch.Tensor, trees: list[DraftTree], active: list[bool]) -> None:
    """Show the drafter the target's logits of each active row whose tree fed extra (never verified) nodes."""
    for b, tree in enumerate(trees):
        if active[b] and tree.fed > tree.size:
            drafter.observe_forward(b, logits[b, : tree.fed + 1], tree)


def _step_verdicts(logits: torch.Tensor, trees: list[DraftTree], active: list[bool], method: str,
                   temperature: float, generator: torch.Generator | None, verify_fn: VerifyFn,
                   verify_backend: str | None):
    """Each row's verdict, the cache entries it keeps and its new tokens (empty and None for inactive rows): greedy
    steps of the batch in one batched call where ``verify_backend`` asks, else row by row through ``verify_fn``."""
    keeps, news, verdicts = [], [], []
    batched = _verify_batch(logits, trees, active, verify_backend) \
        if verify_backend and (temperature <= 0 or method == "greedy") else None
    for b, tree in enumerate(trees):
        if not active[b]:
            keeps.append([]); news.append([]); verdicts.append(None)
            continue
        v = batched[b] if batched is not None else \
            verify_fn(method, logits[b, : tree.size + 1], tree, temperature, generator)
        verdicts.append(v)
        keeps.append([0] + [i + 1 for i in v.path])
        news.append([int(tree.tokens[i]) for i in v.path] + [v.bonus])
    return keeps, news, verdicts


def _advance_rows(drafter: Drafter, out, keeps: list[list[int]], news: list[list[int]], seqs, new, active,
                  max_new_tokens: int, eos: set[int], stop: Callable[[int, list[int]], bool] | None) -> dict[int, int]:
    """Append each active row's new tokens, end the rows that stop, and feed the drafter what was kept; returns
    how many tokens each active row appended."""
    emitted: dict[int, int] = {}
    for b in range(len(seqs)):
        if active[b]:
            emitted[b] = _append(b, news[b], seqs, new, active, max_new_tokens, eos)
            if stop is not None and active[b] and stop(b, new[b]):
                active[b] = False
            if drafter.needs_features:
                drafter.observe(b, news[b], _rows(out.hidden_last, b, keeps[b]),
                                _rows(out.hidden_aux, b, keeps[b]))
            else:
                drafter.observe(b, news[b], None, None)
    return emitted


def _device_wait(device: torch.device) -> Callable[[], None]:
    """A call that returns once ``device`` has done the work queued on it (nothing to wait for off CUDA)."""
    if torch.device(device).type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def plain_generate(runner: TargetRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float = 0.0, eos_ids: Sequence[int] = (),
                   generator: torch.Generator | None = None) -> GenerationResult:
    """The baseline: one target forward per token, on the same engine."""
    return speculative_generate(runner, None, prompts, max_new_tokens, temperature, "greedy"
                                if temperature <= 0 else "tree", eos_ids, generator)


def _verify_forward(runner: TargetRunner, seqs, trees: list[DraftTree], active: list[bool]):
    """One target forward over [pending] + tree (+ its extra nodes) for every row (inactive rows are padding)."""
    B = len(seqs)
    q = 1 + max((t.fed for b, t in enumerate(trees) if active[b]), default=0)
    tok = torch.zeros(B, q, dtype=torch.long)
    par = torch.full((B, q), -1, dtype=torch.long)
    live = torch.zeros(B, q, dtype=torch.bool)
    for b, tree in enumerate(trees):
        if not active[b]:
            continue
        n = tree.fed
        tokens, parents = tree.fed_tokens_parents()
        tok[b, 0] = seqs[b][-1]
        tok[b, 1: n + 1] = tokens
        par[b, 1: n + 1] = parents + 1
        live[b, : n + 1] = True
    tok, par, live = torch.stack([tok, par, live.long()]).to(runner.device)  # one copy to the device (a wait on a GPU)
    return runner.forward(tok, par, live.bool())


def _verify_batch(logits: torch.Tensor, trees: list[DraftTree], active: list[bool], backend: str):
    """Greedy verdicts of every row in one batched call (inactive rows are empty trees, ignored)."""
    from specheads.decoding.batched_verify import pack_trees, to_verdicts, verify_greedy_batched

    n = max((t.size for b, t in enumerate(trees) if active[b]), default=0)
    logits = logits[:, : n + 1]  # extra (never verified) nodes come after the draft nodes
    tokens, parents = pack_trees([t if active[b] else DraftTree.empty() for b, t in enumerate(trees)], n)
    tokens, parents = torch.stack([tokens, parents]).to(logits.device)  # one copy to the device
    out = verify_greedy_batched(logits, tokens, parents, backend, check=False)
    return to_verdicts(*out, parents)


def _rows(t: torch.Tensor | None, b: int, idx: list[int]) -> torch.Tensor | None:
    return None if t is None else t[b, idx]


def _append(b, tokens, seqs, new, active, max_new_tokens, eos) -> int:
    """Append a step's tokens to row ``b`` up to the cap or EOS; returns how many were appended."""
    for i, t in enumerate(tokens):
        seqs[b].append(t)
        new[b].append(t)
        if len(new[b]) >= max_new_tokens or t in eos:
            active[b] = False
            return i + 1
    return len(tokens)
