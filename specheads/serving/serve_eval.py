"""Measure an exported head in a real serving engine: the evaluation prompts decoded plainly and speculatively
(greedy, batch 1), the engine's own speculative-decoding counters differenced per prompt, per domain and overall,
beside the project's evaluator figure for the same chain when its report is given.

    decoders = Decoders(plain=..., spec=...)              # each: generate(prompt_ids, max_tokens) -> Decoded
    runs = decode_prompts(prompts, tokenizer, decoders, max_new_tokens)
    report = build_report(runs, k, context, eval_report=read_eval_report(path))
    write_report(report, out_dir)                         # serve_report.json + serve_report.md, atomically

The figures (``specheads.acceptance_math.counter_figures``): τ = 1 + accepted ÷ drafts (tokens per drafting
step, vLLM's own figure); tokens per target forward = (new tokens − 1) ÷ drafts at batch 1 (the prefill gives the
first token, each later step is one verify forward); α = accepted ÷ tested (the evaluator's); per-position
acceptance = accepted at position j ÷ drafts; decode tokens/s = (new tokens − 1) ÷ the engine's
first-to-last-token time.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from specheads import acceptance_math as am
from specheads.errors import UserError
from specheads.data.benchmarks import EvalPrompt
from specheads.evaluation.prompts import encode
from specheads.serving.counters import EngineCounters

FORMAT = "specheads.serve_eval/1"
Z = 3.0  # a difference is flagged beyond Z standard errors of the difference


@dataclass
class Decoded:
    """One greedy decode of one prompt: its new tokens and text, wall seconds and what the engine counted."""

    token_ids: list[int]
    text: str
    seconds: float
    counters: EngineCounters


class Decoder(Protocol):
    def generate(self, prompt_ids: list[int], max_tokens: int) -> Decoded: ...


@dataclass
class PromptRun:
    id: str
    domain: str
    prompt_tokens: int
    plain: Decoded | None
    spec: Decoded


def decode_prompts(prompts: list[EvalPrompt], tokenizer, spec: Decoder, max_new_tokens: int,
                   plain: Decoder | None = None, template_kwargs: dict | None = None,
                   progress: Callable[[str], None] = lambda msg: None) -> list[PromptRun]:
    """Every prompt decoded plainly, then speculatively, one at a time (turn 1 before turn 2, whose prompt holds
    the plain answer to turn 1, as the evaluator builds it; without a plain decoder, the speculative one's)."""
    answers: dict[str, str] = {}
    runs = []
    order = {p.id: i for i, p in enumerate(prompts)}
    for i, p in enumerate(sorted(prompts, key=lambda p: p.turn)):
        ids = encode(p, tokenizer, answers, template_kwargs)
        base = plain.generate(ids, max_new_tokens) if plain is not None else None
        fast = spec.generate(ids, max_new_tokens)
        answers[p.id] = tokenizer.decode((base or fast).token_ids, skip_special_tokens=True)
        runs.append(PromptRun(p.id, p.domain, len(ids), base, fast))
        progress(f"{i + 1}/{len(prompts)} {p.id}: " + (f"plain {len(base.token_ids)} tokens, " if base else "")
                 + f"speculative {len(fast.token_ids)} tokens, {fast.counters.accepted} drafts accepted")
    return sorted(runs, key=lambda r: order[r.id])


# ------------------------------------------------------------------ figures

def decode_rate(counters: EngineCounters) -> float | None:
    """Decode tokens/s (the first token, the prefill's, left out) from the engine's first-to-last-token time."""
    tokens = counters.generation_tokens - counters.requests
    return tokens / counters.decode_seconds if counters.decode_seconds > 0 and tokens > 0 else None


def spec_figures(counters: EngineCounters, k: int) -> dict:
    """The engine's figures for a set of speculative decodes (``acceptance_math.counter_figures``), with
    tokens per target forward, decode tokens/s and τ's standard error."""
    pos = (counters.accepted_per_pos + [0] * k)[:k] if k else counters.accepted_per_pos
    fig = am.counter_figures(counters.drafts, counters.draft_tokens, counters.accepted, pos)
    decode_tokens = counters.generation_tokens - counters.requests
    fig.update(tokens_per_forward=decode_tokens / counters.drafts if counters.drafts else None,
               new_tokens=counters.generation_tokens, decode_s=counters.decode_seconds,
               tokens_per_s=decode_rate(counters),
               tau_se=am.tau_standard_error(fig["reach"], counters.drafts) if counters.drafts else None)
    return fig


def plain_figures(counters: EngineCounters) -> dict:
    return {"new_tokens": counters.generation_tokens, "decode_s": counters.decode_seconds,
            "tokens_per_s": decode_rate(counters)}


def group_figures(runs: list[PromptRun], k: int) -> dict:
    """Figures of a group of prompts (a domain, or all)."""
    spec = sum((r.spec.counters for r in runs), EngineCounters())
    out = {"prompts": len(runs), "spec": spec_figures(spec, k)}
    with_plain = [r for r in runs if r.plain is not None]
    if with_plain:
        plain = sum((r.plain.counters for r in with_plain), EngineCounters())
        out["plain"] = plain_figures(plain)
        rate_p, rate_s = out["plain"]["tokens_per_s"], out["spec"]["tokens_per_s"]
        out["speedup"] = rate_s / rate_p if rate_p and rate_s else None
        ratios = [s / p for r in with_plain
                  if (p := decode_rate(r.plain.counters)) and (s := decode_rate(r.spec.counters))]
        out["speedup_median_per_prompt"] = statistics.median(ratios) if ratios else None
        out["identical"] = sum(r.plain.token_ids == r.spec.token_ids for r in with_plain)
        out["compared"] = len(with_plain)
    return out


def by_domain(runs: list[PromptRun], k: int) -> dict[str, dict]:
    """``{domain: figures}`` in sorted order, then ``all``."""
    domains = sorted({r.domain for r in runs})
    out = {d: group_figures([r for r in runs if r.domain == d], k) for d in domains}
    out["all"] = group_figures(runs, k)
    return out


# ------------------------------------------------------------------ the evaluator's figure for the same chain

def read_eval_report(path: str | Path) -> dict:
    """An evaluation report (``report.json`` of ``specheads evaluate``); a ``UserError`` naming the problem."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise UserError(f"eval_report={path}: no such file; give the report.json `specheads evaluate` wrote "
                        "(e.g. runs/quickstart/eval/eagle3/report.json)")
    try:
        report = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"eval_report={path} is not readable JSON ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("methods"), list):
        raise UserError(f"eval_report={path} is no evaluation report (no 'methods' list)")
    return report


def report_prompts(prompts: list[EvalPrompt], report: dict, where: str) -> list[EvalPrompt] | None:
    """The prompts the evaluation report scored (its ``prompt_ids``), in the set's order: the engine decodes the
    same ones. None when the report does not list them (written before it did); a ``UserError`` naming the ids
    this prompt set lacks (other ``eval.*`` settings than the evaluation's)."""
    ids = report.get("prompt_ids")
    if ids is None:
        return None
    loaded = {p.id for p in prompts}
    missing = [i for i in ids if i not in loaded]
    if missing:
        raise UserError(f"eval_report={where} scored {len(missing)} prompt(s) these eval.* settings do not load "
                        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): give the evaluation's eval.* "
                        "settings, or same_prompts=false to decode this set")
    wanted = set(ids)
    return [p for p in prompts if p.id in wanted]


def chain_length(setting, eval_report: dict | None, drafter: str | None) -> tuple[int, str]:
    """The chain the engine drafts, and why: ``setting`` when it is a number; ``auto``: the chain the evaluation's
    automatic shape choice predicts fastest for this drafter (from the verify-cost curve of the machine it measured
    and the head's held-out acceptance per depth: on a CPU a verify of k + 1 tokens costs more than one plain
    forward, so a shorter chain than vLLM's profile often wins), else vLLM's profile (the evaluator's
    ``ServingProfiles.vllm_num_speculative_tokens``)."""
    from specheads.evaluation.plan import ServingProfiles

    if str(setting) != "auto":
        return int(setting), "num_speculative_tokens as given"
    choices = (eval_report or {}).get("shape_choice") or {}
    for m in (eval_report or {}).get("methods", []):
        chains = [p for p in (choices.get(m.get("name")) or {}).get("predictions", []) if p.get("kind") == "chain"]
        if m.get("drafter") == drafter and chains:
            best = max(chains, key=lambda p: p["speedup"])
            predicted = ", ".join(f"{p['label']} {p['speedup']:.2f}x" for p in chains)
            return int(best["k"]), (f"num_speculative_tokens=auto: the chain the evaluation's shape choice predicts "
                                    f"fastest on the machine it measured ({predicted}; its `{m['name']}`)")
    why = (f"the evaluation report predicts no chain for a {drafter} head" if eval_report is not None else
           "no evaluation report to choose from")
    return ServingProfiles.vllm_num_speculative_tokens, f"num_speculative_tokens=auto: vLLM's serving profile ({why})"


def chain_method(report: dict, drafter: str, k: int) -> dict | None:
    """The report's method that drafts a greedy chain of at least ``k`` with ``drafter`` (no n-gram branch),
    vLLM's serving profile first, then the shortest such chain; None when it measured none."""
    found = []
    for m in report["methods"]:
        shape = str(m.get("shape", ""))
        if (m.get("drafter") == drafter and shape.startswith("chain") and shape[5:].isdigit()
                and int(shape[5:]) >= k and not m.get("ngram_branch") and "0.0" in (m.get("by_temperature") or {})):
            found.append((m.get("profile") != "vllm", int(shape[5:]), m))
    return min(found, key=lambda x: x[:2])[2] if found else None


def compare(engine: dict[str, dict], method: dict, k: int, z: float = Z) -> dict:
    """Per domain (those both measured): τ and per-position acceptance of the engine beside the evaluator's for a
    chain of ``k`` (a longer measured chain cut to k: at greedy its first k positions are the chain of k), each
    difference flagged when beyond ``z`` standard errors of the difference (binomial per position; τ's from each
    side's accepted-length distribution, steps taken as independent)."""
    rows = {}
    measured = method["by_temperature"]["0.0"]
    for domain, fig in engine.items():
        ev = measured.get(domain)
        spec = fig["spec"]
        if not ev or not ev.get("target_forwards") or not spec["drafts"]:
            continue
        steps = int(ev["target_forwards"])
        reach_e = [a / steps for a in (list(ev["accepted"]) + [0] * k)[:k]]
        tau_e = am.chain_tau(reach_e, "joint")
        se_e = am.tau_standard_error(reach_e, steps)
        positions = []
        for j in range(k):
            pe, pv = reach_e[j], spec["reach"][j]
            se_pe, se_pv = am.proportion_standard_error(pe, steps), am.proportion_standard_error(pv, spec["drafts"])
            positions.append({"evaluator": pe, "engine": pv, "difference": pv - pe,
                              "se": math.hypot(se_pe, se_pv), "flagged": am.beyond_noise(pv, se_pv, pe, se_pe, z)})
        rows[domain] = {"evaluator_steps": steps, "engine_drafts": spec["drafts"], "tau_evaluator": tau_e,
                        "tau_engine": spec["tau"], "tau_difference": spec["tau"] - tau_e,
                        "tau_se": math.hypot(se_e, spec["tau_se"]),
                        "tau_flagged": am.beyond_noise(spec["tau"], spec["tau_se"], tau_e, se_e, z),
                        "positions": positions}
    return {"method": method.get("name"), "shape": method.get("shape"), "k": k, "z": z, "domains": rows,
            "noise": (f"a difference is flagged beyond {z:g} standard errors of the difference: per position the "
                      "binomial error of each side's proportion (accepted at j ÷ drafting steps), for τ each side's "
                      "accepted-length variance (from its per-position counts) over its steps; the two sides are "
                      "taken as independent samples")}


# ------------------------------------------------------------------ the report

def build_report(runs: list[PromptRun], k: int, context: dict, eval_report: dict | None = None,
                 drafter: str | None = None) -> dict:
    """The report: ``context`` (engine, settings, load times) plus figures per domain and per prompt and, with
    ``eval_report``, the comparison with the evaluator's chain."""
    figures = by_domain(runs, k)
    report = {"format": FORMAT, **context, "num_prompts": len(runs), "num_speculative_tokens": k,
              "domains": figures,
              "per_prompt": [{"id": r.id, "domain": r.domain, "prompt_tokens": r.prompt_tokens,
                              "identical": (r.plain.token_ids == r.spec.token_ids) if r.plain else None,
                              "spec_tokens": len(r.spec.token_ids), "spec_seconds": r.spec.seconds,
                              "plain_tokens": len(r.plain.token_ids) if r.plain else None,
                              "plain_seconds": r.plain.seconds if r.plain else None,
                              "counters": r.spec.counters.to_dict()} for r in runs]}
    if eval_report is not None:
        method = chain_method(eval_report, drafter or "", k)
        report["evaluator"] = (compare(figures, method, k) if method else
                               {"method": None, "note": f"the evaluation report measured no greedy {drafter} chain of "
                                                        f"{k} or more (evaluate with serving.vllm_num_speculative_tokens={k})"})
        report["evaluator"]["report_prompts"] = eval_report.get("num_prompts")
    return report


def refusal_report(message: str, context: dict, k: int) -> dict:
    """The report of a head the engine would not load: the engine's own message, with what it was given."""
    return {"format": FORMAT, **context, "refused": message, "num_prompts": 0, "num_speculative_tokens": k,
            "domains": {}}


def _f(x, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(report: dict) -> str:
    eng = report.get("engine", {})
    k = report["num_speculative_tokens"]
    if report.get("refused"):
        return (f"# {eng.get('name', 'vLLM')} {eng.get('version', '')} refused the {report.get('method')} head\n\n"
                f"Target {report.get('target')} ({report.get('dtype')}), head {report.get('export_dir')}, "
                f"speculative_config `{json.dumps(report.get('speculative_config'))}`.\n\n{report['refused']}\n")
    lines = [f"# Served by {eng.get('name', 'vLLM')} {eng.get('version', '')}: {report.get('method')} head, chain of {k}",
             ""] + ([f"Chain of {k}: {report['chain_choice']}.", ""] if report.get("chain_choice") else []) + [
             f"{report['num_prompts']} prompts, max_new_tokens {report.get('max_new_tokens')}, greedy, batch 1; "
             f"target {report.get('target')} ({report.get('dtype')}); head {report.get('export_dir')}"
             + (f" (in {report['head_source']}'s format, served as that trainer wrote it)"
                if report.get("head_source") not in (None, "specheads") else "") + ".", ""]
    if eng.get("env") is not None:
        lines += ["Engine settings: " + (", ".join(f"`{k_}={v}`" for k_, v in eng["env"].items()) or "the engine's defaults")
                  + (f"; load {_f(eng.get('load_s', {}).get('plain'), 0)} s plain, {_f(eng.get('load_s', {}).get('spec'), 0)} s "
                     "speculative" if eng.get("load_s") else "") + ("; logs " + ", ".join(f"`{v}`" for v in eng["logs"].values())
                                                  if eng.get("logs") else "") + ".", ""]
    lines += ["τ = 1 + accepted ÷ drafts (tokens per drafting step, the engine's figure); tokens/forward = (new tokens − 1) "
              "÷ drafts (batch 1: one verify forward per step); α = accepted ÷ tested; reach j = accepted at position j ÷ "
              "drafts; tokens/s = decode tokens ÷ the engine's first-to-last-token time.", "",
              "| domain | prompts | τ | ±se | tokens/forward | α | reach per position | plain tok/s | spec tok/s | "
              "speed-up | greedy identical |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for domain, fig in report["domains"].items():
        s, p = fig["spec"], fig.get("plain") or {}
        same = f"{fig['identical']}/{fig['compared']}" if "identical" in fig else "–"
        lines.append(f"| {domain} | {fig['prompts']} | {_f(s['tau'])} | {_f(s['tau_se'])} | {_f(s['tokens_per_forward'])} | "
                     f"{_f(s['alpha'])} | {' / '.join(_f(x) for x in s['reach'])} | {_f(p.get('tokens_per_s'), 1)} | "
                     f"{_f(s['tokens_per_s'], 1)} | {_f(fig.get('speedup'))} | {same} |")
    ev = report.get("evaluator")
    if ev:
        lines += [""]
        if not ev.get("method"):
            lines += [f"Evaluator: {ev.get('note')}."]
        else:
            lines += [f"Beside the evaluator's `{ev['method']}` ({ev['shape']}, cut to a chain of {k}; its report: "
                      f"{ev.get('report_prompts')} prompts). {ev['noise'].capitalize()}.", "",
                      "| domain | τ evaluator | τ engine | Δ | se(Δ) | reach evaluator | reach engine | flagged |",
                      "|---|---|---|---|---|---|---|---|"]
            for domain, row in ev["domains"].items():
                flags = [row["tau_flagged"]] + [p["flagged"] for p in row["positions"]]
                lines.append(f"| {domain} | {_f(row['tau_evaluator'])} | {_f(row['tau_engine'])} | "
                             f"{row['tau_difference']:+.2f} | {_f(row['tau_se'])} | "
                             f"{' / '.join(_f(p['evaluator']) for p in row['positions'])} | "
                             f"{' / '.join(_f(p['engine']) for p in row['positions'])} | "
                             f"{'**yes**' if any(flags) else 'no'} |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: str | Path) -> dict[str, str]:
    """``serve_report.json`` and ``serve_report.md`` in ``out_dir``, each written to a temporary file and
    renamed into place."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "serve_report.json", "markdown": out / "serve_report.md"}
    for kind, text in (("json", json.dumps(report, indent=1)), ("markdown", markdown(report))):
        tmp = paths[kind].with_name(f".{paths[kind].name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, paths[kind])
    return {k: str(v) for k, v in paths.items()}


@dataclass
class EngineDecoder:
    """A ``Decoder`` over an ``EngineProcess`` (``specheads.serving.engine``): the counters differenced around
    each request."""

    process: object
    log: list = field(default_factory=list)

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Decoded:
        from specheads.serving.counters import counters_between

        answer = self.process.generate(prompt_ids, max_tokens)
        return Decoded(list(answer["token_ids"]), answer.get("text", ""), float(answer["seconds"]),
                       counters_between(answer["metrics_before"], answer["metrics_after"]))
