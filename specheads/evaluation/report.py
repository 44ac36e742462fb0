"""Write an evaluation report: ``report.json``, ``report.md`` (tables) and PNG plots (matplotlib Agg)."""

from __future__ import annotations

import json
from pathlib import Path

from specheads.decoding.exact import ATTENTION_NAME
from specheads.decoding.grouped_attention import ATTENTION_NAME as GROUPED_ATTENTION

# One basis for every head: drafts scored against the target's greedy token after the held-out data prefix.
TRAIN_TAU_LABEL = "Training-time τ estimate (vs target greedy)"
GPU_MODEL = ("GPU speed-up predicted as τ / (1 + c_GPU · F): batch-1 decoding is memory-bound, a forward costs "
             "time in proportion to the weights it reads, verifying a tree of up to ~64 tokens costs about one "
             "plain forward; c_GPU = draft parameters read per draft forward ÷ target parameters, F = draft "
             "forwards per step.")


def write_report(report: dict, out_dir: str | Path) -> dict[str, str]:
    """Write report.json, report.md and plots; returns {kind: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(report, gpu_model=GPU_MODEL)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=_num))
    (out / "report.md").write_text(markdown(report))
    paths = {"json": str(out / "report.json"), "markdown": str(out / "report.md")}
    paths.update(plots(report, out))
    return paths


def _num(x):
    return float(x)


def _f(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def _spread(r: dict, key: str, nd: int = 2) -> str:
    """A median with its range over the timed passes: ``1.23 (1.10–1.31)`` (no range from one pass)."""
    rng = r.get(key + "_range")
    if not rng or r.get(key) is None or rng[0] == rng[1]:
        return _f(r.get(key), nd)
    return f"{_f(r.get(key), nd)} ({_f(rng[0], nd)}–{_f(rng[1], nd)})"


def markdown(report: dict) -> str:
    b = report.get("budget")
    budget = f" (of {b['of']}: the time budget's, below)" if b and b["prompts"] < b["of"] else ""
    lines = [f"# Speculative decoding evaluation: {report['target']}", "",
             f"{report['num_prompts']} prompts{budget}, max_new_tokens {report['max_new_tokens']}, "
             f"temperatures {report['temperatures']}. τ = tokens per target forward (bonus included); "
             "α = accepted ÷ tested drafts (Leviathan et al.); both count only tokens that reach the output "
             "(a draft past max_new_tokens or EOS is neither accepted nor rejected). " + _speedup_md(report), "",
             f"_{GPU_MODEL}_", ""]
    by_t = report.get("plain_by_temperature") or {str(report["temperatures"][0]): report["plain"]}
    lines += ["Plain decoding: " + "; ".join(f"T={t} {_spread(rows['all'], 'tokens_per_s', 1)} tokens/s"
                                             for t, rows in by_t.items()) + ".", ""]
    lines += passes_md(report)
    lines += budget_md(report)
    for taken in report.get("resumed") or ():
        lines += [f"Taken up after an interruption: the plain pass and {', '.join(taken['methods_taken_up']) or 'no'} "
                  "method rows were kept from the interrupted run (same settings, target, heads and measured "
                  "decisions); the rest was decoded in this one.", ""]
    lines += _precision_md(report)
    lines += separation_md(report.get("data_separation"))
    if report["methods"]:
        lines += summary_md(report)
    for m in report["methods"]:
        lines += _method_md(m, report)
    return "\n".join(lines) + "\n"


def passes_md(report: dict) -> list[str]:
    """Which pass gave which figure (``evaluation.passes``)."""
    passes = report.get("passes")
    if not passes:
        return []
    fast, exact = passes["fast"], passes.get("exact")
    line = (f"Two passes over the same prompts. **Fast pass** (timed): the target's own kernels, attention "
            f"`{fast['attention']}` and linear layers as the kernels choose (no row floor), plain and speculative "
            "decoding alike, as a serving engine or a decoding loop runs them: it gives tokens/s, the speed-ups, α, τ, "
            "the verify cost curve and the shape chosen from it, and the batch rows. ")
    if exact:
        line += ("**Exact pass** (untimed, T=0): exact forwards (float64 attention, linear calls padded to the row "
                 "floor, proven below), a plain greedy reference decode of each prompt and a greedy decode of each by "
                 "each row, stopped at its first token off the reference: it gives the lossless column. A fast-pass "
                 "greedy output that differs from the fast plain output while the exact pass is identical is listed "
                 "as a numerical divergence, with the target's top-2 logit margin there, not as a failure.")
    else:
        line += ("No exact pass (exact forwards off): the lossless column is the fast pass's own comparison with "
                 "plain greedy decoding (fast pass only), where a tie within the kernels' rounding can also differ.")
    return [line, ""]


def budget_md(report: dict) -> list[str]:
    """What the time budget (``eval.max_minutes``, ``evaluation.budget``) bought first and what it left out."""
    b = report.get("budget")
    if not b:
        return []
    core, left = b.get("core") or {}, b.get("left_out") or {}
    exact = (f", an exact-pass decode {b['exact_decode_s']:.1f} s, {b['exact_s']:.0f} s of the plan"
             if b.get("exact_decode_s") is not None and "exact_s" in b else "")
    line = (f"Time budget {b['max_minutes']:g} min (a plain decode took {b['decode_s']:.1f} s here{exact}; about "
            f"{b['estimate_s']:.0f} s planned): first one prompt of each of the {len(core.get('domains', []))} "
            f"domains for {', '.join(core.get('methods', []))} at T={core.get('temperature')}"
            + (" with their exact pass" if exact else ""))
    if b.get("over_budget"):
        line += " (more than the budget holds: evaluated anyway)"
    temps = [str(t) for t in report.get("temperatures", [])]
    parts = []
    for r in left.get("rows", []):
        gone = [str(t) for t in r["temperatures"]]
        parts.append(f"row {r['method']} " + ("entirely" if gone == temps else "at T=" + ", ".join(gone)))
    if left.get("prompts"):
        parts.append(f"{len(left['prompts'])} of {b['of']} prompts ({', '.join(left['prompts'])})")
    for r in left.get("batch_sizes", []):
        parts.append(f"{r['method']} at batch size " + ", ".join(map(str, r["batch_sizes"])))
    line += (". Left out for time: " + "; ".join(parts) + "." if parts else ". Nothing was left out.")
    return [line, ""]


def _speedup_md(report: dict) -> str:
    """How the speed-ups were timed."""
    n = report.get("repeats", 1)
    head = ("Speed-up = decode tokens/s ÷ plain decode tokens/s at the same temperature on the same engine "
            "(prefill excluded" + ("; both in the fast pass)" if report.get("passes") else ")"))
    if report.get("paired"):
        return (f"{head}, paired: in each of {n} timed pass(es) after a warm-up every prompt is decoded plainly "
                "right before it is decoded speculatively, and the speed-up is the median of the per-pass ratios, "
                "their range in brackets.")
    return (f"{head}: the median of {n} timed pass(es) after a warm-up, with its range in brackets (slowest "
            "speculative vs fastest plain pass – fastest vs slowest).")


def _floor_md(ex: dict) -> str:
    """The exact forwards' linear row floor and their proof on this machine (``decoding.exact.prove_exact``)."""
    if "row_floor" not in ex:
        return ""
    proof = ex["proof"]
    ms = ex.get("one_token_ms") or {}
    timed = (f"one-token forward {ms['floored']:.1f} ms padded, {ms['lifted']:.1f} ms as the kernels choose, both "
             "with float64 attention") if ms else ""
    forms = {k: f for k, f in (ex.get("row_form") or {}).items() if f != "linear"}
    if forms:
        named = {"wxt": "(W·xᵀ)ᵀ", "xwt": "x·Wᵀ against a contiguous copy of Wᵀ"}
        timed = "; ".join(filter(None, [timed, "computed as " + "; ".join(f"{named.get(f, f)}: {k}"
                                                                          for k, f in forms.items())]))
    if ex["row_floor"] == ex.get("row_chunk", 0) == 1:
        floor = "every linear layer fed one row at a time (no row floor up to 16 made them row-invariant here)"
    else:
        floor = (f"linear layers fed at least {ex['row_floor']} rows per call, the smallest count from which "
                 f"their rows no longer depend on the call here ({timed})")
    cases, scope = proof.get("cases") or [], ""
    if cases:
        rows = f", then {proof['batch']} of them in one forward" if proof.get("batch", 1) > 1 else ""
        scope = (f" (trees of up to {max(n for _, n in cases)} nodes at contexts of up to "
                 f"{max(c for c, _ in cases)} tokens{rows})")
    said = (f"; {floor}; proof: {proof['nodes'] - proof['unequal']} of {proof['nodes']} nodes of random draft trees"
            f"{scope} bitwise equal to one-token forwards{'' if ex['proven'] else ', NOT PROVEN'}")
    fb = ex.get("fallback")
    if fb:
        said += f"; {fb['reason']}, so the target decodes in {fb['to']}"
    return said


def _precision_md(report: dict) -> list[str]:
    """How the target computed: its dtype and whether its forwards were made batch-invariant."""
    if "target_dtype" not in report:
        return []
    ex = report.get("exact_forward") or {}
    dtype = report["target_dtype"].removeprefix("torch.")
    exact = f"exact forwards (attention in float64, rounded to {dtype}{_floor_md(ex)})"
    passes = report.get("passes")
    fast = (passes or {}).get("fast", {}).get("attention") if passes else ex.get("attention")
    how = "" if fast == ATTENTION_NAME else (f"attention `{fast}`" + (
        " (SDPA with each key/value head's query heads folded into query rows: no copy of the KV cache per forward)"
        if fast == GROUPED_ATTENTION else ""))
    if passes:  # the fast pass's kernels, then the exact pass's
        how = f"fast pass {how}, linear layers unpadded" + (f"; exact pass {exact}" if passes.get("exact") else "")
    elif fast == ATTENTION_NAME:  # a report from before the two passes: one arithmetic for every decode
        how = exact
    lin = report.get("cpu_linears") or {}
    ms = lin.get("one_token_ms")
    if ms:
        how += (f"; linear layers {lin['linears']} (one-token forward measured here {ms['packed']:.1f} ms "
                f"with oneDNN-prepacked weights, {ms['plain']:.1f} ms without; the faster one is used)")
    elif lin.get("linears") == "packed":
        how += f"; {lin['packed_linears']} linear layers prepacked for oneDNN"
    th = report.get("cpu_threads") or {}
    if th.get("one_token_ms"):
        how += (f"; decoding on {th['threads']} of {th['of']} threads (one-token forward measured here "
                + ", ".join(f"{v:.1f} ms on {n}" for n, v in th["one_token_ms"].items()) + ")")
    choice = report.get("target_dtype_choice") or {}
    why = f" ({choice['reason']}" if choice.get("reason") and choice["reason"] != "as set" else ""
    if why and choice.get("probe_ms"):
        why += "; " + ", ".join(f"{k} {v:.1f} ms" for k, v in choice["probe_ms"].items())
    machine = f" on {report['machine']}" if report.get("machine") else ""
    return [f"Target forwards (plain and speculative alike){machine}: {dtype}{why + ')' if why else ''}, {how}.", ""]


def _lossless_cell(ll: dict | None) -> str:
    """The summary's lossless cell: the verdict, and the fast pass's numerical divergences beside it."""
    if not ll:
        return "–"
    cell = "exact" if ll["exact"] else f"{len(ll['mismatches'])} mismatches"
    n = len(ll.get("divergences") or ())
    return cell + (f" ({n} numerical divergence{'s' if n > 1 else ''} in the fast pass)" if n else "")


def _lossless_header(report: dict) -> str:
    passes = report.get("passes")
    if not passes:
        return "lossless"
    return "lossless (exact pass)" if passes.get("exact") else "lossless (fast pass only)"


def separation_md(sep: dict | None) -> list[str]:
    """What keeps the scored prompts out of training: prompts scored per benchmark and the duplicate
    conversations the chat slice's prepared set dropped (``specheads.data.dedup``)."""
    if not sep:
        return []
    scored = ", ".join(f"{name} {n}" for name, n in sep["scored"].items())
    line = f"Prompts scored: {scored}."
    d = sep.get("prepared_dedup")
    if d:
        line += (f" The chat slice's prepared set ({sep['chat_dir']}) dropped {d['duplicates_within']} conversation(s) "
                 f"repeating an earlier one and {d['duplicates_of_evaluation_prompts']} matching one of "
                 f"{d['evaluation_prompts_checked']} MT-bench/HumanEval prompts (key: {d['key']}) of "
                 f"{d['conversations_read']} read; training leaves the chat slice out of its training and held-out rows.")
    elif sep.get("prepared_without_dedup"):
        line += (f" The chat slice's prepared set ({sep['chat_dir']}) was prepared before duplicate conversations "
                 "were removed: a training row may repeat a scored chat prompt.")
    return [line, ""]


def summary_md(report: dict) -> list[str]:
    """Every method on one line (all prompts), then τ per domain with one column per method."""
    methods = report["methods"]
    temps = [str(t) for t in report["temperatures"]]
    fast = " fast pass," if report.get("passes") else ""
    L = ["## Summary", "", "| method | " + " | ".join(f"α T={t} | τ T={t} | speed-up (CPU,{fast} T={t})" for t in temps) +
         f" | GPU speed-up (pred) | {_lossless_header(report)} | eval s |",
         "|" + "---|" * (1 + 3 * len(temps) + 3)]
    for m in methods:
        cells = []
        for t in temps:
            r = m["by_temperature"].get(t, {}).get("all", {})
            cells += [_f(r.get("alpha")), _f(r.get("tau")), _spread(r, "speedup")]
        r0 = m["by_temperature"].get(temps[0], {}).get("all", {})
        L.append(f"| {m['name']} | " + " | ".join(cells) + " | "
                 f"{_f(r0.get('gpu_speedup_pred'))} | {_lossless_cell(m.get('lossless'))} | "
                 f"{_f(m.get('eval_seconds'), 0)} |")
    L.append("")
    for t in temps:
        domains = list(next((m["by_temperature"][t] for m in methods if t in m["by_temperature"]), {}))
        if not domains:
            continue
        L += [f"τ per domain at T={t}:", "", "| domain | " + " | ".join(m["name"] for m in methods) + " |",
              "|" + "---|" * (1 + len(methods))]
        for d in domains:
            L.append(f"| {d} | " + " | ".join(_f(m["by_temperature"].get(t, {}).get(d, {}).get("tau"))
                                               for m in methods) + " |")
        L.append("")
    return L


def _method_md(m: dict, report: dict) -> list[str]:
    prof = f", serving profile **{m['profile']}**" if m.get("profile") else ""
    lossy = "" if m.get("lossless_verify", True) else " (LOSSY verification)"
    L = [f"## {m['name']}", "", f"drafter `{m['drafter']}`, shape `{m['shape']}`, verify `{m['verify']}`"
         f"{lossy}{prof}; c_GPU = {_f(m['c_gpu'], 3)}.", ""]
    if m.get("head_source", "specheads") != "specheads":
        from specheads.export.foreign import FORMATS

        L += [f"Head trained elsewhere: {FORMATS.get(m['head_source'], m['head_source'])}; it has no "
              "train_summary.json, so no training-time figures.", ""]
    L += _shape_choice_md((report.get("shape_choice") or {}).get(m["name"]))
    L += lossless_md(m.get("lossless"))
    temps = list(m["by_temperature"])
    head = "| domain | " + " | ".join(f"α T={t} | τ T={t} | tok/s T={t} | speed-up (CPU) T={t}" for t in temps) + \
           " | c (CPU) | GPU speed-up (pred) |"
    L += [head, "|" + "---|" * (1 + 4 * len(temps) + 2)]
    t0 = m["by_temperature"][temps[0]]
    for d in t0:
        cells = []
        for t in temps:
            r = m["by_temperature"][t].get(d, {})
            cells += [_f(r.get("alpha")), _f(r.get("tau")), _spread(r, "tokens_per_s", 1), _spread(r, "speedup")]
        r = t0[d]
        L.append(f"| {d} | " + " | ".join(cells) + f" | "
                 f"{_f(r.get('cost_ratio_c'), 3)} | {_f(r.get('gpu_speedup_pred'))} |")
    apos = t0["all"]["alpha_by_position"]
    L += ["", "α by draft position (T=" + temps[0] + "): " + ", ".join(_f(a) for a in apos), ""]
    ext = m.get("ngram_extend")
    if ext:
        src = (f"else the n-gram table of {ext['table']} ({ext['table_ngrams']} n-grams)" if ext.get("table")
               else "(no n-gram table)")
        L += [f"Lookup branch extended: the best {ext['first_drafts']} first draft(s) continued by up to "
              f"{ext['tokens']} tokens each from the prompt lookup, {src}; no draft forward.", ""]
    L += _step_cost_md(t0["all"], temps[0], (report.get("shape_choice") or {}).get(m["name"]),
                       bool(m.get("ngram_branch")))
    if m.get("batch"):
        L += ["| batch | plain tok/s | spec tok/s | speed-up | target forwards / step | output = batch-1 plain "
              "(fast pass) |",
              "|---|---|---|---|---|---|"]
        for bs, r in m["batch"].items():
            L.append(f"| {bs} | {_f(r['plain_tokens_per_s'], 1)} | {_f(r['spec_tokens_per_s'], 1)} | "
                     f"{_f(r['speedup'])} | {_f(r['target_forwards_per_step'])} | {r['matches_batch1_plain']} |")
        L.append("")
    rec = report.get("recommendation", {}).get(m["name"])
    if rec:
        L += _recommend_md(rec, m)
    if m.get("train_tau") is not None:
        L += [f"{TRAIN_TAU_LABEL} {_f(m['train_tau'])} vs measured τ (T=0, all) {_f(t0['all']['tau'])}.", ""]
    return L


def lossless_md(ll: dict | None) -> list[str]:
    """A row's lossless check: the verdict and the pass that gave it, its mismatches, the fast pass's numerical
    divergences (``passes.lossless_verdict``)."""
    if not ll:
        return []
    status = "exact on every prompt" if ll["exact"] else f"{len(ll['mismatches'])} MISMATCHES"
    how = {"exact": "exact pass: greedy vs plain greedy, both in exact forwards",
           "fast": "fast pass only: greedy vs plain greedy in the fast kernels, no exact pass"}.get(ll.get("pass"),
                                                                                                    "greedy vs plain greedy")
    L = [f"Lossless check ({how}, {ll['checked']} prompts): {status}.", ""]
    for mm in ll["mismatches"]:
        L.append(f"- {mm['prompt']}: token {mm['index']}, target margin {_f(mm.get('margin'), 4)}")
    if ll["mismatches"]:
        L.append("")
    div = ll.get("divergences") or []
    if div:
        L += [f"Numerical divergence in the fast pass ({len(div)} of {ll['checked']} prompts: the fast greedy output "
              "differs from the fast plain output where the exact pass is identical; the target's top two logits lie "
              "within the kernels' rounding there):", ""]
        L += [f"- {d['prompt']}: token {d['index']}, target top-2 margin {_g(d.get('margin'))}" for d in div] + [""]
    return L


def _g(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _step_cost_md(row: dict, temp: str, choice: dict | None, branch: bool = False) -> list[str]:
    """Where a speculative step's time went, in plain decoding steps (the paired plain decodes' time
    per token): the verify forward, drafting, and the rest of the loop; beside what the shape
    choice predicted from its cost curve, when there was one (for the head's shape alone, without a
    prompt-lookup ``branch``)."""
    steps, plain_tps = row.get("target_forwards"), row.get("paired_plain_tokens_per_s")
    if not steps or not plain_tps or not row.get("decode_time_s") or not row.get("tau"):
        return []
    unit = 1.0 / plain_tps
    verify = row["target_time_s"] / steps / unit
    draft = row["draft_time_s"] / steps / unit
    decide = row.get("verify_time_s", 0.0) / steps / unit
    rest = max(row["decode_time_s"] - row["target_time_s"] - row["draft_time_s"] - row.get("verify_time_s", 0.0),
               0.0) / steps / unit
    cost = verify + draft + decide + rest
    line = (f"Cost of a step (T={temp}, all prompts, first pass), in plain decoding steps of "
            f"{1000 * unit:.1f} ms: verify forward {verify:.2f}, drafting {draft:.2f}, accept/reject decisions "
            f"{decide:.2f}, the rest of the loop (cache pruning, feeding the drafter) {rest:.2f}; "
            f"τ {row['tau']:.2f} ÷ {cost:.2f} = {row['tau'] / cost:.2f}.")
    pred = next((p for p in (choice or {}).get("predictions", []) if p["label"] == choice.get("label")), None)
    if pred:
        alone = f" for {pred['label']} alone (no lookup branch)" if branch else ""
        line += (f" The shape choice predicted{alone} verify {pred['verify_cost']:.2f} and drafting "
                 f"{pred['draft_forwards'] * choice['c']:.2f} from its cost curve: {pred['speedup']:.2f}.")
    return [line, ""]


def _shape_choice_md(ch: dict | None) -> list[str]:
    """How an automatic shape was chosen: this machine's verify cost curve, the draft cost and the
    head's acceptance measured on training-side held-out prompts."""
    if not ch:
        return []
    curve = ", ".join(f"v({n}) {_f(v)}" for n, v in ch["verify_cost_curve"].items())
    raw = ch.get("verify_cost_measured") or {}
    if raw and any(abs(raw[n] - v) > 5e-3 for n, v in ch["verify_cost_curve"].items() if n in raw):
        curve += " (made non-decreasing; as measured: " + ", ".join(f"v({n}) {_f(v)}" for n, v in raw.items()) + ")"
    preds = ", ".join(f"{p['label']}: τ {_f(p['tau'])} / ({_f(p['verify_cost'])} + {p['draft_forwards']}·"
                      f"{_f(ch['c'], 3)}) = {_f(p['speedup'])}" for p in ch["predictions"])
    reach = ", ".join(_f(r) for r in ch["reach"])
    fans = ", ".join(f"width {w} τ {_f(t)}" for w, t in (ch.get("fans") or {}).items())
    unit = ("in plain decoding's one-token forwards (the fast pass's kernels, the curve's too) of"
            if ch.get("plain_unit") == "plain" else "in one-token verify forwards of")
    split = ch.get("heldout_split") or {}
    rows = (f" ({split['heldout_rows']} held-out rows of {split['rows']}, none of them a scored prompt or its chat; "
            f"{split['evaluation_rows_left_out']} rows of the evaluator's chat slice left out of training and "
            "held-out rows)") if "heldout_rows" in split else ""
    return [f"Shape chosen automatically: **{ch['label']}** (chainK: K drafts in a row; fanW: the W best first "
            f"drafts, verified together). Verify cost on this machine ({unit} "
            f"{_f(1000 * ch['plain_forward_s'], 1)} ms): {curve}; draft forward c = {_f(ch['c'], 3)}; "
            f"on the head's training-side held-out prompts{rows}, share of steps reaching draft depth d: {reach}"
            + (f"; fans: {fans}" if fans else "") + f". Predicted speed-up per shape: {preds}."
            + _none_faster(ch), ""]


def _none_faster(ch: dict) -> str:
    """Said plainly where no candidate shape is predicted to beat plain decoding on this machine."""
    best = max(ch["predictions"], key=lambda p: p["speedup"], default=None)
    if best is None or best["speedup"] >= 1.0:
        return ""
    two = ch["verify_cost_curve"].get("2")
    cost = f"a verify forward of 2 tokens costs {_f(two)} plain forwards and " if two is not None else ""
    return (f" **No shape is predicted faster than plain decoding on this machine** (the best, {best['label']}, at "
            f"{_f(best['speedup'])}×): {cost}a draft forward {_f(ch['c'], 3)}, more than this head's acceptance "
            "wins back; the decode below measures the chosen shape all the same.")


def _recommend_md(rec: dict, m: dict) -> list[str]:
    T = next(iter(rec))
    if not rec[T]:
        return []
    kind = next(iter(rec[T].values()))["kind"]
    what, K = ("chain length", "K") if kind == "chain" else ("tree depth (draft tokens per step)", "depth")
    L = [f"Recommended {what} per domain (T={T}), predicted from this run's acceptance per depth and cost, "
         f"never beyond the depth it drafted (chosen after scoring, on the scored prompts themselves: a "
         f"suggestion for the next run, not a figure measured out of sample); at the configuration that ran, "
         f"predicted beside measured:", "",
         f"| domain | best {K} (GPU) | pred. speed-up GPU | best {K} (CPU) | pred. speed-up CPU | ran {K} | "
         "τ pred / measured | speed-up CPU pred / measured |", "|---|---|---|---|---|---|---|---|"]
    for d, r in rec[T].items():
        by_k = {p["k"]: p for p in r["predictions"]}

        def best(k):
            tok = by_k[k].get("tokens_per_step")
            return f"{k}" + (f" ({tok:.1f})" if tok is not None else "")

        measured = _spread({"speedup": r["measured_speedup"], "speedup_range": r.get("measured_speedup_range")},
                           "speedup")
        L.append(f"| {d} | {best(r['best_k_gpu'])} | {_f(r['best_speedup_gpu_pred'])} | {best(r['best_k_cpu'])} | "
                 f"{_f(r['best_speedup_cpu_pred'])} | {best(r['measured_depth'])} | "
                 f"{_f(r['predicted_tau'])} / {_f(r['measured_tau'])} | "
                 f"{_f(r['predicted_speedup_cpu'])} / {measured} |")
    return L + [""]


def plots(report: dict, out: Path) -> dict[str, str]:
    """α per domain, α by draft position, τ and speed-up vs K (predicted, with measured points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    methods = report["methods"]
    if not methods:
        return paths
    T = next(iter(methods[0]["by_temperature"]))
    domains = [d for d in methods[0]["by_temperature"][T] if d != "all"] + ["all"]
    fig, ax = plt.subplots(figsize=(max(6, len(domains) * 0.9), 4))
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [m["by_temperature"][T].get(d, {}).get("alpha") or 0 for d in domains]
        ax.bar([j + i * w for j in range(len(domains))], vals, w, label=m["name"])
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(domains))], domains, rotation=30, ha="right")
    ax.set_ylabel(f"α (T={T})"); ax.legend(fontsize=7); fig.tight_layout()
    paths["alpha_by_domain"] = _save(fig, out / "alpha_by_domain.png", plt)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        a = m["by_temperature"][T]["all"]["alpha_by_position"]
        ax.plot(range(1, len(a) + 1), [x if x is not None else float("nan") for x in a], "o-", label=m["name"])
    ax.set_xlabel("draft position"); ax.set_ylabel(f"α (T={T})"); ax.legend(fontsize=7); fig.tight_layout()
    paths["alpha_by_position"] = _save(fig, out / "alpha_by_position.png", plt)
    rec = report.get("recommendation", {})
    if rec:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for m in methods:
            r = rec.get(m["name"], {}).get(T, {}).get("all")
            if not r:
                continue
            ks = [p["k"] for p in r["predictions"]]
            line = a1.plot(ks, [p["tau_pred"] for p in r["predictions"]], "-", label=m["name"])[0]
            a2.plot(ks, [p["speedup_gpu_pred"] for p in r["predictions"]], "-", color=line.get_color(),
                    label=f"{m['name']} GPU pred")
            a2.plot(ks, [p["speedup_cpu_pred"] for p in r["predictions"]], ":", color=line.get_color(),
                    label=f"{m['name']} CPU pred")
            k_run = r.get("measured_depth")
            if k_run:
                a1.plot([k_run], [r["measured_tau"]], "o", color=line.get_color())
                if r["measured_speedup"]:
                    rng = r.get("measured_speedup_range") or [r["measured_speedup"]] * 2
                    a2.errorbar([k_run], [r["measured_speedup"]], [[r["measured_speedup"] - rng[0]],
                                [rng[1] - r["measured_speedup"]]], fmt="o", color=line.get_color(), capsize=3)
        a1.set_xlabel("chain length K / tree depth"); a1.set_ylabel("τ"); a1.legend(fontsize=7)
        a2.set_xlabel("chain length K / tree depth"); a2.set_ylabel("speed-up"); a2.legend(fontsize=6)
        fig.tight_layout()
        paths["tau_speedup_vs_k"] = _save(fig, out / "tau_speedup_vs_k.png", plt)
    return paths


def _save(fig, path: Path, plt) -> str:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
