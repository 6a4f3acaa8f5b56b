"""The measured noise floor: before the first candidate, the baseline's production server is benchmarked against
an independently started copy of itself (an A/A), interleaved exactly as a candidate would be. Its spread gives
the smallest speedup the configured repetitions can detect; a run that cannot see what acceptance.min_speedup
asks it to see says so before the first candidate."""
from __future__ import annotations

import math

import numpy as np
from scipy import stats

from agent.stages import bench
from agent.stages.stats import look_statistics, order_signs
from agent.world.task import Task
from traces.errors import NightshiftError
from traces.schema import NoiseFloor

POWER = 0.9
"""The probability at which an effect counts as detectable."""


class NoiseFloorFailed(NightshiftError):
    stage = "benchmark"


def _df(n: int) -> int:
    return n - 2 if n >= 3 else n - 1


def mde_log(sd: float, n: int, confidence: float, power: float = POWER) -> float:
    """Smallest true log speedup that n pairs accept against no change with probability `power`."""
    df = _df(n)
    return float((stats.t.isf((1 - confidence) / 2, df) + stats.t.ppf(power, df)) * sd / math.sqrt(n))


def pairs_needed(sd: float, min_speedup: float, confidence: float, power: float = POWER,
                 limit: int = 100_000) -> int | None:
    """Pairs at which the MDE reaches min_speedup (None: min_speedup is 1, or beyond `limit`)."""
    if min_speedup <= 1.0:
        return None
    target = math.log(min_speedup)
    n = max(3, math.ceil(((stats.norm.isf((1 - confidence) / 2) + stats.norm.ppf(power)) * sd / target) ** 2))
    while n <= limit and mde_log(sd, n, confidence, power) > target:
        n += 1
    return n if n <= limit else None


def residual_sd(logs: list[float], signs: np.ndarray) -> float:
    """SD of the per-pair log ratios with the pair order taken out (as the decision's model does)."""
    n = len(logs)
    _, se, _ = look_statistics(np.asarray(logs), signs, n)
    det = n * n - float(signs.sum()) ** 2
    return float(se) * math.sqrt(det / n if n >= 3 and det > 0 else n)


def summarize(task: Task, samples, estimate) -> NoiseFloor:
    b, a = task.benchmark, task.acceptance
    metric = bench.sample_metric(task)
    first = [getattr(s, metric) for s in samples if s.role == "incumbent"]
    second = [getattr(s, metric) for s in samples if s.role == "candidate"]
    logs = [math.log(p / i) for p, i in zip(second, first)]
    sd = residual_sd(logs, order_signs([s.role for s in samples]))
    n = len(logs)
    mde = math.exp(mde_log(sd, n, a.confidence))
    mde_max = math.exp(mde_log(sd, b.max_repetitions, a.confidence)) if b.max_repetitions else None
    needed = pairs_needed(sd, a.min_speedup, a.confidence)
    reachable = b.max_repetitions or n
    warning = ""
    if (mde_max or mde) > a.min_speedup:
        setting = "benchmark.max_repetitions" if b.max_repetitions else "benchmark.repetitions"
        warning = (f"noise floor: {reachable} paired repetitions detect only {mde_max or mde:.3f}x at {POWER:.0%} "
                   f"power (A/A log-ratio SD {sd:.3f}), above acceptance.min_speedup {a.min_speedup}: smaller wins "
                   f"will not be seen; raise {setting} to "
                   + (f"about {needed}" if needed else "far more")
                   + " or lower the noise (a quieter machine; longer passes buy no more than more pairs)")
    cv = lambda v: float(np.std(v, ddof=1) / np.mean(v)) if len(v) > 1 else 0.0  # noqa: E731
    return NoiseFloor(metric=metric, samples=samples, cv_incumbent=cv(first), cv_peer=cv(second), log_ratio_sd=sd,
                      speedup=estimate.speedup, ci_low=estimate.ci_low, ci_high=estimate.ci_high,
                      confidence=a.confidence, repetitions=n, mde_speedup=mde, max_repetitions=b.max_repetitions,
                      mde_speedup_max=mde_max, power=POWER, pairs_needed=needed, warning=warning)
