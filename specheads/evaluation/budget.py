"""What an evaluation decodes under a time budget (``eval.max_minutes``): coverage first.

An ``EvalPlan`` names the prompts every row decodes, the temperatures each method row runs at and the batch
sizes it is timed at. ``plan_budget`` buys, in this order, from one measured plain decode's time:

1. the core, always: one prompt of every domain (its first question's first turn), the head's own row
   (each head's first shape without a serving profile or lookup branch) and the baselines with no model (n-gram,
   suffix decoding: ``MODEL_FREE``), at T = 0
   (or the first temperature when 0 is not asked for), with the plain decodes they need;
2. the other rows at T = 0 on those prompts, in the method order;
3. the other temperatures of each row that runs at T = 0 (a row never samples without its lossless check);
4. more prompts, round-robin over the domains (a later turn right after its first), each decoded by
   every row and temperature bought so far, until one no longer fits;
5. batch sizes > 1 of the rows that run.

Every row that runs decodes the same prompts at each of its temperatures, so the report's ``prompt_ids``
are every row's prompts; what did not fit is the record's ``left_out``.

With an exact pass (``passes.py``), each purchase carries its share of it: per prompt a plain decode in exact
forwards (the reference), and per row that runs at T = 0 one speculative decode of each prompt in exact forwards
(untimed: one decode, no repeats, no paired plain decode), each priced at the measured ratio of an exact-pass
decode to a fast one (``exact_cost``). The core includes its own exact pass, so every domain gets a verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specheads.data.benchmarks import EvalPrompt
from specheads.evaluation.prompts import turn_id

SHAPE_CHOICE_DECODES = 6  # what one head's shape choice costs, in plain decodes (cost curve + draft timing)
SPEC_DECODE_COST = 1.5  # a speculative decode in plain decodes (drafting and wider forwards; a 2-core AVX2
# EPYC's main job spent about 1.5x its plain decodes on the speculative ones)
PROBE_DECODES = 2  # the budget's own warm-up and timed plain decode


@dataclass
class EvalPlan:
    """prompts: decoded plainly and by every row that runs; temperatures[i] / batch_sizes[i]: what
    ``methods[i]`` runs at (empty: the row is left out); record: the budget's decision for the report
    (None without a budget)."""

    prompts: list[EvalPrompt]
    temperatures: list[tuple[float, ...]]
    batch_sizes: list[tuple[int, ...]]
    record: dict | None = None

    def plain_temperatures(self) -> list[float]:
        """The temperatures plain decoding is timed at: 0 (the answers) and each one a row runs at."""
        return sorted({0.0}.union(*self.temperatures))

    def steps(self, methods, repeats: int, paired: bool, batch_prompts: int, exact: bool = False) -> int:
        """The progress reports ``suite.evaluate`` makes for this plan (the bar's total); ``exact``: with an exact
        pass (one report per reference decode and per prompt of each row's exact pass at T = 0)."""
        n, wanted = len(self.prompts), 1 if paired else max(repeats, 1)
        plain = n + sum(wanted - (1 if T == 0 else 0) for T in self.plain_temperatures())
        rows = sum(len(ts) * (n + max(repeats, 1) - 1) for ts in self.temperatures)
        batched = min(batch_prompts, n)
        rows += sum(-(-batched // bs) for sizes in self.batch_sizes for bs in sizes)
        checks = n * (1 + sum(1 for ts in self.temperatures if 0.0 in ts)) if exact else 0
        return plain + rows + len(_auto_heads(methods, self.temperatures)) + checks


def full_plan(prompts: list[EvalPrompt], methods, temperatures, batch_sizes) -> EvalPlan:
    """Everything: every prompt, every row at every temperature and batch size > 1."""
    return EvalPlan(list(prompts), [tuple(temperatures)] * len(methods),
                    [tuple(b for b in batch_sizes if b > 1)] * len(methods))


MODEL_FREE = ("ngram", "suffix")
"""The baselines that need no trained model (prompt lookup, suffix decoding): the first row of each asked for is in
the core, beside the heads, so that a slow CPU still compares every head with them on every domain."""


def core_rows(methods) -> list[int]:
    """The rows the budget always keeps: each head's own row (its first without a serving profile or a
    prompt-lookup branch) and the first row of each ``MODEL_FREE`` baseline; the first row when there is none."""
    heads, core = set(), []
    for i, m in enumerate(methods):
        if m.head_dir and m.head_dir not in heads and not m.profile and not m.ngram_branch:
            heads.add(m.head_dir)
            core.append(i)
    for drafter in MODEL_FREE:
        core += [i for i, m in enumerate(methods) if m.drafter == drafter][:1]
    return sorted(core) or [0]


def prompt_order(prompts: list[EvalPrompt]) -> list[EvalPrompt]:
    """The set's prompts in the order the budget takes them: round-robin over domains (in set order), each
    domain's prompts in set order with a later turn right after its first. The first len(domains) are the
    first prompt of each domain."""
    later: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        if p.turn > 0:
            later.setdefault(turn_id(p, 0), []).append(p)
    domains: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        if p.turn == 0:
            domains.setdefault(p.domain, []).extend([p, *later.get(p.id, [])])
    queues = list(domains.values())
    return [q[depth] for depth in range(max(map(len, queues), default=0)) for q in queues if depth < len(q)]


def plan_budget(prompts: list[EvalPrompt], methods, temperatures, batch_sizes, *, budget_s: float,
                decode_s: float, repeats: int, paired: bool, batch_prompts: int, max_new_tokens: int,
                exact_cost: float = 0.0) -> EvalPlan:
    """The plan that fits ``budget_s`` seconds (what is left of the budget) at ``decode_s`` per plain decode,
    bought in the module docstring's order; the core is kept even when it alone does not fit
    (``record["over_budget"]``). Costs are in plain decodes of the fast pass (``Costs``); ``exact_cost``: one
    exact-pass decode in those units (0: no exact pass)."""
    order = prompt_order(prompts)
    n_domains = len({p.domain for p in order})
    cost = Costs(methods, repeats, paired, batch_prompts, max_new_tokens, exact=exact_cost)
    T0 = 0.0 if 0.0 in temperatures else temperatures[0]
    core = core_rows(methods)
    temps: list[list[float]] = [[T0] if i in core else [] for i in range(len(methods))]
    sizes: list[list[int]] = [[] for _ in methods]
    n = n_domains
    limit = budget_s / decode_s
    fits = lambda t, s, k: cost.total(t, s, k) <= limit  # noqa: E731

    for i in range(len(methods)):  # 2. the other rows at T0
        if i not in core and fits(_with(temps, i, T0), sizes, n):
            temps[i].append(T0)
    for T in temperatures:  # 3. the other temperatures of the rows that run
        for i in range(len(methods)):
            if T != T0 and temps[i] and fits(_with(temps, i, T), sizes, n):
                temps[i].append(T)
    while n < len(order) and fits(temps, sizes, n + 1):  # 4. more prompts
        n += 1
    for i in range(len(methods)):  # 5. batch sizes
        for bs in batch_sizes:
            if bs > 1 and temps[i] and fits(temps, _with(sizes, i, bs), n):
                sizes[i].append(bs)
    kept = {p.id for p in order[:n]}
    plan = EvalPlan([p for p in prompts if p.id in kept], [tuple(t for t in temperatures if t in ts) for ts in temps],
                    [tuple(s) for s in sizes])
    plan.record = _record(plan, methods, temperatures, batch_sizes, prompts, order[:n_domains], core, T0,
                          cost.total(temps, sizes, n) * decode_s, budget_s)
    plan.record.update(exact_cost=round(exact_cost, 2), exact_s=round(cost.exact_part(temps, n) * decode_s, 1))
    return plan


def _with(lists: list[list], i: int, value) -> list[list]:
    return [l + [value] if j == i else l for j, l in enumerate(lists)]


@dataclass
class Costs:
    """An evaluation's cost in plain decodes (one prompt's greedy plain decode in the fast pass = 1): per prompt a
    plain decode, per row, temperature and prompt ``repeats`` speculative decodes (``SPEC_DECODE_COST``), each with
    its paired plain decode (``paired``) or beside ``repeats`` plain passes per temperature; per row a short
    warm-up, per auto-shaped head its shape choice, per row and batch size > 1 its plain and speculative batches
    (priced as batch-1 decodes of the same prompts: an upper bound); and the exact pass (``exact_part``), each of
    its decodes ``exact`` plain decodes (0: no exact pass)."""

    methods: list
    repeats: int
    paired: bool
    batch_prompts: int
    max_new_tokens: int
    spec: float = field(default=SPEC_DECODE_COST)
    exact: float = 0.0

    def exact_part(self, temps: list[list[float]], n: int) -> float:
        """The exact pass: its timed probe, each prompt's reference decode, one speculative decode per prompt of
        each row that runs at T = 0."""
        if not self.exact:
            return 0.0
        return self.exact * (1 + n + sum(1 for t in temps if 0.0 in t) * n * self.spec)

    def total(self, temps: list[list[float]], sizes: list[list[int]], n: int) -> float:
        r = max(self.repeats, 1)
        unit = r * (self.spec + (1 if self.paired else 0))
        plain_temps = {0.0}.union(*map(set, temps))
        plain = n * (1 + sum((1 if T else 0) if self.paired else (r - (1 if T == 0 else 0)) for T in plain_temps))
        rows = sum(len(t) for t in temps) * n * unit
        warm = sum(1 for t in temps if t) * self.spec * min(8, self.max_new_tokens) / max(self.max_new_tokens, 1)
        batch = sum(len(s) for s in sizes) * min(self.batch_prompts, n) * (1 + self.spec)
        shapes = len(_auto_heads(self.methods, temps)) * SHAPE_CHOICE_DECODES
        return PROBE_DECODES + plain + rows + warm + batch + shapes + self.exact_part(temps, n)


def _auto_heads(methods, temps) -> set:
    """The auto-shaped heads among the rows that run (one shape choice each)."""
    return {(m.drafter, m.head_dir) for m, t in zip(methods, temps) if t and m.auto_shape}


def _record(plan: EvalPlan, methods, temperatures, batch_sizes, prompts, core_prompts, core, T0, estimate_s,
            budget_s) -> dict:
    """The budget's decision as the report shows it: the core, and what was left out for time."""
    kept = {p.id for p in plan.prompts}
    rows = [{"method": m.name, "temperatures": [T for T in temperatures if T not in ts]}
            for m, ts in zip(methods, plan.temperatures) if len(ts) < len(temperatures)]
    batches = [{"method": m.name, "batch_sizes": [b for b in batch_sizes if b > 1 and b not in bs]}
               for m, bs, ts in zip(methods, plan.batch_sizes, plan.temperatures)
               if ts and any(b > 1 and b not in bs for b in batch_sizes)]
    return {"prompts": len(plan.prompts), "of": len(prompts),
            "core": {"methods": [methods[i].name for i in core], "temperature": T0,
                     "prompts": [p.id for p in core_prompts], "domains": [p.domain for p in core_prompts]},
            "left_out": {"rows": rows, "prompts": [p.id for p in prompts if p.id not in kept],
                         "batch_sizes": batches},
            "over_budget": estimate_s > budget_s, "plan_s": round(estimate_s, 1)}
