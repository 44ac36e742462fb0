import pytest
import torch

from specheads.training.schedule import make_scheduler, warmup_cosine


def test_warmup_then_cosine_to_floor():
    vals = [warmup_cosine(s, 4, 20, 0.1) for s in range(25)]
    assert vals[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert vals[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(vals[4:20], vals[5:21]))  # decays monotonically
    assert vals[20] == pytest.approx(0.1) and vals[24] == pytest.approx(0.1)
    assert vals[12] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay


def test_scheduler_drives_optimizer_lr_and_rejects_bad_kind():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sch = make_scheduler(opt, warmup_steps=0, total_steps=10, kind="constant")
    for _ in range(5):
        opt.step()
        sch.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        make_scheduler(opt, 0, 10, kind="linear")


def test_time_budget_drives_the_decay_when_it_runs_out_first():
    from specheads.training.schedule import TimeBudget

    # 1000 planned steps but a 100 s budget: half the budget used means half the decay, whatever the step.
    assert warmup_cosine(20, 10, 1000, 0.0, time_fraction=0.5) == pytest.approx(0.5)
    assert warmup_cosine(20, 10, 1000, 0.0, time_fraction=1.0) == pytest.approx(0.0)
    assert warmup_cosine(5, 10, 1000, 0.0, time_fraction=0.9) == pytest.approx(6 / 11)  # warm-up first
    assert warmup_cosine(990, 10, 1000, 0.0, time_fraction=0.1) < 1e-3  # the steps, when ahead
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    clock = [0.0]
    budget = TimeBudget(100.0, lambda: clock[0])
    sch = make_scheduler(opt, 0, 1000, 0.0, budget=budget)
    clock[0] = 100.0
    opt.step()
    sch.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="positive"):
        TimeBudget(0, lambda: 0.0)
