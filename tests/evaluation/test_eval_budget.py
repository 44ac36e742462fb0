"""The evaluation under a time budget: the prompts that fit, spread over the domains."""

from __future__ import annotations

from specheads.data.benchmarks import EvalPrompt
from specheads.evaluation.suite import _spread


def _set():
    ps = []
    for d in ("writing", "math", "code"):
        for i in range(2):
            ps.append(EvalPrompt(f"{d}/{i}/t1", d, ["q", "q2"], 0))
            if d != "code":
                ps.append(EvalPrompt(f"{d}/{i}/t2", d, ["q", "q2"], 1))
    return ps


def test_prompts_are_kept_round_robin_over_domains_with_their_later_turns():
    ps = _set()
    kept = _spread(ps, 3)
    assert [p.id for p in kept] == ["writing/0/t1", "writing/0/t2", "math/0/t1", "math/0/t2"]
    kept = _spread(ps, 5)
    assert {p.domain for p in kept} == {"writing", "math", "code"}
    assert [p.id for p in kept] == ["writing/0/t1", "writing/0/t2", "math/0/t1", "math/0/t2", "code/0/t1"]


def test_a_budget_that_fits_everything_keeps_the_set_in_order():
    ps = _set()
    assert _spread(ps, len(ps)) == ps and _spread(ps, 100) == ps


def test_at_least_one_prompt_is_kept():
    assert [p.id for p in _spread(_set(), 0)] == []  # fit_budget asks for at least one
    assert [p.id for p in _spread(_set(), 1)] == ["writing/0/t1", "writing/0/t2"]


def test_a_tight_budget_evaluates_the_prompts_it_fits_and_a_wide_one_all(monkeypatch, tmp_path):
    """A real evaluation on a tiny target: the budget's decision is recorded, the report scores exactly the
    kept prompts (lossless checked on them), and the bar is told the new size."""
    import specheads.evaluation.suite as suite
    from specheads.decoding.drafters import TreeShape
    from specheads.evaluation.prompts import BenchmarkSpec
    from specheads.evaluation.report import write_report
    from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate

    real_load = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: real_load(s)[:6])
    spec = BenchmarkSpec(mtbench_per_category=1, mtbench_turns=(1,), humaneval=0, chat=0)
    from specheads.targets import load_target

    tgt = load_target("smollm2", "float32", "cpu")
    sizes = []
    cfg = EvalConfig([MethodSpec("ngram", "ngram", TreeShape("chain", k=3))], spec, max_new_tokens=4,
                     temperatures=(0.0,), batch_sizes=(1,), repeats=1, max_minutes=1e-6)
    report = evaluate(tgt, cfg, resized=sizes.append)
    b = report["budget"]
    assert b["prompts"] == 1 == report["num_prompts"] == sizes[0] and b["of"] == 6 and b["decode_s"] > 0
    assert report["prompt_ids"] == [real_load(spec)[0].id]  # the scored prompts, for serve-eval to decode the same
    assert report["methods"][0]["lossless"]["checked"] == 1
    write_report(report, tmp_path)
    assert "1 prompts (of 6: what its 1e-06-minute budget fits" in (tmp_path / "report.md").read_text()
    cfg.max_minutes = 1e4
    wide = evaluate(tgt, cfg)
    assert wide["budget"]["prompts"] == 6 == wide["num_prompts"] == len(wide["prompt_ids"])
