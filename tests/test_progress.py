"""What the progress bars count and when they say the work ends (specheads.progress), not how they render."""

from __future__ import annotations

import pytest

from specheads.progress import evaluation_steps, minutes, rate_eta, training_position


def test_a_time_budget_counts_its_minutes_not_the_step_cap():
    """The main job: 8 minutes, max_steps 100000. At step 317 after 104 s the bar reads 1.7 of 8.0 minutes with
    376 s left; counting steps it read 317/100000 with an ETA of 7.5 hours."""
    pos = training_position(317, 100_000, 104.0, 480.0)
    assert (pos.unit, pos.done, pos.total) == ("min", pytest.approx(104 / 60), pytest.approx(8.0))
    assert pos.eta_s == pytest.approx(376.0)
    steps_only = training_position(317, 100_000, 104.0, None)
    assert steps_only.eta_s > 7 * 3600  # what the old bar promised


def test_the_steps_end_first_when_they_run_out_before_the_budget():
    pos = training_position(300, 400, 120.0, 480.0)  # 100 steps left at 0.4 s: 40 s, well inside the budget
    assert pos.eta_s == pytest.approx(40.0) and pos.total == pytest.approx(160 / 60)
    assert training_position(400, 400, 160.0, 480.0).eta_s == 0.0


def test_without_a_budget_the_bar_counts_steps():
    pos = training_position(50, 200, 25.0, None)
    assert (pos.done, pos.total, pos.unit) == (50, 200, "step") and pos.eta_s == pytest.approx(75.0)
    assert training_position(0, 200, 0.0, None).eta_s is None  # no pace yet
    assert training_position(0, 200, 0.0, 480.0).eta_s == 480.0  # the budget is known from the start


def test_rate_eta_and_its_format():
    assert rate_eta(25, 100, 10.0) == pytest.approx(30.0) and rate_eta(0, 100, 5.0) is None
    assert (minutes(376), minutes(7 * 3600 + 5), minutes(None)) == ("6:16", "7:00:05", "?")


@pytest.mark.parametrize("paired,repeats,batch_sizes", [(True, 1, (1,)), (False, 2, (1, 3)), (True, 2, (2,))])
def test_evaluation_total_is_the_number_of_progress_reports(smollm2_tokenizer, monkeypatch, paired, repeats,
                                                            batch_sizes):
    """The evaluation bar's total equals the reports the real evaluation makes (tiny target, n-gram and
    early-exit drafters), so its ETA reaches zero when the evaluation ends."""
    import specheads.evaluation.suite as suite
    from specheads.decoding.drafters import TreeShape
    from specheads.evaluation.prompts import BenchmarkSpec
    from specheads.evaluation.suite import EvalConfig, MethodSpec, evaluate
    from specheads.targets import Target
    from tests.conftest import make_tiny_model

    target = Target(make_tiny_model(vocab=len(smollm2_tokenizer), hidden=32, layers=2, seed=0), smollm2_tokenizer,
                    name="tiny")
    real = suite.load_benchmarks
    prompts = [p for p in real(BenchmarkSpec(mtbench_per_category=None, mtbench_turns=(1,), humaneval=0, chat=0))
               if p.domain == "coding"][:3]
    monkeypatch.setattr(suite, "load_benchmarks", lambda spec: prompts)
    methods = [MethodSpec("ngram", "ngram", TreeShape("chain", k=2)),
               MethodSpec("ee", "early_exit", TreeShape("chain", k=2), early_exit_layers=1)]
    cfg = EvalConfig(methods, BenchmarkSpec(), max_new_tokens=3, temperatures=(0.0, 1.0), batch_sizes=batch_sizes,
                     batch_prompts=3, repeats=repeats, paired=paired, cpu_linears="plain")
    reports, totals = [], []
    evaluate(target, cfg, progress=reports.append, resized=totals.append)  # a CPU target: with an exact pass
    assert len(reports) == evaluation_steps(len(prompts), methods, cfg.temperatures, cfg.repeats, cfg.paired,
                                            cfg.batch_sizes, cfg.batch_prompts, exact=True) == totals[0]
    assert sum("exact pass" in r for r in reports) == len(prompts) * (1 + len(methods))


def _bar(tmp_path, monkeypatch, max_steps: int, max_minutes: float | None, start_step: int = 0):
    """The training loop's real bar (``RunLogger``, tqdm writing to a buffer), as the engine drives it."""
    import io

    import tqdm.auto

    from specheads.training.config import TrainConfig
    from specheads.training.run_log import RunLogger

    monkeypatch.delenv("WANDB_MODE", raising=False)
    buffer = io.StringIO()
    real = tqdm.auto.tqdm
    monkeypatch.setattr(tqdm.auto, "tqdm", lambda *a, **k: real(*a, file=buffer, mininterval=0, **k))
    cfg = TrainConfig(output_dir=str(tmp_path), max_steps=max_steps, max_minutes=max_minutes, wandb_mode="disabled",
                      progress=True)
    accelerator = type("Main", (), {"is_main_process": True})()
    return RunLogger(cfg, tmp_path, accelerator, "eagle3", start_step), buffer


@pytest.mark.parametrize("max_steps,max_minutes,start_step,clock", [
    (400, 2.0, 0, [(1, 200.0)]),                      # the first step alone outlasts the budget (+0.5 min)
    (400, 2.0, 0, [(1, 60.0), (2, 125.0), (3, 190.0)]),  # a step slower than the budget expects, then past it
    (3, 2.0, 0, [(1, 10.0), (2, 20.0), (3, 30.0)]),     # the step cap ends the run long before the budget
    (400, 2.0, 120, [(121, 100.0), (122, 170.0)]),      # a resumed run: its clock restored with its step
    (100, None, 150, [(151, 10.0)]),                    # resumed past a lowered step cap, no budget
])
def test_the_training_bar_survives_any_mix_of_step_cap_and_budget(tmp_path, monkeypatch, max_steps, max_minutes,
                                                                    start_step, clock):
    """A 2-minute budget on a slow CPU: its first step took longer than the budget, and tqdm, finding the count
    past the total, dropped the total; the bar's '{total:.1f}' then raised TypeError out of the training loop."""
    logger, buffer = _bar(tmp_path, monkeypatch, max_steps, max_minutes, start_step)
    for step, train_s in clock:
        logger.progress(step, 2.5, 1e-3, train_s)
        pos = training_position(step, max_steps, train_s, 60 * max_minutes if max_minutes else None)
        assert pos.done <= pos.total
    logger.progress(clock[-1][0], None, None, clock[-1][1])  # a loss or rate not known: shown as '?'
    logger.end_progress()
    assert "ETA" in buffer.getvalue() and "loss ?" in buffer.getvalue()


def test_a_step_past_the_budget_reads_as_the_end():
    pos = training_position(1, 400, 200.0, 120.0)
    assert (pos.done, pos.total, pos.eta_s) == (pytest.approx(200 / 60), pytest.approx(200 / 60), 0.0)
