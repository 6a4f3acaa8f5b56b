"""The optimization loop, top to bottom.

task -> Proposal -> PatchApplied -> Build -> ParityReport -> BenchReport -> TokenAudit -> Decision -> Commit
Every arrow is one typed object (traces/schema.py) and one fsynced trace record. A candidate's
worktree and servers belong to its Trial; the run's own servers (the reference, the incumbent)
belong to the ServerPool, which stops each exactly once. A run killed midway continues from its trace
and branch (`resume`, agent/run/resume.py): the baseline phase again, then the candidate that was in flight.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from agent.stages import bench

from agent.stages import liveness

from agent.stages import noise
from agent.run.commits import commit_message
from agent.stages.build import BuildError, build
from agent.stages.margins import served_margins
from agent.stages.parity import check_parity
from agent.run.pool import ServerPool, ServerRequest, Starting
from agent.proposers.base import Attempt, ProposalContext, Proposer, ProposerExhausted
from agent.stages.completions import ANSWER_ERRORS, draw_prompts
from agent.run.setup import RunSetup
from agent.stages.stats import accepts
from agent.stages.surface import engine_args_violation, surface_violation
from agent.stages.token_audit import audit_passed, calibration_refusal, describe, run_audit
from agent.run.trial import Trial
from agent.run.workspace import ApplyError, serve_args_at
from sandbox import make_sandbox
from sandbox.base import Sandbox, SandboxError, Server
from sandbox.host import describe_snapshot, server_snapshot
from traces.errors import NightshiftError, end_reason, leaves_resumable
from traces.schema import (AnyEvent, BenchReport, Commit, Decision, PatchApplied, Proposal, RunFinished, SampleTaken,
                           IncumbentRestarted, SelfParity, Stage, TokenAudit)

if TYPE_CHECKING:
    from agent.run.resume import Resumption


class Rejected(Exception):
    def __init__(self, stage: Stage, reason: str, verdict: str = "discard"):
        super().__init__(reason)
        self.stage, self.reason, self.verdict = stage, reason, verdict


class SetupNotDeterministic(NightshiftError):
    stage = "self_parity"


class AuditNotCalibrated(NightshiftError):
    stage = "audit"


class IncumbentFailed(NightshiftError):
    stage = "benchmark"


MAX_INCUMBENT_RESTARTS = 3
"""Per run: an incumbent that keeps failing is a broken setup, not bad luck."""


@dataclass
class Incumbent:
    server: Server
    args: dict
    tree: Path


def started(starting: Starting, index: int) -> Server:
    """One of a trial's servers once it answers; a failed start is the candidate's crash at `start`."""
    try:
        return starting.get(index)
    except SandboxError as exc:
        raise Rejected("start", f"{exc}; log tail: {exc.logs[-1500:]}", "crash") from None


class Loop:
    def __init__(self, setup: RunSetup, proposer: Proposer, on_event: Callable[[AnyEvent], None] = lambda e: None,
                 sandbox: Sandbox | None = None, resume: Resumption | None = None):
        self.s, self.task, self.proposer, self.on_event = setup, setup.task, proposer, on_event
        self.pool = ServerPool(self.task, sandbox or make_sandbox(self.task.sandbox, setup.run_dir), setup.model.path,
                               setup.run_id, setup.cache_seed, setup.run_dir / "server_starts.jsonl")
        self.resume = resume
        self.history: list[Attempt] = list(resume.history) if resume else []
        self.best_speedup, self.kept = (resume.best_speedup, resume.kept) if resume else (1.0, 0)
        self.dedicated_parity = bool(self.task.parity.env or self.task.parity.args)
        self.restarts = 0

    def emit(self, event: AnyEvent) -> str:
        sha = self.s.trace.append(event)
        self.on_event(event)
        return sha

    def run(self) -> RunFinished:
        started, reason = time.time() - (self.resume.spent_s if self.resume else 0.0), "budget: candidates"
        resumable = False
        try:
            with self.pool:
                if finishing := self.start():
                    reason = finishing
                while not finishing and len(self.history) < self.task.budget.max_candidates:
                    if time.time() - started > self.task.budget.wall_clock_s:
                        reason = "budget: wall clock"
                        break
                    try:
                        self.step(len(self.history) + 1)
                    except ProposerExhausted as exc:
                        reason = f"{'proposer failed' if exc.kind == 'fatal' else 'proposer exhausted'}: {exc}"
                        break
        except BaseException as exc:
            reason, resumable = end_reason(exc), leaves_resumable(exc)
            raise
        finally:
            finished = RunFinished(reason=reason, candidates=len(self.history), kept=self.kept,
                                   best_speedup=self.best_speedup, head_commit=self.s.workspace.head(),
                                   seconds=round(time.time() - started, 1), spend_usd=float(self.proposer.spend_usd),
                                   resumable=resumable)
            self.emit(finished)
        return finished

    def start(self) -> str:
        """The baseline phase: two independent baseline servers must agree (self-parity), the reference's
        margins are measured, and the token audit's tolerance is checked on the baseline under load. A resumed
        run first records a keep its harness decided but did not record as committed; one whose budget was
        spent before the kill skips the baseline phase and returns why."""
        self.emit(self.resume.event if self.resume else self.s.run_started())
        if self.resume:
            self.resume.settle(self.s, self.emit)
            if self.resume.event.finishing:
                return self.resume.event.finishing
        self.baseline()
        return ""

    def baseline(self) -> None:
        """Self-parity, margins, the audit's A/A and the incumbent's server (a parallel worker runs it on its GPU)."""
        tree = self.s.baseline_tree()
        self.pool.trust(tree)
        args, dedicated = self.task.engine.args, self.dedicated_parity
        requests = [ServerRequest("reference", tree, args, dedicated), ServerRequest("baseline-2", tree, args, dedicated)]
        if dedicated:
            requests.append(ServerRequest("baseline-perf", tree, args))
        requests[-1:-1] = peers = noise.peer_requests(self.task, tree, args, dedicated)
        servers = self.pool.start(requests)
        self.reference, second = servers[0], servers[1]
        report = self.parity(0, second)
        margins, margins_error = (served_margins(self.reference, self.task.parity, self.s.vocab_size,
                                                  self.task.benchmark.request_timeout_s)
                                   if report.ok else (None, ""))
        self.emit(SelfParity(ok=report.ok, prompts=report.prompts, regime=report.regime,
                             identical=report.prompts if report.ok else report.divergence.prompt_index,
                             detail="" if report.ok else report.divergence.model_dump_json(),
                             margins=margins, margins_error=margins_error))
        if not report.ok:
            raise SetupNotDeterministic(
                f"two baseline servers disagree on prompt {report.divergence.prompt_index} at token "
                f"{report.divergence.position}: greedy output is not reproducible in this setup; "
                "use a batch-invariant parity regime (parity.env / parity.args) or the sequential regime")
        if dedicated:
            self.pool.release(second)
        self.incumbent = Incumbent(servers[-1], dict(args), tree)
        self.calibrate_audit()
        noise.measure(self, servers[2:2 + len(peers)])
        if self.s.workspace.head() != self.s.base_commit:
            self.restore_incumbent()

    def restore_incumbent(self) -> None:
        """A resumed run's incumbent: the branch head, served with the flags of its nightshift.serve.yaml."""
        tree = self.s.workspace.worktree("incumbent")
        build(0, tree, [], bytecode_from=self.pool.trusted, link=self.s.linked)
        args = serve_args_at(self.s.repo, self.s.workspace.head())
        server = self.pool.start([ServerRequest("incumbent", tree, args)])[0]
        if self.incumbent.server is not self.reference:
            self.pool.release(self.incumbent.server)
        self.incumbent = Incumbent(server, dict(args), tree)

    def calibrate_audit(self) -> None:
        """The A/A: the baseline production server's own outputs under the benchmark load, audited on the reference
        over at least as many tokens as a candidate's audit. It refuses to start only for a disagreement far beyond
        numerics (a position past the hard bound); honest numerics are recorded and become the floor of the rate
        every candidate is compared with."""
        a = self.task.audit
        self.calibration = None
        if not a.enabled:
            return
        seeds = [secrets.randbits(63) for _ in range(bench.audit_calibration_passes(self.task) + 1)]
        passes = asyncio.run(bench.calibration_passes(self.task, self.incumbent.server, self.s.vocab_size, seeds))
        bench.save_passes(self.s.run_dir / "outputs", "calibration", passes)
        calibration = self.audit(0, [o for p in passes for o in p.requests()], calibration=True)
        if refusal := calibration_refusal(calibration, a):
            raise AuditNotCalibrated(
                f"the reference and the production configuration disagree far beyond numerics: the baseline's own "
                f"outputs under the benchmark load fail the token audit ({refusal}); honest numerics measured stay "
                f"under 1.5 nats and 6% of tokens, so this is a wrong kernel, another model or a chaotic checkpoint, "
                f"not noise")
        self.calibration = calibration

    def step(self, n: int) -> None:
        proposal = self.resume.in_flight(n) if self.resume else None  # recorded before a kill: not proposed again
        if proposal is None:
            ctx = ProposalContext(task=self.task, candidate=n, checkout=self.incumbent.tree,
                                  incumbent_args=dict(self.incumbent.args), history=list(self.history),
                                  best_speedup=self.best_speedup, branch_diff=self.s.branch_diff(), record=self.emit)
            proposal = self.proposer.propose(ctx)
            proposal.candidate = n
            self.emit(proposal)
        args = {**self.incumbent.args, **proposal.engine_args}
        audits: list[TokenAudit] = []
        with Trial(n, self.pool, self.s.workspace, self.task.budget.candidate_timeout_s) as trial:
            decision, production, digest = self.judge(trial, proposal, args, audits)
            decision_sha = self.emit(decision)
            if decision.verdict == "keep":
                self.keep(proposal, decision, decision_sha, trial.hand_over(production), args, digest, audits)
        attempt = Attempt(proposal=proposal, decision=decision)
        self.history.append(attempt)
        self.proposer.observe(attempt)

    def judge(self, trial: Trial, proposal: Proposal, args: dict, audits: list[TokenAudit]):
        """Surface, apply, build, parity, benchmark and audit: the decision, the production server and parity digest."""
        n, production, digest = trial.candidate, None, ""
        try:
            self.check_surface(proposal, args)
            files = self.apply(trial, proposal, args)
            self.build(n, trial.tree, files)
            production, digest = self.check_parity(trial, args)
            decision = self.evaluate(trial, production, files, audits)
        except Rejected as rejected:
            decision = Decision(candidate=n, verdict=rejected.verdict, stage=rejected.stage, reason=rejected.reason)
        if trial.disarm():
            decision = Decision(candidate=n, verdict="timeout", stage=decision.stage,
                                reason=f"over budget.candidate_timeout_s ({self.task.budget.candidate_timeout_s:g}"
                                       f" s), its servers killed; at {decision.stage}: {decision.reason}")
        return decision, production, digest

    def check_surface(self, proposal: Proposal, args: dict) -> None:
        violation = (surface_violation(proposal.patch, self.task.edit_surface)
                     or engine_args_violation(args, self.task.engine.args, self.task.edit_surface.engine_args))
        if violation:
            raise Rejected("surface", violation)

    def apply(self, trial: Trial, proposal: Proposal, args: dict) -> list[str]:
        tree = trial.worktree()
        try:
            files = self.s.workspace.apply(tree, proposal.patch)
        except ApplyError as exc:
            raise Rejected("apply", str(exc)) from None
        self.emit(PatchApplied(candidate=trial.candidate, worktree=str(tree), parent_commit=self.s.workspace.head(),
                               files=files, engine_args=args))
        return files

    def build(self, n: int, tree: Path, files: list[str]) -> None:
        try:
            self.emit(build(n, tree, files, bytecode_from=self.pool.trusted, link=self.s.linked))
        except BuildError as exc:
            raise Rejected("build", str(exc)) from None

    def parity(self, n: int, subject: Server):
        p = self.task.parity
        prompts = draw_prompts(secrets.randbits(63), p.num_prompts, p.input_len, self.s.vocab_size)
        return asyncio.run(check_parity(n, self.reference, subject, prompts, p.max_tokens, p.regime,
                                        self.task.benchmark.request_timeout_s))

    def check_parity(self, trial: Trial, args: dict) -> tuple[Server, str]:
        """Parity on fresh prompts; returns the candidate's production server and the parity digest. With
        dedicated parity servers (batch-invariant mode, say) the candidate's two servers start side by side,
        parity is checked as soon as the parity server answers, and a failure calls off the production start."""
        n = trial.candidate
        requests = [ServerRequest(f"candidate-{n}", trial.tree, args)]
        if self.dedicated_parity:
            requests.insert(0, ServerRequest(f"candidate-{n}-parity", trial.tree, args, parity=True))
        starting = trial.begin(requests)
        try:
            subject = started(starting, 0)
            try:
                report = self.parity(n, subject)
            except ANSWER_ERRORS as exc:
                raise Rejected("parity", f"candidate failed to answer: {exc}", "crash") from None
            self.emit(report)
            if not report.ok:
                d = report.divergence
                raise Rejected("parity", f"prompt {d.prompt_index} diverges at token {d.position}: expected "
                                         f"{d.expected}, got {d.got} ({d.got_len}/{d.expected_len} tokens)")
            production = started(starting, len(requests) - 1)
        except BaseException:
            starting.cancel()
            raise
        if subject is not production:
            trial.release(subject)
        return production, report.digest

    def evaluate(self, trial: Trial, server: Server, files: list[str], audits: list[TokenAudit]) -> Decision:
        """The benchmark, its token audit and the decision; then each confirmation, while it keeps passing."""
        for confirmation in range(self.task.acceptance.confirmations + 1):
            report, outputs, control = self.benchmark(trial, server, files, confirmation)
            if self.task.audit.enabled:
                audits.append(self.audit(trial.candidate, outputs, confirmation, control=control))
                if not audit_passed(audits[-1]):
                    raise Rejected("audit", describe(audits[-1]))
            decision = self.decide(report)
            if decision.verdict != "keep":
                break
        return decision

    def benchmark(self, trial: Trial, server: Server, files: list[str], confirmation: int, again: bool = False):
        n = trial.candidate
        seeds = [secrets.randbits(63) for _ in range(self.task.benchmark.repetitions + 1)]
        try:
            result = asyncio.run(bench.compare(
                self.task, self.incumbent.server, server, self.s.vocab_size, seeds,
                on_sample=lambda sample: self.emit(SampleTaken(candidate=n, sample=sample, confirmation=confirmation))))
        except (bench.WorkMismatch, bench.HarnessBound, bench.IdleWork) as exc:
            raise Rejected("benchmark", str(exc)) from None
        except bench.PassFailed as exc:
            if exc.role == "candidate":
                raise Rejected("benchmark", f"{exc}; {describe_snapshot(server_snapshot(server))}", "crash") from None
            self.restart_incumbent(n, confirmation, exc)
            if again:  # the incumbent failed twice while this candidate ran beside it
                raise Rejected("benchmark", f"{exc} (the second time beside this candidate)", "crash") from None
            return self.benchmark(trial, server, files, confirmation, again=True)
        except ANSWER_ERRORS as exc:
            raise Rejected("benchmark", f"request failed: {exc}", "crash") from None
        bench.save_passes(self.s.run_dir / "outputs", f"candidate-{n}-{confirmation}", result.passes)
        proof = liveness.check(server, trial.tree, files)
        report = bench.report(n, self.task, result.samples, result.estimate, proof, result.note, confirmation)
        self.emit(report)
        if proof.missing:
            raise Rejected("liveness", f"patched files never imported by the server: {proof.missing}")
        ceiling = self.task.benchmark.ceiling_tokens_per_s
        fastest = max(getattr(s, report.metric) for s in result.samples if s.role == "candidate")
        if ceiling and fastest > ceiling:
            raise Rejected("benchmark", f"quarantined: {fastest:.0f} tok/s exceeds the roofline ceiling {ceiling:.0f}")
        return report, result.outputs("candidate"), result.outputs("incumbent")

    def restart_incumbent(self, n: int, confirmation: int, failure: bench.PassFailed) -> None:
        """A fresh server of the incumbent's tree and flags in place of one that failed mid-benchmark."""
        old = self.incumbent
        if old.server is self.reference:
            raise IncumbentFailed(f"{failure}; the incumbent is also the parity reference, which is not replaced "
                                  "mid-run: resume the run (nightshift run --resume)")
        if self.restarts >= MAX_INCUMBENT_RESTARTS:
            raise IncumbentFailed(f"{failure}; the incumbent's server already failed {self.restarts} times in this run")
        self.restarts += 1
        post_mortem = server_snapshot(old.server)
        self.pool.release(old.server)
        began = time.monotonic()
        try:
            server = self.pool.start([ServerRequest(f"incumbent-r{self.restarts}", old.tree, old.args)])[0]
        except SandboxError as exc:
            raise IncumbentFailed(f"{failure}; its replacement failed to start: {exc}") from None
        self.incumbent = Incumbent(server, old.args, old.tree)
        self.emit(IncumbentRestarted(candidate=n, confirmation=confirmation, failed_server=failure.server,
                                     server=server.name, reason=f"{failure}; {describe_snapshot(post_mortem)}",
                                     seconds=round(time.monotonic() - began, 2), post_mortem=post_mortem))

    def audit(self, n: int, outputs, confirmation: int = 0, calibration: bool = False, control=None) -> TokenAudit:
        event = run_audit(n, self.reference, outputs, self.task.audit, self.task.benchmark.request_timeout_s,
                          self.task.acceptance.confidence, control, getattr(self, "calibration", None), confirmation,
                          calibration)
        self.emit(event)
        return event

    def decide(self, report: BenchReport) -> Decision:
        a = self.task.acceptance
        verdict = "keep" if accepts(report.ci_low, a.min_speedup) else "discard"
        reason = (f"speedup {report.speedup:.3f}x, {a.confidence:.0%} interval [{report.ci_low:.3f}, "
                  f"{report.ci_high:.3f}], p={report.p_value:.4f} against {a.min_speedup}x")
        seq = report.sequential
        if seq and len(seq.planned) > 1:
            reason += f"; stopped ({seq.stopped}) at look {len(seq.looks)} of {len(seq.planned)}, {seq.looks[-1].pairs} pairs"
        if verdict != "keep":
            reason = f"not faster: {reason}"
        if report.confirmation:
            reason = f"confirmation {report.confirmation} of {a.confirmations}: {reason}"
        return Decision(candidate=report.candidate, verdict=verdict, stage="decision", reason=reason,
                        speedup=report.speedup, ci_low=report.ci_low, ci_high=report.ci_high)

    def keep(self, proposal: Proposal, decision: Decision, decision_sha: str, handed: tuple[Server, Path], args: dict,
             parity_digest: str, audits: list[TokenAudit]) -> None:
        n, (server, tree) = proposal.candidate, handed
        message = commit_message(self.task, self.s.run_id, proposal, decision, decision_sha, parity_digest, audits,
                                 self.s.relaxed)
        sha = self.s.workspace.commit(tree, args, message)
        self.emit(Commit(candidate=n, branch=self.s.workspace.branch, commit=sha, decision_sha256=decision_sha))
        previous, self.incumbent = self.incumbent, Incumbent(server, dict(args), tree)
        if previous.server is not self.reference:
            self.pool.release(previous.server)
        if previous.tree != self.pool.trusted:
            self.s.workspace.remove(previous.tree)
        self.kept += 1
        self.best_speedup *= decision.speedup
