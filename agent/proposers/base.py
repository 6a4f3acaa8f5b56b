"""What a proposer is: something that, given the run so far, proposes the next candidate."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Protocol

from agent.world.task import Task
from traces.schema import AnyEvent, Decision, Proposal, Record


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


class ProposerExhausted(Exception):
    """The proposer has nothing more to propose, or its own budget is spent (`kind` "exhausted"), or
    it can not work at all in this run (`kind` "fatal": a bad LLM key, an unknown model)."""

    def __init__(self, message: str, kind: Literal["exhausted", "fatal"] = "exhausted"):
        super().__init__(message)
        self.kind = kind


class Proposer(Protocol):
    name: str
    spend_usd: float
    """US dollars spent so far (on an LLM); 0.0 for a proposer that spends nothing."""

    def propose(self, ctx: ProposalContext) -> Proposal:
        """The next candidate. Raises ProposerExhausted when there is none."""

    def observe(self, attempt: Attempt) -> None:
        """Learn from how the last proposal ended."""

    def restore(self, records: list[Record]) -> None:
        """A resumed run (agent/run/resume.py): take up this proposer's state from the run's trace so far, without
        proposing again; a proposal with no decision yet is evaluated again, and then observed."""
