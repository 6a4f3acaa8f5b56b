"""One error budget for the night (acceptance.night_alpha): candidate k's benchmark is tested one-sided at
night_alpha x 6 / (pi k)^2, a share of a convergent series, so P(any false keep) <= sum of shares < night_alpha
over any number of candidates (a union bound; confirmations only lower each candidate's chance). The count k is
read from the trace's `error_spent` records, so a resumed run continues it rather than starting afresh."""
from __future__ import annotations

import math

from traces.schema import ErrorSpent


def share(night_alpha: float, index: int) -> float:
    return night_alpha * 6.0 / (math.pi * index) ** 2


def spent_through(night_alpha: float, index: int) -> float:
    return sum(share(night_alpha, i) for i in range(1, index + 1))


def spend(night_alpha: float, candidate: int, index: int) -> ErrorSpent:
    alpha = share(night_alpha, index)
    return ErrorSpent(candidate=candidate, index=index, alpha=alpha, spent=spent_through(night_alpha, index),
                      night_alpha=night_alpha, confidence=1.0 - 2.0 * alpha)


def spent_index(events: list) -> int:
    """How many shares the run's trace has recorded so far (`events`: its records' events)."""
    return sum(isinstance(event, ErrorSpent) for event in events)
