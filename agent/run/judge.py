"""The Judge: one candidate's stages, from the edit surface to the decision, each rejection typed with its stage.

surface -> apply -> build -> start + parity -> benchmark (+ liveness, the roofline quarantine) -> audit -> decision,
then each confirmation while it keeps passing. The candidate's worktree and servers belong to its Trial; the
reference and the incumbent to the run (agent/run/baseline.py, agent/run/incumbent.py)."""
from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Callable

from agent.run import budget
from agent.run.incumbent import Incumbent
from agent.run.pool import ServerPool, ServerRequest, Starting
from agent.run.setup import RunSetup
from agent.run.trial import Trial
from agent.run.workspace import ApplyError
from agent.stages import bench, engine_config, liveness
from agent.stages.build import BuildError, build
from agent.stages.completions import ANSWER_ERRORS
from agent.stages.parity import CalledOff, fresh_parity
from agent.stages.stats import accepts
from agent.stages.surface import engine_args_violation, surface_violation
from agent.stages.token_audit import audit_passed, base_controls, describe, run_audit
from sandbox.base import SandboxError, Server
from sandbox.host import describe_snapshot, server_snapshot
from traces import read_trace
from traces.schema import (BenchReport, Decision, NullCheck, PatchApplied, Proposal, SampleTaken, Stage,
                           TokenAudit)


class Remeasure(Exception):
    """The incumbent this candidate was measured beside failed its audit and the branch went back
    (agent/run/recheck.py): the candidate's evidence is void, and it is judged again on the new head."""

    def __init__(self, measured_against: str, reason: str):
        super().__init__(reason)
        self.measured_against, self.reason = measured_against, reason


class Rejected(Exception):
    def __init__(self, stage: Stage, reason: str, verdict: str = "discard"):
        super().__init__(reason)
        self.stage, self.reason, self.verdict = stage, reason, verdict


def started(starting: Starting, index: int) -> Server:
    """One of a trial's servers once it answers; a failed start is the candidate's crash at `start`."""
    try:
        return starting.get(index)
    except SandboxError as exc:
        raise Rejected("start", f"{exc}; log tail: {exc.logs[-1500:]}", "crash") from None


class Judge:
    def __init__(self, setup: RunSetup, pool: ServerPool, reference: Server, incumbent: Incumbent,
                 calibration: TokenAudit | None, dedicated_parity: bool, emit: Callable):
        self.s, self.task, self.pool, self.emit = setup, setup.task, pool, emit
        self.reference, self.incumbent, self.calibration = reference, incumbent, calibration
        self.dedicated_parity = dedicated_parity
        path = getattr(setup.trace, "path", None)
        recorded = [r.event for r in read_trace(path)] if path and Path(path).is_file() else []
        """What a resumed run's trace holds already (read once): its spent shares and its base controls."""
        self.spent = budget.spent_index(recorded) if setup.task.acceptance.night_alpha else 0
        """Shares of the night's error budget the trace has recorded (agent/run/budget.py): a resume goes on counting."""
        self.nulls_checked = self.spent
        """The budget index of the last null check (acceptance.null_every); a resumed run checks from its next one."""
        self.honest = base_controls(recorded, setup.base_commit)
        """The base tree's controls audited so far (token_audit.base_controls), the magnitude test's honest pool; a
        resumed run starts from its trace's, and Recheck shares the list."""
        self.recheck = None
        """agent/run/recheck.py's Recheck where a flagged incumbent is confirmed and taken back (the single-GPU loop);
        without one, a control that fails is only left out as the candidate's reference."""

    def judge(self, trial: Trial, proposal: Proposal, args: dict, audits: list[TokenAudit]):
        """Surface, apply, build, parity, benchmark and audit: the decision, the production server and parity digest."""
        n, production, digest = trial.candidate, None, ""
        try:
            self.check_surface(proposal, args)
            files = self.apply(trial, proposal, args)
            self.build(n, trial.tree, files)
            production, digest = self.check_parity(trial, args)
            self.check_engine_config(production, args, files)
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

    def check_engine_config(self, production: Server, args: dict, files: list[str]) -> None:
        """A code change must serve the incumbent's engine configuration, as its server logged it at start, but for
        the fields its own flags move, to the values the trusted tree's vLLM predicts for them
        (agent/stages/engine_config.py); a change of flags alone is judged as flags are. Before the benchmark: the
        cheapest check first. Both logs as they stood when the servers answered: an incumbent that has served all
        night has pushed its start out of any tail of its log."""
        flags = dict(args) != dict(self.incumbent.args)
        if flags and not files:
            return
        theirs, ours = self.pool.start_log(self.incumbent.server), self.pool.start_log(production)
        predicted = None
        if flags and engine_config.config_fields(theirs) is not None:
            try:
                predicted = engine_config.predicted_sides(
                    self.pool.trusted, *(self.pool.spec(ServerRequest("predicted", self.incumbent.tree, a))
                                         for a in (self.incumbent.args, args)))
            except engine_config.PredictionError as exc:
                raise Rejected("benchmark", f"flags and code together: which engine configuration fields the flags "
                                            f"move could not be predicted ({exc}), so what the code moved cannot be "
                                            f"told apart; propose the flags and the code as two candidates") from None
        why = engine_config.moved_by_code(theirs, ours, predicted)
        if why:
            raise Rejected("benchmark", why)

    def build(self, n: int, tree, files: list[str]) -> None:
        try:
            self.emit(build(n, tree, files, bytecode_from=self.pool.trusted, link=self.s.linked))
        except BuildError as exc:
            raise Rejected("build", str(exc)) from None

    def check_parity(self, trial: Trial, args: dict) -> tuple[Server, str]:
        """Parity on fresh prompts; returns the candidate's production server and the parity digest. With
        dedicated parity servers (batch-invariant mode, say) the candidate's two servers start side by side,
        parity is checked as soon as the parity server answers, and a failure calls off the production start; a
        production start that fails while parity runs stops parity there (seen on a GPU: a production server out
        of memory, then five minutes of parity that could decide nothing)."""
        n = trial.candidate
        requests = [ServerRequest(f"candidate-{n}", trial.tree, args)]
        if self.dedicated_parity:
            requests.insert(0, ServerRequest(f"candidate-{n}-parity", trial.tree, args, parity=True))
        starting = trial.begin(requests)
        try:
            subject = started(starting, 0)
            try:
                report = fresh_parity(self.task, self.s.vocab_size, self.reference, n, subject,
                                      stop=starting.off if self.dedicated_parity else None)
            except CalledOff:
                started(starting, len(requests) - 1)  # raises the production start's failure, the candidate's crash
                raise
            except ANSWER_ERRORS as exc:
                raise Rejected("parity", f"candidate failed to answer: {exc}", "crash") from None
            self.emit(report)
            if not report.ok:
                d = report.divergence
                where = "long request" if report.long_divergence is not None else "prompt"
                if report.long_divergence is not None:
                    shape = report.long_requests[d.prompt_index]
                    where = (f"long request ({shape.input_len} + {shape.max_tokens} tokens"
                             f"{', production stops' if shape.production else ''})")
                raise Rejected("parity", f"{where} {d.prompt_index} diverges at token {d.position}: expected "
                                         f"{d.expected}, got {d.got} ({d.got_len}/{d.expected_len} tokens)")
            production = started(starting, len(requests) - 1)
        except BaseException:
            starting.cancel()
            raise
        if subject is not production:
            trial.release(subject)
        return production, report.digest

    def evaluate(self, trial: Trial, server: Server, files: list[str], audits: list[TokenAudit]) -> Decision:
        """The benchmark, its token audit and the decision; then each confirmation, while it keeps passing. With a
        night's error budget, the candidate's share is recorded first and sets the interval's level."""
        night = self.task.acceptance.night_alpha
        if not night:
            return self._evaluate(trial, server, files, audits)
        self.spent += 1
        share = budget.spend(night, trial.candidate, self.spent)
        self.emit(share)
        task = self.task
        self.task = task.model_copy(update={"acceptance": task.acceptance.model_copy(
            update={"confidence": share.confidence})})
        try:
            return self._evaluate(trial, server, files, audits)
        finally:
            self.task = task

    def null_due(self) -> bool:
        """A null check is due: the night's budget is on and the last first benchmark was the null_every-th."""
        a = self.task.acceptance
        return bool(a.night_alpha and a.null_every and self.spent and self.spent % a.null_every == 0
                    and self.nulls_checked < self.spent)

    def null_check(self) -> NullCheck:
        """The incumbent against a second server of its own tree and args, at the level of the last candidate's
        share of the night's budget (no share is spent on it); the second server is released afterwards."""
        a = self.task.acceptance
        level = budget.spend(a.night_alpha, 0, self.spent).confidence
        task = self.task.model_copy(update={"acceptance": a.model_copy(update={"confidence": level})})
        self.nulls_checked = self.spent
        try:
            twin = self.pool.start([ServerRequest(f"null-{self.spent}", self.incumbent.tree, self.incumbent.args)])[0]
        except SandboxError as exc:
            return self._null_failed(f"its second server did not start: {exc}")
        try:
            seeds = [secrets.randbits(63) for _ in range(task.benchmark.repetitions + 1)]
            result = asyncio.run(bench.compare(task, self.incumbent.server, twin, self.s.vocab_size, seeds))
        except (bench.WorkMismatch, bench.HarnessBound, bench.NotCounted, bench.PassFailed, *ANSWER_ERRORS) as exc:
            return self._null_failed(f"its benchmark failed: {exc}")
        finally:
            self.pool.release(twin)
        report = bench.report(0, task, result.samples, result.estimate, None, result.note)
        event = NullCheck(index=self.spent, report=report, min_speedup=a.min_speedup,
                          false_keep=accepts(report.ci_low, a.min_speedup))
        self.emit(event)
        return event

    def _null_failed(self, why: str) -> NullCheck:
        event = NullCheck(index=self.spent, report=None, min_speedup=self.task.acceptance.min_speedup,
                          false_keep=False, failed=why)
        self.emit(event)
        return event

    def _evaluate(self, trial: Trial, server: Server, files: list[str], audits: list[TokenAudit]) -> Decision:
        for confirmation in range(self.task.acceptance.confirmations + 1):
            report, outputs, control = self.benchmark(trial, server, files, confirmation)
            if self.task.audit.enabled:
                audits.append(self.audit(trial.candidate, outputs, confirmation, control))
                verdict = audits[-1].control_verdict
                if verdict is not None and not verdict.passed and self.recheck is not None:
                    head = self.s.workspace.head()
                    if not self.recheck.flagged(trial.candidate, confirmation, audits[-1]):
                        raise Remeasure(head, f"measured beside the incumbent at {head[:12]}, which failed its "
                                              f"audit: {verdict.reason}")
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
        except (bench.WorkMismatch, bench.HarnessBound, bench.NotCounted) as exc:
            raise Rejected("benchmark", str(exc)) from None
        except bench.PassFailed as exc:
            if exc.role == "candidate":
                raise Rejected("benchmark", f"{exc}; {describe_snapshot(server_snapshot(server))}", "crash") from None
            self.incumbent.restart(n, confirmation, exc)
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

    def audit(self, n: int, outputs, confirmation: int = 0, control=None) -> TokenAudit:
        event = run_audit(n, self.reference, outputs, self.task.audit, self.task.benchmark.request_timeout_s,
                          self.task.acceptance.confidence, control, self.calibration, confirmation,
                          vocab_size=self.s.vocab_size, expected_tokens=self.task.workload.output_len,
                          commit=self.s.workspace.head() if control is not None else "", honest=list(self.honest))
        self.emit(event)
        self.honest += base_controls([event], self.s.base_commit)
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
