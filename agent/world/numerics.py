"""How close a model's greedy choices are: the margin summary that the checkpoint records when it
is written and the run records for the served model."""
from __future__ import annotations

from pydantic import BaseModel


class Margins(BaseModel):
    """Top-1 minus top-2 log-probability (nats), teacher-forced over random prompts."""

    median: float
    p10: float
    p90: float
    below_0_1: float
    positions: int

    @classmethod
    def of(cls, margins) -> Margins:
        import numpy as np

        values = np.asarray(margins, dtype=float)
        p10, median, p90 = np.quantile(values, [0.1, 0.5, 0.9])
        return cls(median=round(float(median), 4), p10=round(float(p10), 4), p90=round(float(p90), 4),
                   below_0_1=round(float((values < 0.1).mean()), 4), positions=int(values.size))
