"""Run an evaluation: plain decoding, then each drafting method at each temperature, batch sizes,
the lossless check, and the figures the report needs.

Every method runs on the same ``TargetRunner`` as the plain baseline, prompt by prompt at batch 1
(then in batches), so speed-ups compare like with like. MT-bench turn-2 prompts include the
target's own plain-greedy turn-1 answer (identical for every lossless method at T = 0).

Two passes (``passes.py``): every timed decode, and so every speed and acceptance figure, runs in the fast kernels
(the target's own attention, linear layers as the kernels choose: what users and engines run); the lossless verdict
comes from the exact pass, untimed, in exact forwards, on the same prompts.

Timing: the target and each drafter decode one short untimed warm-up first. Plain decoding runs at
every temperature (sampling has its own cost), and plain and speculative batch-1 decoding are each
timed ``repeats`` times over the same prompts (same seeds): the first pass also gives the acceptance
counts and the lossless check, the others only time the decode. Speeds are medians over the passes,
with their range (``metrics.timed``). With ``paired`` (the default) every speculative pass decodes
each prompt plainly right before decoding it speculatively, and the speed-up is the median of the
per-pass ratios (``metrics.speedup_paired``): on a shared machine whose speed drifts over minutes,
comparing against plain passes timed minutes earlier moved the same head's ratio from 0.93x to 2.00x
(measured in docs/ablations.md). Without it, plain passes timed once are the reference (``metrics.speedup_spread``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from specheads.data.benchmarks import EvalPrompt
from specheads.decoding.cpu_linears import choose_cpu_linears
from specheads.decoding.cpu_threads import choose_cpu_threads
from specheads.decoding.drafters import Drafter, PromptLookupBranch, TreeShape
from specheads.decoding.exact import settle_exact
from specheads.decoding.generate import GenerationResult, speculative_generate
from specheads.decoding.runner import TargetRunner
from specheads.decoding.verify import LOSSLESS
from specheads.errors import UserError
from specheads.evaluation.budget import EvalPlan, full_plan, plan_budget
from specheads.evaluation.drafters import load_ngram_table, make_drafter
from specheads.evaluation.inputs import check_methods_fit, target_facts
from specheads.evaluation.metrics import Run, by_domain, gpu_speedup, speedup_paired, speedup_spread, timed
from specheads.evaluation.passes import (Kernels, exact_pass, first_divergence, lossless_verdict, prepare_kernels,
                                         proof_scope, reference_decode, timed_reference_decode)
from specheads.evaluation.prompts import (BenchmarkSpec, encode, load_benchmarks, read_prompt_images, scored_chat_ids,
                                         separation_record)
from specheads.evaluation.recommend import recommend
from specheads.evaluation.resume import EvalResume, EvalState, decisions, evaluation_key
from specheads.evaluation.settings import check_eval_config
from specheads.evaluation import shape_choice
from specheads.evaluation.spec import MethodSpec
from specheads.hardware import machine_description
from specheads.heads import head_source
from specheads.targets import Target, eos_token_ids
from specheads.targets.model import text_sizes_on_config

# Moved out of this file; still importable from it (recipes, tests and scripts import them from the evaluator).
from specheads.evaluation.plan import ServingProfiles, plan_methods  # noqa: E402,F401
from specheads.evaluation.spec import DRAFTERS, HEAD_MODEL_TYPES, HEADS, chain_spec, draft_rows  # noqa: E402,F401
from specheads.heads import (check_head_kind, dflash_block_size, head_model_type, resolve_head_dir,  # noqa: E402,F401
                             verifier_for)

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    methods: list[MethodSpec]
    benchmarks: BenchmarkSpec = field(default_factory=BenchmarkSpec)
    max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    batch_sizes: tuple[int, ...] = (1, 4)
    batch_prompts: int = 8  # prompts decoded per batch-size measurement
    seed: int = 0
    recommend_ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8)
    repeats: int = 3  # timed batch-1 decode passes per speed figure (plain and speculative), after a warm-up
    exact_forward: str = "auto"  # the exact pass (passes.py) in batch-invariant forwards: auto (CPU) | on | off
    cpu_linears: str = "auto"  # oneDNN-prepacked CPU linear layers (specheads.decoding.cpu_linears): auto | packed | plain
    cpu_threads: str | int = "auto"  # decoding's CPU threads (specheads.decoding.cpu_threads): auto (measured) | n
    max_minutes: float | None = None  # a time budget: every domain first, then rows, temperatures, prompts (``fit_budget``)
    paired: bool = True  # time a plain decode of each prompt right before its speculative one (see above)
    grouped_attention: bool = True  # GQA targets on SDPA: fold the heads instead of copying the KV cache (grouped_attention.py)
    chat_template_kwargs: dict = field(default_factory=dict)  # the template's switches (enable_thinking), as served

    def __post_init__(self):
        check_eval_config(self)  # a ConfigError naming the setting, before anything loads
        self.temperatures = tuple(float(T) for T in self.temperatures)  # report keys "0.0", as serve-eval reads


Progress = Callable[[str], None]


def evaluate(target: Target, cfg: EvalConfig, progress: Progress | None = None,
             checkpoint: Callable[[dict], None] | None = None,
             resized: Callable[[int], None] | None = None, head_settings: dict[str, str] | None = None,
             resume: EvalResume | None = None) -> dict:
    """The whole evaluation; returns the report dict (see ``report.py``). ``checkpoint(report)`` is
    called with the report so far after each part of each method (never before the first method's first row:
    an evaluation that stops in its set-up, plain pass or first drafter leaves an earlier report in place);
    ``resized(steps)`` when a time budget (``cfg.max_minutes``, ``fit_budget``) leaves ``steps`` progress
    reports to make (the bar's total). Each head and the early-exit baseline are checked against the target's
    sizes first (``inputs.check_methods_fit``; ``head_settings``: {head folder: the setting that named it}).
    ``resume``: keep the plain pass and each finished method there, and take up what an interrupted evaluation of
    the same settings, target and heads left (``resume.py``). A vision-language target's held-out image prompts are
    decoded with their images (``evaluation.prompts.read_prompt_images``, ``decoding.vision_prompts``)."""
    with text_sizes_on_config(target.model):  # the set-up reads a multimodal target's vocabulary on its config
        return _evaluate(target, cfg, progress, checkpoint, resized, head_settings, resume)


def _evaluate(target: Target, cfg: EvalConfig, progress: Progress | None, checkpoint, resized, head_settings,
              resume: EvalResume | None) -> dict:
    """``evaluate``'s body."""
    check_methods_fit(cfg.methods, target_facts(target), head_settings)
    # before an automatic shape is set; the target's dtype is part of it (the measured choices below depend on it)
    key = evaluation_key(cfg, target) if resume is not None else None
    state = resume.load(key) if resume is not None else None
    started = time.perf_counter()
    progress = progress or (lambda msg: None)
    checkpoint = checkpoint or (lambda r: None)
    prompts = load_benchmarks(cfg.benchmarks)
    read_prompt_images(prompts, target)  # an image prompt's pixels, read with the target's image processor
    eos = eos_token_ids(target)
    kernels, measured = _settle_decoding(target, cfg, prompts, state.report if state is not None else {})
    runner = TargetRunner(target.model)
    if state is not None and decisions(state.report) != decisions(measured):
        log.warning("this machine now decodes the target otherwise than the interrupted evaluation did (%s vs %s): "
                    "the evaluation starts over", decisions(measured), decisions(state.report))
        state = None
    if state is None:
        state = _plain_state(target, runner, kernels, prompts, cfg, eos, progress, resized, key, measured, started)
    else:
        state.report.setdefault("resumed", []).append(
            {"methods_taken_up": [r["name"] for r in state.report["methods"]]})
        log.info("taking up an interrupted evaluation: the plain pass and %d of %d methods are done (%s)",
                 state.done, len(cfg.methods), resume.path)
    if resume is not None:
        resume.save(state)
    prompts = state.plan.prompts
    plain_tokens = {p.id: r for p, r in zip(prompts, state.ids["fast_tokens"])}  # the fast pass's plain output
    for i, (spec, temps, sizes) in enumerate(zip(cfg.methods, state.plan.temperatures, state.plan.batch_sizes)):
        if i < state.done or not temps:  # done before an interruption; left out for time (the budget's record)
            continue
        _method_row(spec, temps, sizes, state, target, runner, kernels, prompts, plain_tokens, cfg, eos, progress,
                    checkpoint)
        state.done = i + 1
        if resume is not None:
            resume.save(state)
    state.report["recommendation"] = recommend(state.report, cfg.recommend_ks)
    return state.report


def _settle_decoding(target: Target, cfg: EvalConfig, prompts, taken: dict) -> tuple[Kernels, dict]:
    """The fast and exact passes' kernels, set to the fast pass, and the choices measured for them (an interrupted
    evaluation's report ``taken``: its measured choices, applied as they were)."""
    # before any forward: the fast pass's attention, then the exact pass's (both passes, plain and speculative)
    kernels, exact = prepare_kernels(target.model, cfg.exact_forward, cfg.grouped_attention)
    # an interrupted evaluation's measured choices are applied as they were (timings on a busy machine could
    # choose otherwise now, and its finished rows were decoded under them); the proof runs all the same
    linears_mode = (taken.get("cpu_linears") or {}).get("linears") or cfg.cpu_linears
    if linears_mode == "auto":
        log.info("timing the target's linear layers packed and plain")  # a phase, not a step of the bar
    with kernels.fast():  # timed as the fast pass decodes: the baseline never gets the slower layout
        linears = choose_cpu_linears(target.model, linears_mode)
        threads = choose_cpu_threads(target.model, (taken.get("cpu_threads") or {}).get("threads") or cfg.cpu_threads)
    # the exact pass's row floor and proof, float32 where unproven (both passes then decode in float32)
    exact.update(settle_exact(target.model, cfg.cpu_linears, given=taken.get("exact_forward"),
                              scope=proof_scope(cfg, prompts, target)))
    if exact.get("fallback"):
        linears = exact["fallback"]["cpu_linears"]
    kernels.use_fast()  # every decode from here on, but the exact pass's (``kernels.exact()``)
    measured = {"exact_forward": exact, "cpu_linears": linears, "cpu_threads": threads,
                "target_dtype": str(target.dtype), "passes": kernels.record()}
    return kernels, measured


def _plain_state(target: Target, runner, kernels: Kernels, prompts, cfg: EvalConfig, eos, progress: Progress,
                 resized: Callable[[int], None] | None, key, measured: dict, started: float) -> EvalState:
    """A fresh evaluation's state: its plan (the whole of it, or what fits the time budget), the plain passes and
    the report's opening, no method done yet."""
    if cfg.max_minutes is None:
        plan = full_plan(prompts, cfg.methods, cfg.temperatures, cfg.batch_sizes)
    else:
        plan = fit_budget(prompts, target, runner, kernels, cfg, eos, time.perf_counter() - started)
    if resized is not None:  # the bar's total, the exact pass's decodes counted
        resized(plan.steps(cfg.methods, cfg.repeats, cfg.paired, cfg.batch_prompts, kernels.exact_pass))
    prompts = plan.prompts
    t0 = time.perf_counter()
    ids, plain = _plain_pass(target, runner, kernels, prompts, cfg, eos, progress)
    plain = _plain_passes(runner, prompts, ids, plain, cfg, eos, progress, plan.plain_temperatures())
    plain_seconds = time.perf_counter() - t0
    report = {"target": target.name, "num_prompts": len(prompts), "prompt_ids": [p.id for p in prompts],
              "max_new_tokens": cfg.max_new_tokens,
              "temperatures": list(cfg.temperatures), "target_params": _nparams(target.model),
              "repeats": cfg.repeats, "paired": cfg.paired, "plain": _timed_rows(plain[0.0]),
              "plain_by_temperature": {str(T): _timed_rows(passes) for T, passes in plain.items()},
              "plain_seconds": plain_seconds, **measured,
              "target_dtype_choice": target.dtype_choice.record() if getattr(target, "dtype_choice", None)
              else None,
              "machine": machine_description(target.device),
              "data_separation": separation_record(cfg.benchmarks, prompts),
              "budget": plan.record, "methods": []}
    chosen: dict[tuple[str, str | None], dict] = {}  # one shape per head (with or without a lookup branch)
    return EvalState(key, plan, ids, plain, report, chosen, done=0)


def _method_row(spec: MethodSpec, temps, sizes, state: EvalState, target: Target, runner, kernels: Kernels, prompts,
                plain_tokens: dict, cfg: EvalConfig, eos, progress: Progress,
                checkpoint: Callable[[dict], None]) -> None:
    """Evaluate one method (its automatic shape chosen first, once per head) and put its row in the report,
    checkpointing the report after each part."""
    report, chosen = state.report, state.chosen
    if spec.auto_shape:
        key = (spec.drafter, spec.head_dir)
        if key not in chosen:
            chosen[key] = _choose_shape(spec, target, runner, state.ids, eos, progress, prompts)
        spec.shape = _chosen_shape(chosen[key])
        report.setdefault("shape_choice", {})[spec.name] = chosen[key]
    drafter = build_drafter(spec, target, prompts, state.ids, cfg)
    def partial(row, done=len(report["methods"])):
        row["train_tau"] = shape_choice.train_tau(spec.head_dir)
        if spec.head_dir:
            row["head_source"] = head_source(spec.head_dir)
        if spec.tree_source:
            row["tree_source"] = spec.tree_source
        report["methods"][done:] = [row]
        report["recommendation"] = recommend(report, cfg.recommend_ks)
        checkpoint(report)

    partial(_eval_method(spec, drafter, target, runner, kernels, prompts, state.ids, state.plain, plain_tokens, cfg,
                         eos, progress, partial, temps, sizes))


def fit_budget(prompts: list[EvalPrompt], target: Target, runner, kernels: Kernels, cfg: EvalConfig, eos,
               spent_s: float) -> EvalPlan:
    """The plan that fits ``cfg.max_minutes`` (``budget.plan_budget``: every domain for the head's row and the
    n-gram baseline at T = 0 first, then the other rows, temperatures, prompts and batch sizes), priced from one
    timed plain decode of the first prompt in the fast pass (and one in the exact pass, which prices its decodes)
    after ``spent_s`` seconds of set-up; its record goes in the report."""
    first = next(p for p in prompts if p.turn == 0)
    pid = encode(first, target.tokenizer, {}, cfg.chat_template_kwargs)
    _warm_up(runner, None, pid, cfg, eos)
    t = time.perf_counter()
    speculative_generate(runner, None, [pid], cfg.max_new_tokens, 0.0, "greedy", eos)
    decode = time.perf_counter() - t
    exact_s = timed_reference_decode(kernels, runner, pid, cfg.max_new_tokens, eos)
    plan = plan_budget(prompts, cfg.methods, cfg.temperatures, cfg.batch_sizes, budget_s=cfg.max_minutes * 60 - spent_s,
                       decode_s=decode, repeats=cfg.repeats, paired=cfg.paired, batch_prompts=cfg.batch_prompts,
                       max_new_tokens=cfg.max_new_tokens, exact_cost=exact_s / decode if exact_s else 0.0)
    rec = plan.record
    rec.update(max_minutes=cfg.max_minutes, decode_s=round(decode, 2), estimate_s=round(spent_s + rec["plan_s"], 1),
               exact_decode_s=None if exact_s is None else round(exact_s, 2))
    left = rec["left_out"]
    log.info("evaluation budget %g min: %d of %d prompts, %d of %d rows, %d left out at some temperature (a %d-token "
             "plain decode took %.1f s here; about %.0f s in all)", cfg.max_minutes, len(plan.prompts), len(prompts),
             sum(1 for t in plan.temperatures if t), len(cfg.methods), len(left["rows"]), cfg.max_new_tokens, decode,
             rec["estimate_s"])
    if rec["over_budget"]:
        log.warning("evaluation budget %g min: one prompt of each domain for %s at T=%g alone takes about %.0f s; "
                    "evaluating that much anyway", cfg.max_minutes, ", ".join(rec["core"]["methods"]),
                    rec["core"]["temperature"], rec["estimate_s"])
    return plan


def _chosen_shape(choice: dict) -> TreeShape:
    return TreeShape("chain", k=choice["k"]) if choice["kind"] == "chain" else TreeShape.fan(choice["k"])


def _choose_shape(spec, target, runner, ids, eos, progress, prompts=()) -> dict:
    """The chain or fan the verify cost curve of this machine and the head's acceptance, measured on
    training-side held-out prompts, favour (``shape_choice``), with what it measured. Timing only runs
    on an evaluation prompt; no acceptance figure comes from one: the head's held-out split must leave
    out the evaluator's chat slice and share no chat with ``prompts`` (``check_heldout_split``)."""
    reach, fans = shape_choice.measured_reach(spec.head_dir), shape_choice.measured_fans(spec.head_dir)
    if not reach:
        raise UserError(f"{spec.name}: head_shape=auto needs the head's measured acceptance per draft depth "
                        f"(measured_reach1.. in the train_summary.json of {spec.head_dir}, written when training "
                        "ran with train.measure_prompts > 0); retrain with it, or set head_shape=tree")
    split = shape_choice.check_heldout_split(spec.name, spec.head_dir, scored_chat_ids(list(prompts)))
    prompt = ids["prompt_ids"][0]
    n_max = max([len(reach) + 1] + [w + 1 for w in fans])
    progress(f"{spec.name}: measuring the verify cost of 1..{n_max} tokens")
    # medians of 12 interleaved rounds, in units of plain decoding's one-token forward (the speed-ups' baseline)
    curve, plain_s = shape_choice.verify_costs(runner, prompt, list(range(1, n_max + 1)), reps=12)
    probe = build_drafter(replace(spec, shape=TreeShape("chain", k=1), auto_shape=False, ngram_branch=0,
                                  ngram_extend=0, ngram_table=None), target)
    # Draft time per forward without the prompt's one-off feed: a long decode minus a 1-token one.
    speculative_generate(runner, probe, [prompt], 8, 0.0, "greedy", eos)  # warm-up
    short = speculative_generate(runner, probe, [prompt], 1, 0.0, "greedy", eos)
    long = speculative_generate(runner, probe, [prompt], 49, 0.0, "greedy", eos)
    extra = long.stats[0].draft_forwards - short.stats[0].draft_forwards
    per_forward = (long.draft_time - short.draft_time) / max(extra, 1)
    choice = shape_choice.choose_shape(reach, curve, max(per_forward, 0.0) / plain_s, fans, plain_s=plain_s)
    choice["heldout_split"] = split
    log.info("%s: %s chosen (predicted speed-up %s)", spec.name, choice["label"],
             ", ".join(f"{p['label']}: {p['speedup']:.2f}" for p in choice["predictions"]))
    return choice


def _plain_pass(target, runner, kernels: Kernels, prompts, cfg, eos, progress):
    """Plain greedy decoding of every prompt (turn 1 before turn 2): in the exact pass (the lossless reference, whose
    turn-1 answers the turn-2 prompts carry), then in the fast pass (timed). Returns {"prompt_ids", "tokens" (the
    reference: the fast pass's own without an exact pass), "fast_tokens"} and the fast decodes' Runs."""
    answers: dict[str, str] = {}
    rows = {}
    for i, p in enumerate(sorted(prompts, key=lambda p: p.turn)):
        pid = encode(p, target.tokenizer, answers, cfg.chat_template_kwargs)
        ref = reference_decode(kernels, runner, pid, cfg.max_new_tokens, eos)
        if ref is not None:
            progress(f"plain exact pass {i + 1}/{len(prompts)}")
        if i == 0:
            _warm_up(runner, None, pid, cfg, eos)
        res = speculative_generate(runner, None, [pid], cfg.max_new_tokens, 0.0, "greedy", eos)
        ref = res.tokens[0] if ref is None else ref
        answers[p.id] = target.tokenizer.decode(ref, skip_special_tokens=True) if target.tokenizer else ""
        rows[p.id] = (pid, ref, res.tokens[0], _run(p, res))
        progress(f"plain {i + 1}/{len(prompts)}")
    pids, refs, fast, runs = zip(*(rows[p.id] for p in prompts))
    return {"prompt_ids": list(pids), "tokens": list(refs), "fast_tokens": list(fast)}, list(runs)


def _warm_up(runner, drafter, prompt_ids, cfg, eos) -> None:
    """One short untimed decode (first calls pay for allocations, lazy set-up, kernel compilation)."""
    speculative_generate(runner, drafter, [prompt_ids], min(8, cfg.max_new_tokens), 0.0, "greedy", eos)


def _timing_pass(runner, drafter, prompts, ids, cfg, T, verify, eos) -> list[Run]:
    """One timed batch-1 decode of every prompt at temperature ``T`` (seeded like the first pass)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    return [_run(p, speculative_generate(runner, drafter, [pid], cfg.max_new_tokens, T, verify, eos, gen))
            for p, pid in zip(prompts, ids["prompt_ids"])]


def _plain_verify(T: float) -> str:
    """The verify rule plain decoding runs under (no drafts: it only picks or samples the next token)."""
    return "greedy" if T <= 0 else "tree"


def _plain_run(runner, p: EvalPrompt, pid, cfg, T, eos, gen) -> Run:
    """One timed plain decode of one prompt (the paired half of a speculative decode, in the same fast kernels)."""
    return _run(p, speculative_generate(runner, None, [pid], cfg.max_new_tokens, T, _plain_verify(T), eos, gen))


def _paired_timing_pass(runner, drafter, prompts, ids, cfg, T, verify, eos) -> tuple[list[Run], list[Run]]:
    """One timed pass where each prompt is decoded plainly, then speculatively (seeded like the first
    pass); returns (speculative runs, plain runs)."""
    gen, plain_gen = torch.Generator().manual_seed(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    spec_runs, plain_runs = [], []
    for p, pid in zip(prompts, ids["prompt_ids"]):
        plain_runs.append(_plain_run(runner, p, pid, cfg, T, eos, plain_gen))
        spec_runs.append(_run(p, speculative_generate(runner, drafter, [pid], cfg.max_new_tokens, T, verify, eos, gen)))
    return spec_runs, plain_runs


def _plain_passes(runner, prompts, ids, first, cfg, eos, progress, temperatures) -> dict[float, list[dict]]:
    """{T: [by_domain summaries of each timed plain pass]}: ``repeats`` passes at each of ``temperatures``
    (the greedy pass that made the answers is the first at T = 0)."""
    out = {}
    wanted = 1 if cfg.paired else max(cfg.repeats, 1)  # paired: each method times its own plain decodes
    for T in temperatures:
        passes = [by_domain(first)] if T == 0 else []
        while len(passes) < wanted:
            passes.append(by_domain(_timing_pass(runner, None, prompts, ids, cfg, T, _plain_verify(T), eos)))
            progress(f"plain T={T} pass {len(passes)}/{wanted}")
        out[T] = passes
    return out


def _timed_rows(passes: list[dict]) -> dict:
    """{domain: row} of the first pass, its speed replaced by the median over passes (with range)."""
    return {d: {**s.to_dict(), **timed([p[d] for p in passes])} for d, s in passes[0].items()}


def _run(p: EvalPrompt, res: GenerationResult, b: int = 0) -> Run:
    return Run(p.id, p.domain, res.stats[b], len(res.tokens[b]), res.wall_time - res.prefill_time,
               res.target_time, res.draft_time, res.verify_time)


def _eval_method(spec, drafter, target, runner, kernels, prompts, ids, plain, plain_tokens, cfg, eos, progress,
                 partial=lambda row: None, temperatures=None, batch_sizes=None) -> dict:
    """One method at each of ``temperatures`` (default: ``cfg``'s), then batches of ``batch_sizes`` (default:
    ``cfg``'s), in the fast pass, and its exact pass after T = 0 (``passes.py``); ``partial(row)`` after each part.
    plain: {T: [by_domain summaries of each timed plain pass]} (``_plain_passes``); plain_tokens: {prompt id: the
    fast pass's plain greedy output}."""
    temperatures = cfg.temperatures if temperatures is None else temperatures
    out = {"name": spec.name, "drafter": spec.drafter, "shape": spec.shape_label(), "verify": spec.verify,
           "lossless_verify": LOSSLESS.get(spec.verify, True), "profile": spec.profile,
           "ngram_branch": spec.ngram_branch, "draft_params_per_forward": drafter.params_per_forward, "by_temperature": {}}
    if spec.ngram_extend:  # only with a branch (MethodSpec): the drafter is a PromptLookupBranch
        table = drafter.table
        out["ngram_extend"] = {"first_drafts": spec.ngram_extend, "tokens": spec.ngram_extend_len,
                               "table": spec.ngram_table, "table_ngrams": len(table) if table is not None else 0}
    c_gpu = drafter.params_per_forward / _nparams(target.model)
    out["c_gpu"] = c_gpu
    t_start = time.perf_counter()
    _warm_up(runner, drafter, ids["prompt_ids"][0], cfg, eos)
    for T in temperatures:
        gen, plain_gen = torch.Generator().manual_seed(cfg.seed), torch.Generator().manual_seed(cfg.seed)
        runs, plain_runs, mism = [], [], []
        for i, (p, pid) in enumerate(zip(prompts, ids["prompt_ids"])):
            if cfg.paired:
                plain_runs.append(_plain_run(runner, p, pid, cfg, T, eos, plain_gen))
            res = speculative_generate(runner, drafter, [pid], cfg.max_new_tokens, T, spec.verify, eos, gen)
            runs.append(_run(p, res))
            if T == 0:  # the fast pass's own comparison (numerical divergence where the exact pass agrees)
                m = first_divergence(target, pid, plain_tokens[p.id], res.tokens[0])
                if m:
                    mism.append({"prompt": p.id, **m})
            progress(f"{spec.name} T={T} {i + 1}/{len(prompts)}")
        passes = [by_domain(runs)]  # acceptance from the first pass; the others only time the decode
        plain_passes = [by_domain(plain_runs)] if cfg.paired else plain[T]
        while len(passes) < max(cfg.repeats, 1):
            if cfg.paired:
                s_runs, p_runs = _paired_timing_pass(runner, drafter, prompts, ids, cfg, T, spec.verify, eos)
                passes.append(by_domain(s_runs)); plain_passes.append(by_domain(p_runs))
            else:
                passes.append(by_domain(_timing_pass(runner, drafter, prompts, ids, cfg, T, spec.verify, eos)))
            progress(f"{spec.name} T={T} timing pass {len(passes)}/{cfg.repeats}")
        ratio = speedup_paired if cfg.paired else speedup_spread
        doms = {}
        for d, s in passes[0].items():
            row = {**s.to_dict(), **timed([p[d] for p in passes]),
                   **ratio([p[d] for p in plain_passes], [p[d] for p in passes])}
            if cfg.paired:
                row["paired_plain_tokens_per_s"] = timed([p[d] for p in plain_passes])["tokens_per_s"]
            row["gpu_speedup_pred"] = gpu_speedup(s.tau, c_gpu, s.draft_forwards_per_step)
            doms[d] = row
        out["by_temperature"][str(T)] = doms
        if T == 0:
            failed = exact_pass(kernels, target, runner, drafter, prompts, ids, cfg.max_new_tokens, spec.verify, eos,
                                progress, spec.name) if kernels.exact_pass else []
            out["lossless"] = lossless_verdict(kernels, len(prompts), mism, failed)
        out["eval_seconds"] = time.perf_counter() - t_start
        partial(out)
    out["batch"] = _batch_speed(spec, drafter, runner, ids, plain_tokens, prompts, cfg, eos, progress,
                                cfg.batch_sizes if batch_sizes is None else batch_sizes)
    out["eval_seconds"] = time.perf_counter() - t_start
    return out


def _batch_speed(spec, drafter, runner, ids, plain_tokens, prompts, cfg, eos, progress, batch_sizes) -> dict:
    """Greedy plain vs speculative wall clock at each batch size > 1 (one target forward per step)."""
    out = {}
    pids = ids["prompt_ids"][: cfg.batch_prompts]
    for bs in batch_sizes:
        if bs <= 1:
            continue
        t_plain = t_spec = 0.0
        n_plain = n_spec = fw = steps = 0
        exact = True
        for start in range(0, len(pids), bs):
            chunk = pids[start:start + bs]
            # Batches verify in one call per step (the fused kernel on a GPU, the batched reference here).
            a = speculative_generate(runner, None, chunk, cfg.max_new_tokens, 0.0, "greedy", eos,
                                     verify_backend="auto")
            b = speculative_generate(runner, drafter, chunk, cfg.max_new_tokens, 0.0, "greedy", eos,
                                     verify_backend="auto")
            t_plain += a.wall_time - a.prefill_time; t_spec += b.wall_time - b.prefill_time
            n_plain += sum(map(len, a.tokens)); n_spec += sum(map(len, b.tokens))
            fw += b.target_forwards; steps += len(b.batch_forward_sizes)
            exact &= a.tokens == b.tokens and all(
                t == plain_tokens[prompts[start + j].id] for j, t in enumerate(a.tokens))
            progress(f"{spec.name} batch {bs}: {min(start + bs, len(pids))}/{len(pids)}")
        out[str(bs)] = {"plain_tokens_per_s": n_plain / t_plain, "spec_tokens_per_s": n_spec / t_spec,
                        "speedup": (n_spec / t_spec) / (n_plain / t_plain), "target_forwards_per_step": fw / steps,
                        "matches_batch1_plain": exact}
    return out


# ------------------------------------------------------------------ drafters


def build_drafter(spec: MethodSpec, target: Target, prompts=None, ids=None, cfg: EvalConfig | None = None) -> Drafter:
    """The drafter a method spec names (heads loaded from ``head_dir``), with its prompt-lookup branch."""
    drafter = make_drafter(spec, target, cfg.seed if cfg else 0)
    if spec.ngram_branch:
        table = None
        if spec.ngram_table:
            skip = scored_chat_ids(prompts or [])  # every sample of a scored chat, not only the scored one
            table = load_ngram_table(spec.ngram_table, target, exclude_ids=skip, max_tokens=spec.ngram_table_tokens)
            log.info("%s: n-gram table of %d n-grams from %s (%d evaluation chats left out)", spec.name,
                     len(table), spec.ngram_table, len(skip))
        return PromptLookupBranch(drafter, spec.ngram_branch, spec.ngram_max, table=table,
                                  extend=spec.ngram_extend, extend_len=spec.ngram_extend_len)
    return drafter


def _nparams(model) -> int:
    return sum(p.numel() for p in model.parameters())
