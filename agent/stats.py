"""Paired speedup statistics over interleaved repetitions."""
from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel
from scipy import stats


class SpeedupEstimate(BaseModel):
    speedup: float
    ci_low: float
    ci_high: float
    confidence: float
    p_value: float
    """One-sided: the chance of ratios this high if the true speedup were only min_speedup."""
    accepted: bool


def accepts(ci_low: float, min_speedup: float) -> bool:
    """The acceptance rule: the whole interval lies above min_speedup."""
    return ci_low > min_speedup


def estimate_speedup(candidate: list[float], incumbent: list[float], min_speedup: float,
                     confidence: float) -> SpeedupEstimate:
    """Geometric-mean speedup of paired repetitions with a t-interval on the log ratios.

    Accepted only if the whole `confidence` interval lies above min_speedup, i.e. a one-sided
    t-test rejects "speedup <= min_speedup" at level (1 - confidence) / 2."""
    if len(candidate) != len(incumbent) or len(candidate) < 2:
        raise ValueError("need at least two paired repetitions")
    if min(candidate + incumbent) <= 0:
        raise ValueError("throughputs must be positive")
    logs = np.log(np.asarray(candidate) / np.asarray(incumbent))
    mean = float(logs.mean())
    if float(logs.std(ddof=1)) == 0.0:
        p_value = 0.0 if mean > math.log(min_speedup) else 1.0
        low = high = mean
    else:
        p_value = float(stats.ttest_1samp(logs, math.log(min_speedup), alternative="greater").pvalue)
        sem = float(stats.sem(logs))
        low, high = stats.t.interval(confidence, len(logs) - 1, loc=mean, scale=sem)
    return SpeedupEstimate(speedup=math.exp(mean), ci_low=math.exp(low), ci_high=math.exp(high),
                           confidence=confidence, p_value=p_value, accepted=accepts(math.exp(low), min_speedup))
