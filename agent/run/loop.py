"""The coordinator, for any number of workers: propose, judge on a worker, keep, observe.

task -> Proposal -> PatchApplied -> Build -> ParityReport -> BenchReport -> TokenAudit -> Decision -> Commit
Every arrow is one typed object (traces/schema.py) and one fsynced trace record, written here alone. A Worker
(agent/run/worker.py) is the only evaluator: the baseline phase gives it the reference and its incumbent, and it
takes each candidate through the Judge's stages. The coordinator schedules candidates over slots: one in-process
worker (`sandbox.workers: 1`), or one Ray actor per GPU (agent/run/parallel.py). It settles results in candidate
order: a keep measured against an incumbent that is no longer the branch head is measured again against the new
head (`remeasured`), so each commit's evidence is against its own parent. The RunState (agent/run/state.py) holds
the history and the budget. A run killed midway continues from its trace and branch (`resume`,
agent/run/resume.py): the baseline phase again, then the candidates that were in flight, in order.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.proposers.base import Attempt, ProposalContext, Proposer, ProposerExhausted
from agent.run.commits import commit_keep
from agent.run.phases import stage_at_death
from agent.run.setup import RunSetup
from agent.run.state import End, RunState
from agent.run.worker import Worker, WorkerResult
from sandbox import make_sandbox
from sandbox.base import Sandbox
from traces.log import raise_pending, taken
from traces.schema import AnyEvent, Decision, DuplicateDropped, Proposal, Remeasured, RunFinished

if TYPE_CHECKING:
    from agent.run.resume import Resumption

DUPLICATE_TRIES = 5
"""Proposals asked of the proposer per idle worker while each is the same as a candidate in flight."""


def patch_key(proposal: Proposal) -> str:
    return hashlib.sha256((proposal.patch + json.dumps(proposal.engine_args, sort_keys=True)).encode()).hexdigest()


@dataclass
class Slot:
    index: int
    handle: object
    """The worker: in this process, or a Ray actor."""
    started: float
    candidate: int = 0
    ended: float | None = None


class InProcess:
    """One worker in this process: its records go straight to the trace, and it evaluates when waited on."""

    remote = False

    def __init__(self, setup: RunSetup, sandbox: Sandbox, emit: Callable, on_revert: Callable[[float], None]):
        self.worker = Worker(0, setup, sandbox, emit=emit, on_revert=on_revert)
        self.slots = [Slot(0, self.worker, time.time())]
        self.queued: list[tuple[Slot, Proposal, str]] = []

    def start(self, head: str, emit: Callable) -> None:
        self.worker.start(head)

    def submit(self, slot: Slot, proposal: Proposal, head: str) -> None:
        slot.candidate = proposal.candidate
        self.queued.append((slot, proposal, head))

    def in_flight(self) -> list[tuple[Slot, int]]:
        return [(slot, proposal.candidate) for slot, proposal, _ in self.queued]

    def wait(self, timeout: float) -> list[tuple[Slot, int, WorkerResult | Exception]]:
        slot, proposal, head = self.queued.pop(0)
        return [(slot, proposal.candidate, self.worker.evaluate(proposal, head))]

    def adopt(self, slot: Slot, candidate: int, commit: str) -> None:
        self.worker.adopt(candidate, commit)

    def status_of(self, slot: Slot) -> dict:
        return self.worker.row()

    def rows(self) -> list[dict]:
        return []

    def checkout(self, head: str) -> Path:
        return self.worker.incumbent.tree

    def incumbent_args(self, head: str) -> dict:
        return dict(self.worker.incumbent.args)

    def final(self) -> None:
        self.worker.final()

    def close(self) -> None:
        self.worker.close()


class Loop:
    """`sandbox`: the in-process worker's (default: the task's backend); `sandbox_factory(config, folder)`: each Ray
    worker's; `on_workers(rows)`: the Ray workers' GPUs, candidates and stages, about once a second."""

    def __init__(self, setup: RunSetup, proposer: Proposer, on_event: Callable[[AnyEvent], None] = lambda e: None,
                 sandbox: Sandbox | None = None, resume: Resumption | None = None,
                 sandbox_factory: Callable | None = None,
                 on_workers: Callable[[list[dict]], None] = lambda rows: None):
        self.s, self.task, self.proposer, self.on_event, self.resume = setup, setup.task, proposer, on_event, resume
        self.on_workers = on_workers
        remote = self.task.sandbox.workers > 1
        self.state = RunState.of(self.task, resume, self.gpu_hours)
        if remote:
            from agent.run.parallel import RaySlots

            self.slots = RaySlots(setup, sandbox_factory)
        else:
            self.slots = InProcess(setup, sandbox or make_sandbox(self.task.sandbox, setup.run_dir), self.emit,
                                   self.state.revert)
        self.head = setup.workspace.head()
        self.redo: list[Proposal] = list(resume.redo) if resume else []
        """Candidates in flight when the run was killed, evaluated again before any new proposal."""
        self.proposals: dict[int, Proposal] = {a.proposal.candidate: a.proposal for a in self.state.history}
        self.proposals.update({p.candidate: p for p in self.redo})
        self.proposed_on: dict[int, str] = dict(resume.proposed_on) if resume else {}
        """The branch head each candidate was proposed on."""
        self.results: dict[int, WorkerResult | Exception] = {}
        self.settled: set[int] = {a.proposal.candidate for a in self.state.history}
        self.spans: list[tuple[int, int, float, float]] = []
        """(worker, candidate, started, finished) of every evaluation, for the run's own accounting."""

    @property
    def pool(self):
        """The in-process worker's servers."""
        return self.slots.worker.pool

    @property
    def baseline(self):
        return self.slots.worker.baseline

    def emit(self, event: AnyEvent) -> str:
        sha = self.s.trace.append(event)
        self.on_event(event)
        return sha

    def gpu_hours(self) -> float:
        """Held by this process's Ray workers, and (a resumed run) by all workers for the time spent before."""
        if not self.slots.remote:
            return 0.0
        now = time.time()
        held = sum((s.ended or now) - s.started for s in self.slots.slots) * self.task.sandbox.gpus_per_candidate
        return held / 3600 + (self.resume.gpu_hours(self.task) if self.resume else 0.0)

    def run(self) -> RunFinished:
        """A resumed run first records a keep its harness decided but did not record as committed, and one whose
        budget was spent before the kill skips the baseline phase, unless its kept head was never audited at its end:
        then the baseline phase runs for that audit alone. Then each worker's baseline phase, and its
        incumbent at the branch head (served with its nightshift.serve.yaml's flags)."""
        try:
            self.emit(self.resume.event if self.resume else self.s.run_started())
            if self.resume:
                self.resume.settle(self.s, self.emit)
                self.head = self.s.workspace.head()
            if self.resume and self.resume.event.finishing:
                self.state.end = End("finishing", self.resume.event.finishing)
                if self.resume.head_unaudited(self.head, self.s.base_commit):
                    self.slots.start(self.head, self.emit)  # its kept head is audited at the end, as any run's
                    self.slots.final()
            else:
                self.slots.start(self.head, self.emit)
                self.state.end = self.schedule() or End("candidates")
                self.slots.final()
        except BaseException as exc:
            taken(exc)
            self.state.failed(exc)
            raise
        finally:
            self.slots.close()
            finished = self.state.finished(self.s.workspace.head(), float(self.proposer.spend_usd),
                                           round(self.gpu_hours(), 4))
            self.emit(finished)
        return finished

    def schedule(self) -> End | None:
        stop = None
        while True:
            raise_pending()  # a stop (SIGTERM) that code on its way out swallowed
            if not stop:
                stop = self.state.over_budget(None) or self.fill()
            if not self.slots.in_flight():
                return stop or (End("workers", "workers: every worker died") if not self.live() else None)
            for _, n, result in self.slots.wait(1.0):
                self.results[n] = result
            if rows := self.slots.rows():
                self.on_workers(rows)
            self.settle_in_order()

    def live(self) -> list[Slot]:
        return [s for s in self.slots.slots if s.ended is None]

    def idle(self) -> list[Slot]:
        busy = {slot.index for slot, _ in self.slots.in_flight()}
        return [s for s in self.live() if s.index not in busy and s.candidate not in self.results]

    def fill(self) -> End | None:
        """One proposal per idle worker, none the same patch as another in flight (each one dropped is recorded)."""
        for slot in self.idle():
            if self.redo:
                self.submit(slot, self.redo.pop(0))
                continue
            if end := self.state.over_budget(len(self.proposals)):
                return end
            n = len(self.proposals) + 1
            in_flight = {patch_key(self.proposals[c]): c for _, c in self.slots.in_flight()}
            try:
                for _ in range(DUPLICATE_TRIES):
                    proposal = self.proposer.propose(self.context(n))
                    key = patch_key(proposal)
                    if key not in in_flight:
                        break
                    self.emit(DuplicateDropped(candidate=n, duplicate_of=in_flight[key], proposer=proposal.proposer,
                                               summary=proposal.summary, meta=proposal.meta, patch_sha256=key))
                else:
                    return None
            except ProposerExhausted as exc:
                return End.of_proposer(exc)
            proposal.candidate = n
            self.proposals[n], self.proposed_on[n] = proposal, self.head
            self.emit(proposal)
            self.submit(slot, proposal)
        return None

    def context(self, n: int) -> ProposalContext:
        return ProposalContext(task=self.task, candidate=n, checkout=self.slots.checkout(self.head),
                               incumbent_args=self.slots.incumbent_args(self.head), history=list(self.state.history),
                               best_speedup=self.state.best_speedup, branch_diff=self.s.branch_diff(), record=self.emit,
                               run_dir=self.s.run_dir)

    def submit(self, slot: Slot, proposal: Proposal) -> None:
        self.slots.submit(slot, proposal, self.head)

    def settle_in_order(self) -> None:
        while self.proposals:
            n = min((c for c in self.proposals if c not in self.settled), default=None)
            if n is None or n not in self.results:
                return
            result = self.results.pop(n)
            if not self.settle(n, result):
                return
            self.settled.add(n)

    def settle(self, n: int, result: WorkerResult | Exception) -> bool:
        """Records candidate n's outcome; False if it is being measured again (it stays next in line)."""
        proposal = self.proposals[n]
        self.head = self.s.workspace.head()  # an in-process worker may have taken a keep back
        if isinstance(result, Exception):
            slot = next(s for s in self.slots.slots if s.candidate == n and s.ended is not None)
            row = self.slots.status_of(slot)
            stage = stage_at_death(row.get("stage") if row.get("candidate") == n else None)
            decision = Decision(candidate=n, verdict="crash", stage=stage,
                                reason=f"worker {slot.index} (GPU {row.get('gpus') or slot.index}) died at {stage}: "
                                       f"{type(result).__name__}; its GPU left the pool")
            self.emit(decision)
            return self.observed(proposal, decision)
        slot = self.slots.slots[result.worker]
        for event in result.events:
            self.emit(event)
        self.spans.append((result.worker, n, result.started, result.finished))
        decision = result.decision
        if result.measured_against != self.head:
            if decision.verdict == "keep":
                alive = slot.ended is None
                self.emit(Remeasured(candidate=n, measured_against=result.measured_against, head_commit=self.head,
                                     worker=result.worker,
                                     reason=f"measured against {result.measured_against[:12]}; the branch head is "
                                            f"now {self.head[:12]}" + (": measured again against it" if alive
                                                                       else "; its worker died")))
                if alive:
                    self.submit(slot, proposal)
                    return False
                decision = Decision(candidate=n, verdict="crash", stage="start",
                                    reason="stale, and its worker died before measuring it again")
        if decision.stage == "apply" and result.measured_against != self.proposed_on.get(n, result.measured_against):
            decision = decision.model_copy(update={"reason": f"stale: no longer applies on {self.head[:12]}: "
                                                             f"{decision.reason}"})
        sha = self.emit(decision)
        if decision.verdict == "keep":
            self.commit(proposal, decision, sha, result)
        return self.observed(proposal, decision)

    def observed(self, proposal: Proposal, decision: Decision) -> bool:
        attempt = Attempt(proposal=proposal, decision=decision)
        self.state.observe(attempt)
        self.proposer.observe(attempt)
        return True

    def commit(self, proposal: Proposal, decision: Decision, decision_sha: str, result: WorkerResult) -> None:
        self.head = commit_keep(self.s, proposal, decision, decision_sha, result.parity_digest, result.audits,
                                Path(result.tree), result.args, self.emit)
        self.slots.adopt(self.slots.slots[result.worker], proposal.candidate, self.head)
        self.state.keep(decision.speedup)
