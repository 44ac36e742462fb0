"""The evaluation under a time budget: every domain first (the head's row and the n-gram baseline at T=0),
then the other rows, temperatures, prompts and batch sizes; what did not fit is reported."""

from __future__ import annotations

import pytest

from specheads.decoding.drafters import TreeShape
from specheads.data.benchmarks import EvalPrompt
from specheads.evaluation.budget import SPEC_DECODE_COST, Costs, full_plan, plan_budget, prompt_order
from specheads.evaluation.suite import MethodSpec
from specheads.progress import evaluation_steps

MTBENCH = ("coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing")


def _set(turns=(0,)):
    """The main job's set: one MT-bench question per category, 2 HumanEval, 2 held-out chats (12 prompts,
    10 domains)."""
    ps = [EvalPrompt(f"mtbench/{c}/t{t + 1}", c, ["q", "q2"], t) for c in MTBENCH for t in turns]
    ps += [EvalPrompt(f"humaneval/{i}", "code", ["def f():"], 0) for i in range(2)]
    ps += [EvalPrompt(f"chat/{i}", "chat", ["hi"], 0) for i in range(2)]
    return ps


def _main_job_methods():
    """conf/pipeline.yaml's evaluate stage: the auto-shaped EAGLE-3 head, with the lookup branch, vLLM's chain,
    the n-gram baseline."""
    head = dict(head_dir="runs/x/train/eagle3")
    return [MethodSpec("eagle3-auto", "eagle3", TreeShape("chain", k=1), auto_shape=True, **head),
            MethodSpec("eagle3-auto+ngram4+x1", "eagle3", TreeShape("chain", k=1), auto_shape=True, ngram_branch=4,
                       ngram_extend=1, **head),
            MethodSpec("eagle3-vllm", "eagle3", TreeShape("chain", k=3), profile="vllm", **head),
            MethodSpec("ngram-chain4", "ngram", TreeShape("chain", k=4))]


def _plan(prompts, methods, decodes: float, temperatures=(0.0, 1.0), batch_sizes=(1,), repeats=1):
    """The plan for a budget of ``decodes`` plain decodes (1 s each)."""
    return plan_budget(prompts, methods, temperatures, batch_sizes, budget_s=decodes, decode_s=1.0, repeats=repeats,
                       paired=True, batch_prompts=8, max_new_tokens=32)


def _old_budget_prompts(n: int, methods, temperatures=(0.0, 1.0)) -> float:
    """What the budget that kept ``n`` prompts before (each prompt bought for every row and temperature) cost,
    in plain decodes: (1 + rows x temperatures x 2.5) per prompt, 2 for the probe, 6 per auto-shaped head."""
    return 2 + 6 + n * (1 + len(methods) * len(temperatures) * 2.5)


def test_prompts_are_taken_round_robin_over_domains_later_turns_after_their_first():
    ps = _set(turns=(0, 1))
    order = [p.id for p in prompt_order(ps)]
    domains = [p.domain for p in prompt_order(ps)][:10]
    assert sorted(domains) == sorted(set(domains)) and len(domains) == 10  # one of each domain first
    assert order[:2] == ["mtbench/coding/t1", "mtbench/extraction/t1"]
    assert order[10:13] == ["mtbench/coding/t2", "mtbench/extraction/t2", "mtbench/humanities/t2"]
    assert order.index("humaneval/1") > order.index("humaneval/0") and order.index("chat/1") > 10
    assert sorted(order) == sorted(p.id for p in ps)


def test_a_budget_of_four_prompts_worth_still_scores_every_domain_for_the_head_and_the_ngram_baseline():
    """The 2-core AVX2 main job's budget used to buy 4 of 12 prompts for every row at both temperatures (four
    MT-bench categories, no code, no chat); the same budget now buys every domain for the head's own row and
    the n-gram baseline at T=0 first."""
    ps, methods = _set(), _main_job_methods()
    plan = _plan(ps, methods, _old_budget_prompts(4, methods))
    assert {p.domain for p in plan.prompts} == set(MTBENCH) | {"code", "chat"}
    assert plan.temperatures[0] and 0.0 in plan.temperatures[0]  # eagle3-auto
    assert 0.0 in plan.temperatures[3]  # ngram-chain4
    rec = plan.record
    assert rec["core"]["methods"] == ["eagle3-auto", "ngram-chain4"] and rec["core"]["temperature"] == 0.0
    assert len(rec["core"]["domains"]) == 10 and not rec["over_budget"]
    # the rest did not fit: reported, row by row and temperature by temperature
    assert rec["left_out"]["rows"] == [{"method": "eagle3-auto", "temperatures": [1.0]},
                                       {"method": "eagle3-auto+ngram4+x1", "temperatures": [0.0, 1.0]},
                                       {"method": "eagle3-vllm", "temperatures": [0.0, 1.0]},
                                       {"method": "ngram-chain4", "temperatures": [1.0]}]
    assert plan.temperatures[1] == plan.temperatures[2] == ()
    assert rec["plan_s"] <= _old_budget_prompts(4, methods)


def test_the_budget_buys_rows_then_temperatures_then_prompts_then_batches():
    ps, methods = _set(), _main_job_methods()
    cost = Costs(methods, 1, True, 8, 32)
    core = [[0.0], [], [], [0.0]]
    core_s = cost.total(core, [[]] * 4, 10)
    rows = [[0.0]] * 4
    assert _plan(ps, methods, core_s).temperatures == [(0.0,), (), (), (0.0,)]
    assert _plan(ps, methods, cost.total(rows, [[]] * 4, 10)).temperatures == [(0.0,)] * 4
    both = [[0.0, 1.0]] * 4
    plan = _plan(ps, methods, cost.total(both, [[]] * 4, 10))
    assert plan.temperatures == [(0.0, 1.0)] * 4 and len(plan.prompts) == 10
    assert plan.record["left_out"] == {"rows": [], "prompts": ["humaneval/1", "chat/1"], "batch_sizes": []}
    assert len(_plan(ps, methods, cost.total(both, [[]] * 4, 11)).prompts) == 11
    # batch sizes last, for the rows that run
    plan = _plan(ps, methods, cost.total(both, [[]] * 4, 12), batch_sizes=(1, 4))
    assert len(plan.prompts) == 12 and plan.batch_sizes == [()] * 4
    assert plan.record["left_out"]["batch_sizes"][0] == {"method": "eagle3-auto", "batch_sizes": [4]}
    plan = _plan(ps, methods, cost.total(both, [[4]] * 4, 12), batch_sizes=(1, 4))
    assert plan.batch_sizes == [(4,)] * 4 and plan.record["left_out"] == {"rows": [], "prompts": [], "batch_sizes": []}


def test_the_exact_pass_is_priced_and_the_core_keeps_its_verdict_on_every_domain():
    """With an exact pass (each exact-pass decode 1.6 plain decodes, as padding cost on the 2-core AVX2 CPU): per
    prompt a reference decode, per row at T=0 one speculative decode per prompt, untimed (no repeats, no paired plain
    decode); a budget that bought every row at T=0 without it buys fewer, the core (every domain, head and n-gram at
    T=0, with their exact pass) still runs, and the record says what the exact pass costs."""
    ps, methods = _set(), _main_job_methods()
    fast, exact = Costs(methods, 3, True, 8, 32), Costs(methods, 3, True, 8, 32, exact=1.6)
    rows = [[0.0, 1.0], [0.0], [], [0.0]]  # three rows at T = 0: three exact passes
    assert exact.exact_part(rows, 10) == pytest.approx(1.6 * (1 + 10 + 3 * 10 * SPEC_DECODE_COST))
    assert exact.total(rows, [[]] * 4, 10) - fast.total(rows, [[]] * 4, 10) == pytest.approx(exact.exact_part(rows, 10))
    # the exact pass of one row costs less than its timed decodes at T = 0 (3 paired passes)
    assert exact.exact_part([[0.0]], 10) - exact.exact_part([[]], 10) < 3 * 10 * (SPEC_DECODE_COST + 1)
    budget = fast.total([[0.0]] * 4, [[]] * 4, 10)
    assert _plan(ps, methods, budget, repeats=3).temperatures == [(0.0,)] * 4
    priced = plan_budget(ps, methods, (0.0, 1.0), (1,), budget_s=budget, decode_s=1.0, repeats=3, paired=True,
                         batch_prompts=8, max_new_tokens=32, exact_cost=1.6)
    assert 0.0 in priced.temperatures[0] and 0.0 in priced.temperatures[3]  # the core, with its exact pass
    assert {p.domain for p in priced.prompts} == set(MTBENCH) | {"code", "chat"}
    assert () in priced.temperatures[1:3]  # a row the exact pass's price left out
    assert priced.record["exact_cost"] == 1.6 and priced.record["exact_s"] > 0 and not priced.record["over_budget"]


def test_a_row_samples_only_where_it_also_runs_its_lossless_check_at_t0():
    ps, methods = _set(), _main_job_methods()
    cost = Costs(methods, 1, True, 8, 32)
    # room for T=1 of the core rows but not for the other rows at T=0 plus their T=1
    budget = cost.total([[0.0, 1.0], [], [], [0.0, 1.0]], [[]] * 4, 10)
    plan = _plan(ps, methods, budget)
    for ts in plan.temperatures:
        assert not ts or 0.0 in ts


def test_a_budget_too_small_for_the_core_keeps_the_core_and_says_so():
    ps, methods = _set(), _main_job_methods()
    plan = _plan(ps, methods, 1.0)
    assert len(plan.prompts) == 10 and {p.domain for p in plan.prompts} == set(MTBENCH) | {"code", "chat"}
    assert plan.temperatures == [(0.0,), (), (), (0.0,)]
    assert plan.record["over_budget"] and plan.record["left_out"]["prompts"] == ["humaneval/1", "chat/1"]


def test_without_zero_among_the_temperatures_the_core_runs_at_the_first():
    plan = _plan(_set(), _main_job_methods(), 1.0, temperatures=(0.7, 1.0))
    assert plan.record["core"]["temperature"] == 0.7 and plan.temperatures[0] == (0.7,)


def test_baselines_only_keep_the_ngram_row_and_a_set_without_ngram_its_first_row():
    ee = MethodSpec("early_exit8-chain4", "early_exit", TreeShape("chain", k=4))
    ng = MethodSpec("ngram-chain4", "ngram", TreeShape("chain", k=4))
    assert _plan(_set(), [ee, ng], 1.0).temperatures == [(), (0.0,)]
    assert _plan(_set(), [ee], 1.0).temperatures == [(0.0,)]


@pytest.mark.parametrize("paired,repeats,batch_sizes,exact", [(True, 1, (1,), True), (False, 3, (1, 2), False)])
def test_the_full_plans_steps_are_the_progress_bars(paired, repeats, batch_sizes, exact):
    ps, methods = _set(turns=(0, 1)), _main_job_methods()
    plan = full_plan(ps, methods, (0.0, 1.0), batch_sizes)
    assert plan.steps(methods, repeats, paired, 8, exact) == evaluation_steps(len(ps), methods, (0.0, 1.0), repeats,
                                                                              paired, batch_sizes, 8, exact)
    # the exact pass: each prompt's reference decode, then each prompt once per row at T = 0
    assert plan.steps(methods, repeats, paired, 8, True) - plan.steps(methods, repeats, paired, 8) == len(ps) * 5
    wide = plan_budget(ps, methods, (0.0, 1.0), batch_sizes, budget_s=1e9, decode_s=1.0, repeats=repeats,
                       paired=paired, batch_prompts=8, max_new_tokens=32)
    assert (wide.prompts, wide.temperatures, wide.batch_sizes) == (plan.prompts, plan.temperatures, plan.batch_sizes)
    assert wide.record["left_out"] == {"rows": [], "prompts": [], "batch_sizes": []}


def test_a_tight_budget_scores_every_domain_and_the_report_says_what_it_left_out(monkeypatch, tmp_path,
                                                                                 smollm2_tokenizer):
    """A real evaluation on a tiny target with a budget that fits nothing: the n-gram baseline still decodes one
    prompt of each domain at T=0 (lossless checked on each by the exact pass, priced from a timed exact decode),
    the early-exit row and T=1 are left out and the report (JSON and Markdown) says so; the bar's total is the
    reports made, the exact pass's included."""
    import json

    import specheads.evaluation.suite as suite
    from specheads.evaluation.prompts import BenchmarkSpec
    from specheads.evaluation.report import write_report
    from specheads.evaluation.suite import EvalConfig, evaluate
    from specheads.targets import Target
    from tests.conftest import make_tiny_model

    target = Target(make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0), smollm2_tokenizer,
                    name="tiny")
    real = suite.load_benchmarks(BenchmarkSpec(mtbench_per_category=2, mtbench_turns=(1,), humaneval=0, chat=0))
    prompts = [p for p in real if p.domain in ("coding", "math", "writing")]  # 3 domains x 2 questions
    monkeypatch.setattr(suite, "load_benchmarks", lambda spec: prompts)
    methods = [MethodSpec("early_exit1-chain2", "early_exit", TreeShape("chain", k=2), early_exit_layers=1),
               MethodSpec("ngram-chain2", "ngram", TreeShape("chain", k=2))]
    cfg = EvalConfig(methods, BenchmarkSpec(), max_new_tokens=3, temperatures=(0.0, 1.0), batch_sizes=(1, 2),
                     repeats=1, max_minutes=1e-6, cpu_linears="plain", cpu_threads=1)
    totals, reports = [], []
    report = evaluate(target, cfg, progress=reports.append, resized=totals.append)
    assert totals == [len(reports)]
    firsts = [p.id for p in prompt_order(prompts)[:3]]
    assert report["prompt_ids"] == [p.id for p in prompts if p.id in firsts] and report["num_prompts"] == 3
    assert [m["name"] for m in report["methods"]] == ["ngram-chain2"]
    row = report["methods"][0]
    assert set(row["by_temperature"]) == {"0.0"} and set(row["by_temperature"]["0.0"]) == {"coding", "math",
                                                                                          "writing", "all"}
    assert row["lossless"]["checked"] == 3 and row["lossless"]["pass"] == "exact" and row["batch"] == {}
    b = report["budget"]
    assert b["over_budget"] and b["prompts"] == 3 and b["of"] == 6 and b["decode_s"] > 0
    assert b["exact_decode_s"] > 0 and b["exact_cost"] > 0 and b["exact_s"] > 0
    assert b["left_out"]["rows"] == [{"method": "early_exit1-chain2", "temperatures": [0.0, 1.0]},
                                     {"method": "ngram-chain2", "temperatures": [1.0]}]
    assert sorted(b["left_out"]["prompts"]) == sorted(set(p.id for p in prompts) - set(firsts))
    assert b["left_out"]["batch_sizes"] == [{"method": "ngram-chain2", "batch_sizes": [2]}]
    assert set(report["plain_by_temperature"]) == {"0.0"}
    write_report(report, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["budget"]["left_out"] == b["left_out"]
    md = (tmp_path / "report.md").read_text()
    assert "3 prompts (of 6: the time budget's, below)" in md
    assert ("first one prompt of each of the 3 domains for ngram-chain2 at T=0.0 with their exact pass (more than "
            "the budget holds: "
            "evaluated anyway). Left out for time: row early_exit1-chain2 entirely; row ngram-chain2 at T=1.0; "
            "3 of 6 prompts (") in md
    assert "ngram-chain2 at batch size 2." in md

    cfg.max_minutes = 1e4  # a wide budget: everything, nothing left out
    wide = evaluate(target, cfg)
    assert wide["num_prompts"] == 6 and [m["name"] for m in wide["methods"]] == [m.name for m in methods]
    assert wide["budget"]["left_out"] == {"rows": [], "prompts": [], "batch_sizes": []}
    write_report(wide, tmp_path)
    assert "Nothing was left out." in (tmp_path / "report.md").read_text()


def test_the_suffix_baseline_asked_for_is_in_the_core_beside_the_ngram_one():
    """A head-to-head asks for both model-free baselines: on a budget that holds only the core, each still scores
    every domain at T=0 beside the head; a baseline that needs a model (early exit) is not bought first."""
    ps = _set()
    methods = _main_job_methods() + [MethodSpec("suffix-chain4", "suffix", TreeShape("chain", k=4)),
                                     MethodSpec("early-exit", "early_exit", TreeShape("chain", k=4))]
    plan = _plan(ps, methods, 1.0)
    assert plan.record["core"]["methods"] == ["eagle3-auto", "ngram-chain4", "suffix-chain4"]
    assert 0.0 in plan.temperatures[4] and not plan.temperatures[5]
