"""An evaluation killed part way takes up its plain pass and finished methods on a re-run (nothing decoded twice, the
same figures as an evaluation never interrupted); other settings, a decision measured otherwise now, or a damaged
state file start it over."""

from __future__ import annotations

import logging

import pytest

from tests.conftest import make_tiny_model
from specheads.decoding.drafters import TreeShape
from specheads.evaluation.prompts import BenchmarkSpec
from specheads.evaluation.report import markdown
from specheads.evaluation.resume import STATE_FILE, EvalResume, EvalState
from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate
from specheads.targets import Target

NAMES = ("ngram-chain2", "ngram-chain3", "ngram-chain4")


@pytest.fixture(scope="module")
def target(smollm2_tokenizer):
    model = make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0)
    return Target(model, smollm2_tokenizer, name="tiny-smollm2-vocab")


@pytest.fixture
def suite(monkeypatch):
    import specheads.evaluation.suite as suite

    real = suite.load_benchmarks
    monkeypatch.setattr(suite, "load_benchmarks", lambda s: [p for p in real(s) if p.domain == "coding"][:2])
    return suite


def config(max_new_tokens: int = 8) -> EvalConfig:
    methods = [MethodSpec(name, "ngram", TreeShape("chain", k=int(name[-1]))) for name in NAMES]
    return EvalConfig(methods, BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=0, chat=0),
                      max_new_tokens=max_new_tokens, temperatures=(0.0,), batch_sizes=(1,), repeats=1,
                      cpu_linears="plain", cpu_threads=1)


def interrupted(suite, target, folder, monkeypatch) -> None:
    """An evaluation killed as it starts its third method."""
    real = suite.build_drafter

    def dying(spec, *a, **k):
        if spec.name == NAMES[2]:
            raise KeyboardInterrupt
        return real(spec, *a, **k)

    monkeypatch.setattr(suite, "build_drafter", dying)
    with pytest.raises(KeyboardInterrupt):
        evaluate(target, config(), resume=EvalResume(folder))
    monkeypatch.setattr(suite, "build_drafter", real)
    assert (folder / STATE_FILE).is_file()


def counting(suite, monkeypatch) -> dict:
    calls = {"plain": 0, "built": []}
    plain, build = suite._plain_pass, suite.build_drafter

    def counted_plain(*a, **k):
        calls["plain"] += 1
        return plain(*a, **k)

    def counted_build(spec, *a, **k):
        calls["built"].append(spec.name)
        return build(spec, *a, **k)

    monkeypatch.setattr(suite, "_plain_pass", counted_plain)
    monkeypatch.setattr(suite, "build_drafter", counted_build)
    return calls


def test_an_interrupted_evaluation_decodes_only_what_is_left(suite, target, tmp_path, monkeypatch):
    interrupted(suite, target, tmp_path, monkeypatch)
    calls = counting(suite, monkeypatch)
    report = evaluate(target, config(), resume=EvalResume(tmp_path))
    assert calls == {"plain": 0, "built": [NAMES[2]]}
    assert [m["name"] for m in report["methods"]] == list(NAMES)
    assert report["resumed"] == [{"methods_taken_up": list(NAMES[:2])}]
    assert "Taken up after an interruption: the plain pass and ngram-chain2, ngram-chain3 method rows" in \
        markdown(report)
    fresh = evaluate(target, config())
    for taken, never in zip(report["methods"], fresh["methods"]):
        a, b = taken["by_temperature"]["0.0"]["all"], never["by_temperature"]["0.0"]["all"]
        assert (a["tau"], a["alpha"], a["new_tokens"], taken["lossless"]) == (b["tau"], b["alpha"], b["new_tokens"],
                                                                             never["lossless"])


def test_other_settings_or_another_measured_decision_start_over(suite, target, tmp_path, monkeypatch, caplog):
    interrupted(suite, target, tmp_path, monkeypatch)
    calls = counting(suite, monkeypatch)
    evaluate(target, config(max_new_tokens=6), resume=EvalResume(tmp_path))  # other settings
    assert calls["plain"] == 1 and calls["built"] == list(NAMES)

    interrupted(suite, target, tmp_path, monkeypatch)
    calls = counting(suite, monkeypatch)
    real = suite.choose_cpu_threads
    monkeypatch.setattr(suite, "choose_cpu_threads", lambda model, mode: {**real(model, mode), "threads": 7})
    with caplog.at_level(logging.WARNING):
        evaluate(target, config(), resume=EvalResume(tmp_path))
    assert calls["plain"] == 1 and calls["built"] == list(NAMES) and "starts over" in caplog.text


def test_a_damaged_or_foreign_state_file_is_not_trusted(tmp_path, caplog):
    resume = EvalResume(tmp_path)
    state = EvalState("k", plan=None, ids={}, plain={}, report={"methods": []}, chosen={}, done=1)
    resume.save(state)
    assert resume.load("k").done == 1 and resume.load("other") is None
    raw = bytearray(resume.path.read_bytes())
    raw[-3] ^= 0xFF
    resume.path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert resume.load("k") is None
    assert "damaged" in caplog.text
    resume.path.write_bytes(b"not a state file")
    assert resume.load("k") is None
    resume.clear()
    assert not resume.path.exists() and resume.load("k") is None
