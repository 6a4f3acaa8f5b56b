"""The optimization loop, top to bottom.

task -> Proposal -> PatchApplied -> Build -> ParityReport -> BenchReport -> Decision -> Commit
Every arrow is one typed object (traces/schema.py) and one fsynced trace record.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agent import bench, liveness
from agent.build import BuildError, build
from agent.margins import served_margins
from agent.parity import check_parity
from agent.proposers.base import Attempt, ProposalContext, Proposer, ProposerExhausted
from agent.requests import ANSWER_ERRORS, draw_prompts
from agent.setup import RunSetup
from agent.surface import engine_args_violation, surface_violation
from agent.workspace import ApplyError
from sandbox.base import SandboxError, Server
from traces.schema import (AnyEvent, Commit, Decision, PatchApplied, Proposal, RunFinished, SampleTaken, SelfParity,
                           Stage)


class Rejected(Exception):
    def __init__(self, stage: Stage, reason: str, verdict: str = "discard"):
        super().__init__(reason)
        self.stage, self.reason, self.verdict = stage, reason, verdict


class SetupNotDeterministic(RuntimeError):
    pass


@dataclass
class Incumbent:
    server: Server
    args: dict
    tree: Path


class Loop:
    def __init__(self, setup: RunSetup, proposer: Proposer, on_event: Callable[[AnyEvent], None] = lambda e: None):
        self.s, self.task, self.proposer, self.on_event = setup, setup.task, proposer, on_event
        self.history: list[Attempt] = []
        self.parity_digest = ""
        self.best_speedup, self.kept = 1.0, 0
        self.dedicated_parity = bool(self.task.parity.env or self.task.parity.args)

    def emit(self, event: AnyEvent) -> str:
        sha = self.s.trace.append(event)
        self.on_event(event)
        return sha

    def run(self) -> RunFinished:
        started, reason = time.time(), "budget: candidates"
        try:
            self.start()
            while len(self.history) < self.task.budget.max_candidates:
                if time.time() - started > self.task.budget.wall_clock_s:
                    reason = "budget: wall clock"
                    break
                try:
                    self.step(len(self.history) + 1)
                except ProposerExhausted as exc:
                    fatal = getattr(exc, "kind", "") == "fatal"
                    reason = f"{'proposer failed' if fatal else 'proposer exhausted'}: {exc}"
                    break
        except BaseException as exc:
            reason = f"error: {type(exc).__name__}: {exc}"
            raise
        finally:
            self.s.stop_servers()
            finished = RunFinished(reason=reason, candidates=len(self.history), kept=self.kept,
                                   best_speedup=self.best_speedup, head_commit=self.s.workspace.head(),
                                   seconds=round(time.time() - started, 1),
                                   spend_usd=float(getattr(self.proposer, "spend_usd", 0.0)))
            self.emit(finished)
        return finished

    def start(self) -> None:
        self.emit(self.s.run_started())
        tree = self.s.baseline_tree()
        args, dedicated = self.task.engine.args, self.dedicated_parity
        requests = [("reference", tree, args, dedicated), ("baseline-2", tree, args, dedicated)]
        if dedicated:
            requests.append(("baseline-perf", tree, args, False))
        servers = self.s.start_servers(requests)
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
            self.s.stop(second)
        self.incumbent = Incumbent(servers[-1], dict(args), tree)

    def step(self, n: int) -> None:
        ctx = ProposalContext(task=self.task, candidate=n, checkout=self.incumbent.tree,
                              incumbent_args=dict(self.incumbent.args), history=list(self.history),
                              best_speedup=self.best_speedup, branch_diff=self.s.branch_diff(), record=self.emit)
        proposal = self.proposer.propose(ctx)
        proposal.candidate = n
        self.emit(proposal)
        server, worktree = None, None
        args = {**self.incumbent.args, **proposal.engine_args}
        try:
            violation = (surface_violation(proposal.patch, self.task.edit_surface)
                         or engine_args_violation(args, self.task.engine.args, self.task.edit_surface.engine_args))
            if violation:
                raise Rejected("surface", violation)
            worktree = self.s.workspace.worktree(f"candidate-{n}")
            try:
                files = self.s.workspace.apply(worktree, proposal.patch)
            except ApplyError as exc:
                raise Rejected("apply", str(exc)) from None
            self.emit(PatchApplied(candidate=n, worktree=str(worktree), parent_commit=self.s.workspace.head(),
                                   files=files, engine_args=args))
            try:
                self.emit(build(n, worktree, files, bytecode_from=self.s.baseline))
            except BuildError as exc:
                raise Rejected("build", str(exc)) from None
            server = self.evaluate_parity(n, worktree, args)
            decision = self.decide(self.benchmark(n, server, worktree, files))
            for confirmation in range(1, self.task.acceptance.confirmations + 1):
                if decision.verdict != "keep":
                    break
                decision = self.decide(self.benchmark(n, server, worktree, files, confirmation))
        except Rejected as rejected:
            decision = Decision(candidate=n, verdict=rejected.verdict, stage=rejected.stage, reason=rejected.reason)
        decision_sha = self.emit(decision)
        if decision.verdict == "keep":
            self.keep(n, proposal, decision, decision_sha, worktree, server, args)
        else:
            if server is not None:
                self.s.stop(server)
            if worktree is not None:
                self.s.workspace.remove(worktree)
        attempt = Attempt(proposal=proposal, decision=decision)
        self.history.append(attempt)
        self.proposer.observe(attempt)

    def parity(self, n: int, subject: Server):
        p = self.task.parity
        prompts = draw_prompts(secrets.randbits(63), p.num_prompts, p.input_len, self.s.vocab_size)
        return asyncio.run(check_parity(n, self.reference, subject, prompts, p.max_tokens, p.regime,
                                        self.task.benchmark.request_timeout_s))

    def evaluate_parity(self, n: int, worktree: Path, args: dict) -> Server:
        """Parity on fresh prompts; returns the candidate's production server. With dedicated parity
        servers (batch-invariant mode, say) the candidate's two servers start side by side."""
        requests = [(f"candidate-{n}", worktree, args, False)]
        if self.dedicated_parity:
            requests.insert(0, (f"candidate-{n}-parity", worktree, args, True))
        try:
            servers = self.s.start_servers(requests)
        except SandboxError as exc:
            raise Rejected("start", f"{exc}; log tail: {exc.logs[-1500:]}", "crash") from None
        subject, production = servers[0], servers[-1]

        def stop_all():
            for server in servers:
                self.s.stop(server)

        try:
            report = self.parity(n, subject)
        except ANSWER_ERRORS as exc:
            stop_all()
            raise Rejected("parity", f"candidate failed to answer: {exc}", "crash") from None
        self.emit(report)
        self.parity_digest = report.digest
        if not report.ok:
            stop_all()
            d = report.divergence
            raise Rejected("parity", f"prompt {d.prompt_index} diverges at token {d.position}: expected "
                                     f"{d.expected}, got {d.got} ({d.got_len}/{d.expected_len} tokens)")
        if subject is not production:
            self.s.stop(subject)
        return production

    def benchmark(self, n: int, server: Server, worktree: Path, files: list[str], confirmation: int = 0):
        seeds = [secrets.randbits(63) for _ in range(self.task.benchmark.repetitions + 1)]
        try:
            samples, estimate, note = asyncio.run(bench.compare(
                self.task, self.incumbent.server, server, self.s.vocab_size, seeds,
                on_sample=lambda sample: self.emit(SampleTaken(candidate=n, sample=sample, confirmation=confirmation))))
        except (bench.WorkMismatch, bench.HarnessBound) as exc:
            self.s.stop(server)
            raise Rejected("benchmark", str(exc)) from None
        except ANSWER_ERRORS as exc:
            self.s.stop(server)
            raise Rejected("benchmark", f"request failed: {exc}", "crash") from None
        proof = liveness.check(server, worktree, files)
        report = bench.report(n, self.task, samples, estimate, proof, note, confirmation)
        self.emit(report)
        if proof.missing:
            self.s.stop(server)
            raise Rejected("liveness", f"patched files never imported by the server: {proof.missing}")
        ceiling = self.task.benchmark.ceiling_tokens_per_s
        fastest = max(getattr(s, self.task.benchmark.metric) for s in samples if s.role == "candidate")
        if ceiling and fastest > ceiling:
            self.s.stop(server)
            raise Rejected("benchmark", f"quarantined: {fastest:.0f} tok/s exceeds the roofline ceiling {ceiling:.0f}")
        return report

    def decide(self, report) -> Decision:
        a = self.task.acceptance
        verdict = "keep" if report.ci_low > a.min_speedup else "discard"
        reason = (f"speedup {report.speedup:.3f}x, {a.confidence:.0%} interval [{report.ci_low:.3f}, "
                  f"{report.ci_high:.3f}], p={report.p_value:.4f} against {a.min_speedup}x")
        if verdict != "keep":
            reason = f"not faster: {reason}"
        if report.confirmation:
            reason = f"confirmation {report.confirmation} of {a.confirmations}: {reason}"
        return Decision(candidate=report.candidate, verdict=verdict, stage="decision", reason=reason,
                        speedup=report.speedup, ci_low=report.ci_low, ci_high=report.ci_high)

    def keep(self, n, proposal: Proposal, decision: Decision, decision_sha: str, worktree: Path,
             server: Server, args: dict) -> None:
        message = (f"nightshift: {proposal.summary}\n\nCandidate {n} of run {self.s.run_id}, "
                   f"proposed by {proposal.proposer}.\n\n"
                   f"Nightshift-Speedup: {decision.speedup:.4f}x [{decision.ci_low:.4f}, {decision.ci_high:.4f}] "
                   f"at {self.task.acceptance.confidence:.0%}\n"
                   f"Nightshift-Parity: {self.parity_digest}\n"
                   f"Nightshift-Trace-Event: {decision_sha}\n")
        sha = self.s.workspace.commit(worktree, args, message)
        self.emit(Commit(candidate=n, branch=self.s.workspace.branch, commit=sha, decision_sha256=decision_sha))
        if self.incumbent.server is not self.reference:
            self.s.stop(self.incumbent.server)
        self.incumbent = Incumbent(server, dict(args), worktree)
        self.kept += 1
        self.best_speedup *= decision.speedup

