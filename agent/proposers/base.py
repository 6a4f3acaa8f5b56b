"""What a proposer is: something that, given the run so far, proposes the next candidate."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from agent.extensions import Proposer  # declared there, with every extension point
from agent.world.task import Task
from traces.schema import AnyEvent, Decision, Proposal

__all__ = ["Attempt", "ProposalContext", "Proposer", "ProposerExhausted", "START_LOG"]


@dataclass
class Attempt:
    proposal: Proposal
    decision: Decision


@dataclass
class ProposalContext:
    """Everything a proposer may see. The parity seed and reference outputs are not in it."""

    task: Task
    candidate: int
    checkout: Path
    """A read-only view of the incumbent's source tree (the run branch's head)."""
    incumbent_args: dict[str, Any]
    history: list[Attempt] = field(default_factory=list)
    best_speedup: float = 1.0
    branch_diff: str = ""
    record: Callable[[AnyEvent], str] = lambda event: ""
    """Append an event (e.g. an LLM call) to the trace; returns its sha256."""
    run_dir: Path | None = None
    """The run's folder, for a proposer that reads how the run stands: its `trace.jsonl` (the incumbent's benchmarks)
    and START_LOG."""


START_LOG = "production-start.log"
"""The baseline production server's log at its start (attention backend, compile mode, CUDA-graph sizes), which the
baseline phase saves in the run's folder: a server's own log is gone with a container, and a parallel run's are under
its workers' folders."""


class ProposerExhausted(Exception):
    """The proposer has nothing more to propose, or its own budget is spent (`kind` "exhausted"), or
    it can not work at all in this run (`kind` "fatal": a bad LLM key, an unknown model)."""

    def __init__(self, message: str, kind: Literal["exhausted", "fatal"] = "exhausted"):
        super().__init__(message)
        self.kind = kind

