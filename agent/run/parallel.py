"""Candidates in parallel, one per GPU, on Ray (`sandbox.workers: N`, docs/parallel.md).

Workers (agent/run/worker.py, one Ray actor per GPU) evaluate; this coordinator alone writes the trace and the branch.
It settles results in candidate order. A keep measured against an incumbent that is no longer the branch head
is not kept on that evidence: it is measured again on its worker against the new head (`remeasured`), where a
patch that no longer applies is discarded as stale. So each commit's evidence is against its own parent.
A killed run resumes (agent/run/resume.py) with the candidates that were in flight evaluated again, in order."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.run.commits import commit_keep
from agent.run.reaping import reap_workers
from agent.proposers.base import Attempt, ProposalContext, Proposer, ProposerExhausted
from agent.run.state import End, RunState
from agent.run.setup import RunSetup
from agent.run.cluster import import_ray, preflight
from agent.run.worker import Worker, WorkerResult, plain_setup
from sandbox.local import reap_servers
from traces.schema import AnyEvent, Decision, Proposal, Remeasured, RunFinished

if TYPE_CHECKING:
    from agent.run.resume import Resumption


def DEATHS(ray) -> tuple:
    names = ("RayActorError", "ActorDiedError", "WorkerCrashedError", "NodeDiedError", "ActorUnavailableError")
    return tuple(getattr(ray.exceptions, name) for name in names if hasattr(ray.exceptions, name))


def patch_key(proposal: Proposal) -> str:
    return hashlib.sha256((proposal.patch + json.dumps(proposal.engine_args, sort_keys=True)).encode()).hexdigest()


@dataclass
class Slot:
    index: int
    actor: object
    started: float
    candidate: int = 0
    ended: float | None = None


class Parallel:
    def __init__(self, setup: RunSetup, proposer: Proposer, on_event: Callable[[AnyEvent], None] = lambda e: None,
                 sandbox_factory: Callable | None = None, on_workers: Callable[[list[dict]], None] = lambda rows: None,
                 resume: Resumption | None = None):
        self.s, self.task, self.proposer, self.on_event = setup, setup.task, proposer, on_event
        self.sandbox_factory, self.on_workers, self.resume = sandbox_factory, on_workers, resume
        self.state = RunState.of(self.task, resume, self.gpu_hours)
        self.head = setup.workspace.head()
        self.redo: list[Proposal] = list(resume.redo) if resume else []
        """Candidates in flight when the run was killed, evaluated again before any new proposal."""
        self.proposals: dict[int, Proposal] = {a.proposal.candidate: a.proposal for a in self.state.history}
        self.proposals.update({p.candidate: p for p in self.redo})
        self.proposed_on: dict[int, str] = dict(resume.proposed_on) if resume else {}
        """The branch head each candidate was proposed on."""
        self.results: dict[int, WorkerResult | Exception] = {}
        self.flight: dict = {}
        """Ray object ref -> (slot, candidate) for every evaluation under way."""
        self.slots: list[Slot] = []
        self.view: tuple[str, Path] | None = None
        """The branch head's tree, which proposers read."""
        self.settled: set[int] = {a.proposal.candidate for a in self.state.history}
        self.spans: list[tuple[int, int, float, float]] = []
        """(worker, candidate, started, finished) of every evaluation, for the run's own accounting."""

    def emit(self, event: AnyEvent) -> str:
        sha = self.s.trace.append(event)
        self.on_event(event)
        return sha

    def gpu_hours(self) -> float:
        """Held by this process's workers, and (a resumed run) by all workers for the time spent before."""
        now = time.time()
        held = sum((slot.ended or now) - slot.started for slot in self.slots) * self.task.sandbox.gpus_per_candidate
        return held / 3600 + (self.resume.gpu_hours(self.task) if self.resume else 0.0)

    def spawn(self):
        ray = preflight(self.task)
        box = self.task.sandbox
        resource = box.gpu_resource
        options = ({"num_gpus": box.gpus_per_candidate} if resource == "GPU"
                   else {"resources": {resource: box.gpus_per_candidate}})
        remote = ray.remote(max_restarts=0, max_task_retries=0, **options)(RayWorker)
        plain = plain_setup(self.s)
        for index in range(box.workers):
            actor = remote.remote(index, plain, resource, self.sandbox_factory)
            self.slots.append(Slot(index, actor, time.time()))
        return ray

    def run(self) -> RunFinished:
        try:
            self.emit(self.resume.event if self.resume else self.s.run_started())
            if self.resume:
                self.resume.settle(self.s, self.emit)
                self.head = self.s.workspace.head()
            if self.resume and self.resume.event.finishing:
                self.state.end = End("finishing", self.resume.event.finishing)
            else:
                ray = self.spawn()
                self.start_workers(ray)
                self.state.end = self.schedule(ray) or End("candidates")
        except BaseException as exc:
            self.state.failed(exc)
            raise
        finally:
            self.close()
            finished = self.state.finished(self.s.workspace.head(), float(self.proposer.spend_usd),
                                           round(self.gpu_hours(), 4))
            self.emit(finished)
        return finished

    def start_workers(self, ray) -> None:
        """Each worker's baseline phase on its GPU, its records emitted in worker order."""
        starts = [slot.actor.start.remote(self.head) for slot in self.slots]
        for slot, ref in zip(self.slots, starts):
            try:
                events = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                raise exc.cause if isinstance(exc.cause, Exception) else exc
            for event in events:
                self.emit(event)

    def idle(self) -> list[Slot]:
        busy = {slot.index for slot, _ in self.flight.values()}
        return [s for s in self.slots if s.ended is None and s.index not in busy and s.candidate not in self.results]

    def schedule(self, ray) -> End | None:
        stop = None
        while True:
            if not stop:
                stop = self.state.over_budget(None) or self.fill()
            if not self.flight:
                return stop or (End("workers", "workers: every worker died") if not self.live() else None)
            ready, _ = ray.wait(list(self.flight), num_returns=1, timeout=1.0)
            self.on_workers(self.worker_rows())
            for ref in ready:
                slot, n = self.flight.pop(ref)
                try:
                    self.results[n] = ray.get(ref)
                except DEATHS(ray) as exc:
                    self.results[n] = exc
                    self.lose(slot)
                except ray.exceptions.RayTaskError as exc:
                    raise exc.cause if isinstance(exc.cause, Exception) else exc
            self.settle_in_order()

    def live(self) -> list[Slot]:
        return [s for s in self.slots if s.ended is None]

    def fill(self) -> End | None:
        """One proposal per idle worker, none the same patch as another in flight."""
        for slot in self.idle():
            if self.redo:
                self.submit(slot, self.redo.pop(0))
                continue
            if end := self.state.over_budget(len(self.proposals)):
                return end
            n = len(self.proposals) + 1
            in_flight = {patch_key(self.proposals[c]) for _, c in self.flight.values()}
            try:
                for _ in range(5):
                    proposal = self.proposer.propose(self.context(n))
                    if patch_key(proposal) not in in_flight:
                        break
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
        if self.view is None or self.view[0] != self.head:
            if self.view is not None:
                self.s.workspace.remove(self.view[1])
            self.view = (self.head, self.s.workspace.worktree(f"head-{self.head[:12]}"))
        return ProposalContext(task=self.task, candidate=n, checkout=self.view[1],
                               incumbent_args=self.incumbent_args(), history=list(self.state.history),
                               best_speedup=self.state.best_speedup, branch_diff=self.s.branch_diff(), record=self.emit)

    def incumbent_args(self) -> dict:
        from agent.run.workspace import serve_args_at

        return dict(serve_args_at(self.s.repo, self.head) or self.task.engine.args)

    def submit(self, slot: Slot, proposal: Proposal) -> None:
        slot.candidate = proposal.candidate
        self.flight[slot.actor.evaluate.remote(proposal, self.head)] = (slot, proposal.candidate)

    def lose(self, slot: Slot) -> None:
        """A dead worker: its GPU leaves the pool, and the servers it left behind are killed."""
        slot.ended = time.time()
        reap_servers(self.s.run_dir / "workers")

    def status_of(self, slot: Slot) -> dict:
        """What the worker last wrote of itself (agent/run/worker.py): its GPUs, candidate and stage."""
        try:
            return json.loads((self.s.run_dir / "workers" / f"w{slot.index}" / "status.json").read_text())
        except (OSError, ValueError):
            return {"worker": slot.index, "gpus": [], "candidate": 0, "stage": "starting"}

    def worker_rows(self) -> list[dict]:
        return [{**self.status_of(slot), **({"stage": "dead"} if slot.ended is not None else {})}
                for slot in self.slots]

    def settle_in_order(self) -> None:
        while self.proposals:
            n = min((c for c in self.proposals if c not in self.settled), default=None)
            if n is None or n not in self.results:
                return
            result = self.results.pop(n)
            if not self.settle(n, result):
                return
            self.settled.add(n)

    def settle(self, n: int, result) -> bool:
        """Records candidate n's outcome; False if it is being measured again (it stays next in line)."""
        proposal = self.proposals[n]
        if isinstance(result, Exception):
            slot = next(s for s in self.slots if s.candidate == n and s.ended is not None)
            row = self.status_of(slot)
            stage = row.get("stage") if row.get("candidate") == n else "start"
            stage = stage if stage in ("surface", "apply", "build", "start", "parity", "benchmark", "audit",
                                       "decision") else "start"
            decision = Decision(candidate=n, verdict="crash", stage=stage,
                                reason=f"worker {slot.index} (GPU {row.get('gpus') or slot.index}) died at {stage}: "
                                       f"{type(result).__name__}; its GPU left the pool")
            self.emit(decision)
            return self.observed(proposal, decision)
        slot = self.slots[result.worker]
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
        sha = commit_keep(self.s, proposal, decision, decision_sha, result.parity_digest, result.audits,
                          Path(result.tree), result.args, self.emit)
        self.head = sha
        self.slots[result.worker].actor.adopt.remote(proposal.candidate, sha)
        self.state.keep(decision.speedup)

    def close(self) -> None:
        if not self.slots:
            return
        ray = import_ray()
        closing = [slot.actor.close.remote() for slot in self.slots if slot.ended is None]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=60)
        except Exception:
            pass
        for slot in self.slots:
            ray.kill(slot.actor)
            slot.ended = slot.ended or time.time()
        reap_workers(self.s.run_dir)  # ray.kill returns before the actor is gone, and its servers are not Ray's
        if self.view is not None:
            self.s.workspace.remove(self.view[1])


class RayWorker(Worker):
    """A Worker as a Ray actor: its GPUs are the ones Ray gave it."""

    def __init__(self, index: int, plain: dict, resource: str, sandbox_factory=None):
        import ray

        gpus = [int(g) for g in ray.get_gpu_ids()] if resource == "GPU" else []
        super().__init__(index, plain, gpus, sandbox_factory)
