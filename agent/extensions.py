"""Every extension point of nightshift, declared in one place.

A new kind is one file that registers itself; nothing else is edited. A name not registered yet has its registry
import the modules of its package once (agent/proposers/ for proposers, sandbox/ for backends), so the file is
found where it lies.

- Proposers (`proposer.kind` in a task): `register_proposer(ProposerKind(...))` with
  - `spec`: the pydantic model of its task section (`kind: Literal["<name>"]` and its settings; `Strict` from
    agent/world/task.py forbids unknown keys). The task schema validates the section with it.
  - `make(task) -> Proposer`: the proposer (the protocol below).
  - `check(task, repo) -> list[str]`: optional, before a run writes anything: raises to refuse the run, returns
    warnings.
  - `from_cli(patches) -> dict`: optional, the section `nightshift run --proposer <name> [--patches DIR]` sets.
- Sandbox backends (`sandbox.backend`): `register_backend(name, SandboxClass)` (sandbox/registry.py); the class is
  made as `SandboxClass(config, run_dir)`, follows the `Sandbox` protocol (sandbox/base.py: start, export_cache,
  reap) and has `probe(config)`, which a run calls before it writes anything.

The acceptance test is not an extension point: agent/stages/stats.py `accepts` alone decides whether a benchmark's
interval keeps a candidate, and every reader (the judge, replay, the report, the proposers' statistics) calls it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from sandbox.base import Sandbox, Server
from sandbox.registry import BACKENDS, Backend, Registry, register_backend, resolve

if TYPE_CHECKING:  # annotations only: these modules import this one
    from agent.proposers.base import Attempt, ProposalContext
    from traces.schema import Proposal, Record


class Proposer(Protocol):
    """What the coordinator (agent/run/loop.py) asks of a proposer (ProposalContext and Attempt:
    agent/proposers/base.py; Proposal and Record: traces/schema.py)."""

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


@dataclass(frozen=True)
class ProposerKind:
    name: str
    spec: type | str
    make: Callable | str
    check: Callable | str | None = None
    from_cli: Callable | str | None = None

    def spec_model(self) -> type:
        return resolve(self.spec)

    def build(self, task) -> Proposer:
        return resolve(self.make)(task)

    def run_check(self, task, repo) -> list[str]:
        return list(resolve(self.check)(task, repo)) if self.check is not None else []

    def cli_section(self, patches) -> dict | None:
        return resolve(self.from_cli)(patches) if self.from_cli is not None else None


PROPOSERS: Registry[ProposerKind] = Registry("proposer kind", "agent.proposers")


def register_proposer(kind: ProposerKind) -> ProposerKind:
    return PROPOSERS.register(kind.name, kind)


def queue_from_cli(patches) -> dict:
    if not patches:
        raise ValueError("--proposer queue needs --patches DIR")
    return {"kind": "queue", "patches": str(patches.resolve())}


for _kind in (
    ProposerKind("flags", "agent.world.task:FlagsProposer", "agent.proposers.flags:FlagsProposer.from_task"),
    ProposerKind("queue", "agent.world.task:QueueProposer", "agent.proposers.queue:QueueProposer.from_task",
                 check="agent.run.preflight:check_patches", from_cli=queue_from_cli),
    ProposerKind("llm", "agent.world.task:LlmProposer", "agent.proposers.llm:LlmProposer.from_task"),
):
    register_proposer(_kind)

__all__ = ["BACKENDS", "Backend", "PROPOSERS", "Proposer", "ProposerKind", "Registry", "Sandbox", "Server",
           "register_backend", "register_proposer"]
