"""The optimization loop, top to bottom: propose, judge, keep, observe.

task -> Proposal -> PatchApplied -> Build -> ParityReport -> BenchReport -> TokenAudit -> Decision -> Commit
Every arrow is one typed object (traces/schema.py) and one fsynced trace record. The baseline phase
(agent/run/baseline.py) gives the reference and the first incumbent; the Judge (agent/run/judge.py) takes one
candidate through its stages in a Trial that owns its worktree and servers; the Incumbent (agent/run/incumbent.py)
is replaced by each keep; the RunState (agent/run/state.py) holds the history and the budget. The run's own
servers belong to the ServerPool, which stops each exactly once. A run killed midway continues from its trace and
branch (`resume`, agent/run/resume.py): the baseline phase again, then the candidate that was in flight.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from agent.proposers.base import Attempt, ProposalContext, Proposer, ProposerExhausted
from agent.run.baseline import Baseline, dedicated_parity, measure_baseline
from agent.run.commits import commit_keep
from agent.run.judge import Judge, Remeasure
from agent.run.recheck import Recheck
from agent.run.pool import ServerPool
from agent.run.setup import RunSetup
from agent.run.state import End, RunState
from agent.run.trial import Trial
from sandbox import make_sandbox
from sandbox.base import Sandbox
from traces.schema import AnyEvent, Remeasured, RunFinished, TokenAudit

if TYPE_CHECKING:
    from agent.run.resume import Resumption


class Loop:
    def __init__(self, setup: RunSetup, proposer: Proposer, on_event: Callable[[AnyEvent], None] = lambda e: None,
                 sandbox: Sandbox | None = None, resume: Resumption | None = None):
        self.s, self.task, self.proposer, self.on_event, self.resume = setup, setup.task, proposer, on_event, resume
        self.pool = ServerPool(self.task, sandbox or make_sandbox(self.task.sandbox, setup.run_dir), setup.model.path,
                               setup.run_id, setup.cache_seed, setup.run_dir / "server_starts.jsonl")
        self.state = RunState.of(self.task, resume)
        self.baseline: Baseline | None = None
        self.judge: Judge | None = None
        self.recheck: Recheck | None = None

    def emit(self, event: AnyEvent) -> str:
        sha = self.s.trace.append(event)
        self.on_event(event)
        return sha

    def run(self) -> RunFinished:
        try:
            with self.pool:
                self.state.end = self.start() or self.search()
                if self.recheck is not None and self.state.end.kind != "finishing":
                    self.recheck.final()
        except BaseException as exc:
            self.state.failed(exc)
            raise
        finally:
            finished = self.state.finished(self.s.workspace.head(), float(self.proposer.spend_usd))
            self.emit(finished)
        return finished

    def start(self) -> End | None:
        """The run's first record; a resumed run first records a keep its harness decided but did not record as
        committed, and one whose budget was spent before the kill skips the baseline phase. Then the baseline
        phase, and a resumed run's incumbent: the branch head, served with its nightshift.serve.yaml's flags."""
        self.emit(self.resume.event if self.resume else self.s.run_started())
        if self.resume:
            self.resume.settle(self.s, self.emit)
            if self.resume.event.finishing:
                return End("finishing", self.resume.event.finishing)
        self.baseline = measure_baseline(self.s, self.pool, self.emit)
        if self.s.workspace.head() != self.s.base_commit:
            self.baseline.incumbent.restore(self.s.workspace.head())
        self.judge = Judge(self.s, self.pool, self.baseline.reference, self.baseline.incumbent,
                           self.baseline.calibration, dedicated_parity(self.s), self.emit)
        if self.baseline.calibration is not None:
            self.recheck = self.judge.recheck = Recheck(self.s, self.baseline.reference, self.baseline.incumbent,
                                                        self.baseline.calibration, self.emit, self.state.revert)
        return None

    def search(self) -> End:
        while (end := self.state.over_budget(len(self.state.history))) is None:
            try:
                self.step(len(self.state.history) + 1)
            except ProposerExhausted as exc:
                return End.of_proposer(exc)
        return end

    def step(self, n: int) -> None:
        incumbent = self.baseline.incumbent
        proposal = self.resume.in_flight(n) if self.resume else None  # recorded before a kill: not proposed again
        if proposal is None:
            ctx = ProposalContext(task=self.task, candidate=n, checkout=incumbent.tree,
                                  incumbent_args=dict(incumbent.args), history=list(self.state.history),
                                  best_speedup=self.state.best_speedup, branch_diff=self.s.branch_diff(),
                                  record=self.emit)
            proposal = self.proposer.propose(ctx)
            proposal.candidate = n
            self.emit(proposal)
        while True:  # again on the new head while the incumbent it was measured beside is taken back
            args = {**incumbent.args, **proposal.engine_args}
            audits: list[TokenAudit] = []
            with Trial(n, self.pool, self.s.workspace, self.task.budget.candidate_timeout_s) as trial:
                try:
                    decision, production, digest = self.judge.judge(trial, proposal, args, audits)
                except Remeasure as again:
                    self.emit(Remeasured(candidate=n, measured_against=again.measured_against,
                                         head_commit=self.s.workspace.head(), worker=0, reason=again.reason))
                    continue
                decision_sha = self.emit(decision)
                if decision.verdict == "keep":
                    server, tree = trial.hand_over(production)
                    commit_keep(self.s, proposal, decision, decision_sha, digest, audits, tree, args, self.emit)
                    incumbent.replace(server, args, tree)
                    self.state.keep(decision.speedup)
            break
        attempt = Attempt(proposal=proposal, decision=decision)
        self.state.observe(attempt)
        self.proposer.observe(attempt)
