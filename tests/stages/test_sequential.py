"""The group-sequential rule, checked by simulation: its error at the task's confidence, its power at +5%, and
ABBA order with the order as a model term. Vectorized over thousands of runs (agent.stages.stats.simulate is the same
rule the benchmark applies one pair at a time)."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from agent.stages.stats import (estimate_speedup, look_statistics, obf_spending, order_signs, plan_looks,
                         sequential_estimate, simulate, z_boundaries)
from agent.world.task import load_task

ROOT = Path(__file__).resolve().parents[2]
E2B = load_task(ROOT / "tasks" / "gemma4-e2b.yaml")
LOOKS = plan_looks(E2B.benchmark.repetitions, E2B.benchmark.max_repetitions, E2B.benchmark.look_every)
ALPHA = (1 - E2B.acceptance.confidence) / 2
SD_H200 = 0.1
"""SD of the per-pair log ratios of the stock E2B server against itself on the H200."""
RUNS = 2000


def abba(n: int) -> np.ndarray:
    return np.where(np.arange(n) % 2 == 0, 1.0, -1.0)


def recorded_aa() -> np.ndarray:
    """Every recorded A/A's per-pair log ratios, each with its mirror image: the two servers of an A/A are
    exchangeable, so its log ratio is symmetric about 0 (a stall of either server is equally likely)."""
    pools = []
    for path in sorted((ROOT / "tests" / "data").glob("aa-*.json")):
        logs = np.asarray(json.loads(path.read_text())["log_ratios"])
        pools += [logs, -logs]
    return np.concatenate(pools)


def test_boundaries_are_lan_demets_obrien_fleming():
    # Published values for five equally spaced looks, one-sided 0.025 (Jennison & Turnbull 2000, table 2.1 style)
    assert z_boundaries((1, 2, 3, 4, 5), 0.025) == pytest.approx((4.877, 3.357, 2.680, 2.290, 2.031), abs=2e-3)
    assert obf_spending(1.0, 0.025) == pytest.approx(0.025)
    assert z_boundaries((6,), 0.025)[0] == pytest.approx(stats.norm.isf(0.025))


def test_one_look_is_the_t_test_and_the_interval_matches_the_rule():
    rng = np.random.default_rng(3)
    logs = list(rng.normal(0.05, 0.03, 6))
    estimate, seq = sequential_estimate(logs, list(abba(6)), [6], 0.95, 1.02)
    mu, se, df = look_statistics(np.asarray(logs), abba(6), 6)
    assert df == 4 and seq.looks[0].boundary == pytest.approx(stats.t.isf(0.025, 4))
    assert estimate.ci_low == pytest.approx(math.exp(mu - stats.t.isf(0.025, 4) * se))
    assert estimate.accepted == (estimate.ci_low > 1.02) == (seq.stopped == "efficacy")


def test_the_vectorized_rule_is_the_one_the_benchmark_applies():
    rng = np.random.default_rng(4)
    n = LOOKS[-1]
    logs = rng.normal(0.03, SD_H200, (40, n))
    accepted, used = simulate(logs, abba(n), LOOKS, ALPHA, E2B.acceptance.min_speedup)
    for row, ok, pairs in zip(logs, accepted, used):
        estimate, seq = sequential_estimate(list(row), list(abba(n)), LOOKS, E2B.acceptance.confidence,
                                            E2B.acceptance.min_speedup)
        assert (estimate.accepted, seq.looks[-1].pairs) == (ok, pairs)


@pytest.mark.parametrize("source", ["normal", "recorded"])
def test_an_a_a_is_falsely_accepted_no_more_often_than_the_confidence_allows(source):
    rng = np.random.default_rng(5)
    n = LOOKS[-1]
    if source == "normal":
        logs = rng.normal(0.0, SD_H200, (RUNS, n))
    else:
        pool = recorded_aa()
        logs = rng.choice(pool / pool.std() * SD_H200, (RUNS, n))  # the recorded shape, at the H200's spread
    at_task, _ = simulate(logs, abba(n), LOOKS, ALPHA, E2B.acceptance.min_speedup)
    assert at_task.mean() <= ALPHA
    # The worst case, a true speedup equal to the threshold: within two standard errors of alpha.
    at_threshold, _ = simulate(logs, abba(n), LOOKS, ALPHA, 1.0)
    assert at_threshold.mean() <= ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS)


def test_a_true_5_percent_win_is_accepted_at_least_90_percent_of_the_time_at_the_h200_noise():
    rng = np.random.default_rng(6)
    n = LOOKS[-1]
    for logs in (rng.normal(math.log(1.05), SD_H200, (RUNS, n)),
                 math.log(1.05) + rng.choice(recorded_aa() / recorded_aa().std() * SD_H200, (RUNS, n))):
        accepted, used = simulate(logs, abba(n), LOOKS, ALPHA, E2B.acceptance.min_speedup)
        assert accepted.mean() >= 0.9
        assert used.mean() < 0.8 * n  # it stops early on average


def test_an_odd_number_of_pairs_with_a_second_pass_penalty_is_unbiased_with_the_order_term():
    rng = np.random.default_rng(7)
    runs, n, true = 4000, 5, math.log(1.05)
    signs = abba(n)  # +1: the candidate ran second
    for penalty in (0.03, 0.08, 0.14):
        noise = rng.normal(0, 0.02, (runs, n))
        logs = true + noise + signs * math.log(1 - penalty)
        naive = logs.mean(axis=1)  # the geometric mean of the ratios, the estimate before the order term
        mu, _, _ = look_statistics(logs, signs, n)
        assert abs(naive.mean() - true) > 0.15 * penalty  # 3 of 5 pairs had the candidate second
        assert abs(mu.mean() - true) < 0.002
        inc = np.exp(rng.normal(0, 0.01, n)) * 1000
        cand = inc * np.exp(logs[0])
        old = estimate_speedup(list(cand), list(inc), 1.0, 0.95).speedup
        new = sequential_estimate(list(np.log(cand / inc)), list(signs), [n], 0.95, 1.0)[0].speedup
        assert abs(math.log(new) - mu[0]) < 1e-12 and old == pytest.approx(math.exp(naive[0]))


def test_order_signs_follow_the_running_order():
    roles = ["incumbent", "candidate", "candidate", "incumbent", "incumbent", "candidate"]
    assert list(order_signs(roles)) == [1.0, -1.0, 1.0]
