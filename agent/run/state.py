"""What a run has done and may still do, kept by the coordinator (agent/run/loop.py) for any number of workers: its
history, keeps, best speedup, the one budget check, and a typed end."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

from agent.proposers.base import Attempt, ProposerExhausted
from traces.errors import end_reason, leaves_resumable
from traces.schema import RunFinished

if TYPE_CHECKING:
    from agent.run.resume import Resumption
    from agent.world.task import Task

EndKind = Literal["candidates", "wall_clock", "gpu_hours", "proposer_exhausted", "proposer_failed", "finishing",
                  "workers", "stopped", "error"]
BUDGET = {"candidates": "budget: candidates", "wall_clock": "budget: wall clock", "gpu_hours": "budget: GPU-hours"}


@dataclass(frozen=True)
class End:
    """Why a run ended: `kind` for code to act on, `reason` the `run_finished` text (unchanged since the first traces)."""
    kind: EndKind
    detail: str = ""

    @property
    def reason(self) -> str:
        if self.kind in BUDGET:
            return BUDGET[self.kind]
        if self.kind in ("proposer_exhausted", "proposer_failed"):
            return f"{self.kind.replace('_', ' ')}: {self.detail}"
        return self.detail

    @classmethod
    def of_proposer(cls, exc: ProposerExhausted) -> End:
        return cls("proposer_failed" if exc.kind == "fatal" else "proposer_exhausted", str(exc))

    @classmethod
    def of_exception(cls, exc: BaseException) -> End:
        reason = end_reason(exc)
        return cls("stopped" if reason.startswith("stopped by") else "error", reason)

    @property
    def failed(self) -> bool:
        """The run could not do its work (the proposer failed): `nightshift run` exits 1."""
        return self.kind == "proposer_failed"


@dataclass
class RunState:
    task: Task
    history: list[Attempt] = field(default_factory=list)
    kept: int = 0
    best_speedup: float = 1.0
    began: float = field(default_factory=time.time)
    """time.time() less the wall clock a resumed run had spent before."""
    gpu_hours: Callable[[], float] = lambda: 0.0
    end: End = End("candidates")
    resumable: bool = False

    @classmethod
    def of(cls, task: Task, resume: Resumption | None, gpu_hours: Callable[[], float] = lambda: 0.0) -> RunState:
        if resume is None:
            return cls(task, gpu_hours=gpu_hours)
        return cls(task, list(resume.history), resume.kept, resume.best_speedup, time.time() - resume.spent_s,
                   gpu_hours)

    def over_budget(self, proposed: int | None) -> End | None:
        """The one budget check, before a candidate is proposed: `proposed` is how many have been (None: the clock and
        GPU-hours alone, for a coordinator that may still measure a recorded candidate again)."""
        b = self.task.budget
        if proposed is not None and proposed >= b.max_candidates:
            return End("candidates")
        if time.time() - self.began > b.wall_clock_s:
            return End("wall_clock")
        if b.max_gpu_hours and self.gpu_hours() > b.max_gpu_hours:
            return End("gpu_hours")
        return None

    def observe(self, attempt: Attempt) -> None:
        self.history.append(attempt)

    def keep(self, speedup: float) -> None:
        self.kept += 1
        self.best_speedup *= speedup

    def revert(self, speedup: float) -> None:
        """A kept change found wrong later was taken back (agent/run/recheck.py)."""
        self.kept -= 1
        self.best_speedup /= speedup

    def failed(self, exc: BaseException) -> None:
        self.end, self.resumable = End.of_exception(exc), leaves_resumable(exc)

    def finished(self, head_commit: str, spend_usd: float, gpu_hours: float = 0.0) -> RunFinished:
        return RunFinished(reason=self.end.reason, candidates=len(self.history), kept=self.kept,
                           best_speedup=self.best_speedup, head_commit=head_commit,
                           seconds=round(time.time() - self.began, 1), spend_usd=spend_usd, gpu_hours=gpu_hours,
                           resumable=self.resumable)
