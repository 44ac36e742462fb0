"""The suffix decoding baseline in the evaluator: planned beside the n-gram row, built as a SuffixDrafter, lossless
end to end on a tiny target (greedy, sampled, batched)."""

from __future__ import annotations

import pytest

from tests.conftest import make_tiny_model
from specheads.decoding.suffix_drafter import SuffixDrafter
from specheads.errors import ConfigError
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.suite import EvalConfig, build_drafter, evaluate, plan_methods
from specheads.targets import Target


def test_planned_as_a_chain_of_chain_k_beside_the_ngram_row():
    ngram, suffix = plan_methods(None, None, ["ngram", "suffix"], chain_k=5)
    assert (suffix.name, suffix.drafter, suffix.shape.kind, suffix.shape.k) == ("suffix-chain5", "suffix", "chain", 5)
    assert ngram.shape == suffix.shape
    d = build_drafter(suffix, None)
    assert isinstance(d, SuffixDrafter) and (d.k, d.tree) == (5, False)
    with pytest.raises(ConfigError, match="suffix"):
        plan_methods(None, None, ["suffixes"])


def test_evaluated_lossless_greedy_sampled_and_batched(smollm2_tokenizer, monkeypatch):
    import specheads.evaluation.suite as suite

    target = Target(make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0), smollm2_tokenizer,
                    name="tiny-smollm2-vocab")
    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain in ("coding", "code")][:2])
    cfg = EvalConfig(plan_methods(None, None, ["suffix"], chain_k=3),
                     BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1, 2), humaneval=1, chat=0),
                     max_new_tokens=8, temperatures=(0.0, 1.0), batch_sizes=(1, 2), batch_prompts=2, repeats=1,
                     cpu_linears="plain", cpu_threads=1, exact_forward="off")
    report = evaluate(target, cfg)
    row = report["methods"][0]
    assert (row["name"], row["drafter"], row["shape"]) == ("suffix-chain3", "suffix", "chain3")
    assert row["lossless"]["exact"] and row["batch"]["2"]["matches_batch1_plain"]
    assert set(row["by_temperature"]) == {"0.0", "1.0"}
