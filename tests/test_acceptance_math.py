"""specheads.acceptance_math against brute-force enumeration of every accept/reject sequence."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from specheads import acceptance_math as am


def _brute(k: int, prob) -> dict:
    """Enumerate all 2^k accept/reject outcomes of a chain of k drafts with ``prob(outcome)``; a step
    emits its leading accepted drafts plus the bonus. Returns E[tokens], the joint P(L ≥ j), the
    conditional P(j accepted | 1..j-1 accepted) and the marginal P(j accepted on its own)."""
    outcomes = list(itertools.product((0, 1), repeat=k))
    P = {o: prob(o) for o in outcomes}
    assert math.isclose(sum(P.values()), 1.0)
    lead = {o: next((i for i, x in enumerate(o) if not x), k) for o in outcomes}
    tau = sum(P[o] * (lead[o] + 1) for o in outcomes)
    joint = [sum(P[o] for o in outcomes if lead[o] >= j) for j in range(1, k + 1)]
    cond = [joint[0]] + [joint[j] / joint[j - 1] if joint[j - 1] else 0.0 for j in range(1, k)]
    marg = [sum(P[o] for o in outcomes if o[j]) for j in range(k)]
    return {"tau": tau, "joint": joint, "conditional": cond, "marginal": marg}


def _independent(ps):
    return lambda o: math.prod(p if x else 1 - p for p, x in zip(ps, o))


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_independent_drafts_every_basis_is_exact(k):
    rng = random.Random(k)
    ps = [rng.uniform(0.05, 0.95) for _ in range(k)]
    b = _brute(k, _independent(ps))
    for basis in am.BASES:
        assert am.chain_tau(b[basis], basis) == pytest.approx(b["tau"], rel=1e-12), basis
    assert am.reach_probabilities(b["conditional"], "conditional") == pytest.approx(b["joint"])
    assert b["marginal"] == pytest.approx(ps)


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_dependent_drafts_joint_and_conditional_exact_marginal_not(k):
    """Any distribution over the 2^k outcomes (errors that cluster): joint and conditional
    accuracies give τ exactly; the product of marginals is only an approximation."""
    rng = random.Random(100 + k)
    w = {o: rng.random() for o in itertools.product((0, 1), repeat=k)}
    z0 = sum(w.values())
    w[(1,) * k] += z0 / 2  # all right or all wrong together more often than independence would say
    w[(0,) * k] += z0 / 2
    z = sum(w.values())
    b = _brute(k, lambda o: w[o] / z)
    assert am.chain_tau(b["joint"], "joint") == pytest.approx(b["tau"], rel=1e-12)
    assert am.chain_tau(b["conditional"], "conditional") == pytest.approx(b["tau"], rel=1e-12)
    assert abs(am.chain_tau(b["marginal"], "marginal") - b["tau"]) > 0.01


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_leviathan_closed_forms(alpha, k):
    b = _brute(k, _independent([alpha] * k))
    assert am.leviathan_tau(alpha, k) == pytest.approx(b["tau"])
    c = 0.07
    assert am.leviathan_speedup(alpha, c, k) == pytest.approx(b["tau"] / (1 + c * k))
    assert am.speedup_from_tau(b["tau"], c * k) == pytest.approx(am.leviathan_speedup(alpha, c, k))
    assert am.speedup_from_tau(3.0, 0.5, verify_cost=1.5) == pytest.approx(1.5)


def test_estimate_tau_one_preference_order():
    """Joint families first (EAGLE joint{i}, Medusa chain{i}), then marginal step{i} / head{i};
    indices from 0 up to the first missing or NaN one; k cuts the chain."""
    m = {"joint0_acc": 0.6, "joint1_acc": 0.3, "step0_acc": 0.6, "step1_acc": 0.9,
         "chain0_acc": 0.1, "head0_top1_acc": 0.1}
    tau, basis = am.estimate_tau(m)
    assert tau == pytest.approx(1.9) and basis.startswith("joint:")
    assert am.estimate_tau(m, k=1)[0] == pytest.approx(1.6)
    med = {"chain0_acc": 0.5, "chain1_acc": 0.25, "head0_top1_acc": 0.5, "head0_top5_acc": 0.9}
    assert am.estimate_tau(med) == (pytest.approx(1.75), am.estimate_tau(med)[1])
    assert am.estimate_tau(med)[1].startswith("chain:")
    marg = {"step0_top1_acc": 0.8, "step1_top1_acc": 0.5, "step3_top1_acc": 0.9, "head0_top5_acc": 0.99}
    tau, basis = am.estimate_tau(marg)
    assert tau == pytest.approx(1 + 0.8 + 0.4) and "marginal" in basis  # stops at the missing step2
    assert am.estimate_tau({"head0_top1_acc": 0.5, "head1_top1_acc": float("nan")})[0] == pytest.approx(1.5)
    assert am.estimate_tau({"joint1_acc": 0.5})[0] is None  # nothing from index 0
    assert am.estimate_tau({"loss": 1.0}) == (None, "no per-draft accuracies reported")


def test_one_home():
    """The duplicates are gone: training and evaluation use acceptance_math's functions."""
    import specheads.evaluation.metrics as metrics
    import specheads.training.acceptance as acceptance
    import specheads.training.heldout as heldout

    assert heldout.estimate_tau is am.estimate_tau
    assert not hasattr(acceptance, "estimate_for_chain")
    assert not hasattr(metrics, "expected_tokens") and not hasattr(metrics, "leviathan_speedup")
    import specheads.methods.ttt as ttt

    assert not hasattr(heldout, "chain_tau") and not hasattr(ttt, "tau_estimate")  # no wrappers left either


def test_counter_figures_of_a_chain():
    """vLLM's counters: 10 drafting steps of a chain of 3, positions accepted 6, 3, 1 times."""
    fig = am.counter_figures(drafts=10, draft_tokens=30, accepted=10, accepted_per_pos=[6, 3, 1])
    assert fig["tau"] == pytest.approx(2.0)
    assert fig["reach"] == pytest.approx([0.6, 0.3, 0.1])
    assert am.chain_tau(fig["reach"], "joint") == pytest.approx(fig["tau"])
    assert fig["alpha_by_position"] == pytest.approx([0.6, 0.5, 1 / 3])
    assert fig["alpha"] == pytest.approx(10 / 19)  # tested: 10 steps at position 0, 6 at 1, 3 at 2
    assert fig["draft_acceptance_rate"] == pytest.approx(1 / 3)
    empty = am.counter_figures(0, 0, 0, [0, 0])
    assert empty["tau"] is None and empty["alpha"] is None and empty["reach"] == [None, None]


def test_accepted_length_variance_and_tau_error():
    """Var(L) from the reach probabilities equals the variance of L's own distribution."""
    rng = random.Random(0)
    for _ in range(20):
        k = rng.randint(1, 5)
        probs = [rng.random() for _ in range(k + 1)]
        probs = [p / sum(probs) for p in probs]  # P(L = 0..k)
        reach = [sum(probs[j:]) for j in range(1, k + 1)]
        mean = sum(j * p for j, p in enumerate(probs))
        var = sum((j - mean) ** 2 * p for j, p in enumerate(probs))
        assert am.accepted_length_variance(reach) == pytest.approx(var, abs=1e-12)
        assert am.tau_standard_error(reach, 400) == pytest.approx(math.sqrt(var / 400))
    assert am.tau_standard_error([0.5], 0) is None
    assert am.proportion_standard_error(0.5, 100) == pytest.approx(0.05)


def test_beyond_noise():
    assert am.beyond_noise(0.5, 0.05, 0.1, 0.05) is True      # 0.4 apart, se of the difference 0.07
    assert am.beyond_noise(0.5, 0.05, 0.4, 0.05) is False
    assert am.beyond_noise(0.5, 0.0, 0.5, 0.0) is False and am.beyond_noise(0.5, 0.0, 0.4, 0.0) is True
    assert am.beyond_noise(0.5, None, 0.4, 0.1) is None
