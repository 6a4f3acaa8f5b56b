import math

import numpy as np
import pytest
from scipy import stats

from agent.stages.stats import estimate_speedup


def test_clear_speedup_is_accepted_with_its_interval():
    inc = [100.0, 102.0, 98.0, 101.0, 99.0]
    cand = [150.0, 152.0, 149.0, 151.0, 148.0]
    est = estimate_speedup(cand, inc, min_speedup=1.05, confidence=0.95)
    logs = np.log(np.array(cand) / np.array(inc))
    assert est.speedup == pytest.approx(math.exp(logs.mean()))
    low, high = stats.t.interval(0.95, 4, loc=logs.mean(), scale=stats.sem(logs))
    assert (est.ci_low, est.ci_high) == (pytest.approx(math.exp(low)), pytest.approx(math.exp(high)))
    assert est.ci_low < est.speedup < est.ci_high
    assert est.accepted and est.p_value < 0.001


def test_noise_is_not_a_win():
    rng = np.random.default_rng(1)
    inc = list(100 + rng.normal(0, 8, 5))
    cand = list(104 + rng.normal(0, 8, 5))
    est = estimate_speedup(cand, inc, min_speedup=1.02, confidence=0.95)
    assert not est.accepted
    assert est.ci_low < 1.0


def test_real_but_small_speedup_below_the_minimum_is_not_accepted():
    inc = [100.0, 100.5, 99.5, 100.2, 99.8]
    cand = [103.0, 103.4, 102.6, 103.1, 102.9]
    assert estimate_speedup(cand, inc, min_speedup=1.0, confidence=0.95).accepted
    assert not estimate_speedup(cand, inc, min_speedup=1.05, confidence=0.95).accepted


def test_input_errors():
    with pytest.raises(ValueError):
        estimate_speedup([1.0], [1.0], 1.0, 0.95)
    with pytest.raises(ValueError):
        estimate_speedup([1.0, 0.0], [1.0, 1.0], 1.0, 0.95)
