"""Replay's second half: every recorded keep/discard must follow from its recorded evidence.

The speedup and interval are recomputed from the benchmark's samples with the task's acceptance
rule, by the estimator the benchmark recorded (a trace written before the estimator was a setting was decided
by the mean with a t interval, and is re-derived by it); a token audit's verdict is recomputed from its recorded deficits by the audit rule (its counts must
agree with those deficits, and the control and A/A it was compared with are the ones in the trace); where the task sets
benchmark.max_idle_cpu, a benchmark counts only if the candidate's server did not work while the
incumbent was measured. A decision that does not follow names its record."""
from __future__ import annotations

import math

from agent.stages.stats import (MEAN_T, accepts, estimate_speedup, idle_work, moved_by_code, order_signs,
                                plan_looks, sequential_estimate)
from agent.world.task import Acceptance, Audit, Benchmark
from agent.stages.token_audit import EPSILON_NATS, audit_passed, base_controls, calibration_refusal, judge
from traces import TraceError
from agent.run import budget
from traces.schema import (BenchReport, Commit, Decision, ErrorSpent, IncumbentReverted, NullCheck, Record,
                           Remeasured, Resumed, Reverted, RunFinished, RunStarted, TokenAudit)

TOLERANCE = 1e-9


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


def check_decisions(records: list[Record]) -> int:
    """Re-derives each decision at the benchmark, audit and decision stages; returns how many were checked."""
    started: RunStarted = records[0].event
    acceptance = Acceptance.model_validate(started.task.get("acceptance", {}))
    b = Benchmark.model_validate(started.task.get("benchmark", {}))
    planned = plan_looks(b.repetitions, b.max_repetitions, b.look_every)
    estimator = task_estimator(started.task)
    audited = bool(started.task.get("audit", {}).get("enabled", False))
    rule = Audit.model_validate(started.task.get("audit", {}))
    calibrations: dict[int, TokenAudit] = {}
    honest: dict[int, TokenAudit] = {}
    reports: dict[tuple[int, int], BenchReport] = {}
    audits: dict[tuple[int, int], TokenAudit] = {}
    incumbent_audits: dict[int, TokenAudit] = {}
    keeps: list[tuple[str, int, float]] = []  # (commit, candidate, speedup) of the keeps in effect
    speedups: dict[str, float] = {}
    checked_head: str | None = None  # the commit the last passing end-of-run audit names
    checked = 0
    shares: dict[int, float] = {}  # candidate -> the confidence its share of the night's budget set
    spent = 0
    for record in records:
        event, line = record.event, record.seq + 1
        if isinstance(event, ErrorSpent):
            spent += 1
            derived = budget.spend(acceptance.night_alpha or 0.0, event.candidate, spent)
            if not acceptance.night_alpha or event.index != spent or not all(
                    _close(getattr(event, f), getattr(derived, f)) for f in ("alpha", "spent", "confidence")) \
                    or not _close(event.night_alpha, acceptance.night_alpha) or event.spent > event.night_alpha:
                raise TraceError(line, f"candidate {event.candidate}'s share of the night's error budget (index "
                                       f"{event.index}, alpha {event.alpha:.4g}, spent {event.spent:.4g}) is not the "
                                       f"task's: index {spent}, alpha {derived.alpha:.4g}, spent {derived.spent:.4g}")
            shares[event.candidate] = event.confidence
        if isinstance(event, NullCheck) and event.report is not None:
            level = budget.spend(acceptance.night_alpha or 0.0, 0, event.index).confidence
            _check_report(event.report, acceptance.model_copy(update={"confidence": level}), line, planned, estimator)
            if event.false_keep != accepts(event.report.ci_low, acceptance.min_speedup):
                raise TraceError(line, f"the null check at index {event.index} says false_keep={event.false_keep}, "
                                       f"but its interval's low end {event.report.ci_low:.3f} says otherwise")
        if isinstance(event, Decision) and event.verdict == "keep":
            speedups[record.sha256] = event.speedup or 1.0
        elif isinstance(event, Commit):
            keeps.append((event.commit, event.candidate, speedups.get(event.decision_sha256, 1.0)))
        elif isinstance(event, IncumbentReverted):
            _check_reverted(event, line, keeps, incumbent_audits, started.base_commit)
        elif isinstance(event, Reverted) and keeps:
            keeps.pop()
        if isinstance(event, BenchReport):
            reports[event.candidate, event.confirmation] = event
            level = acceptance
            if acceptance.night_alpha:
                if event.candidate not in shares:
                    raise TraceError(line, f"benchmark of candidate {event.candidate} without its share of the "
                                           f"night's error budget recorded before it")
                level = acceptance.model_copy(update={"confidence": shares[event.candidate]})
            _check_report(event, level, line, planned, estimator)
            busy = idle_work(event.samples, b.max_idle_cpu) or moved_by_code(event.samples)
            if busy:
                raise TraceError(line, f"benchmark of candidate {event.candidate} counted, though {busy}")
        elif isinstance(event, TokenAudit):
            _check_audit(event, line, rule, acceptance, calibrations, honest)
            honest.update((a.sample_seed, a) for a in base_controls([event], started.base_commit))
            if event.calibration:
                calibrations[event.sample_seed] = event
            elif event.incumbent:
                incumbent_audits[event.sample_seed] = event
                if event.candidate == 0 and audit_passed(event):
                    checked_head = event.commit
            else:
                audits[event.candidate, event.confirmation] = event
        elif isinstance(event, (Resumed, Remeasured)):  # evaluated again: the candidates' old evidence is void
            void = {event.candidate, *getattr(event, "in_flight", [])}
            reports = {key: r for key, r in reports.items() if key[0] not in void}
            audits = {key: a for key, a in audits.items() if key[0] not in void}
        elif isinstance(event, Decision) and event.stage in ("audit", "decision") and event.verdict != "timeout":
            _check_decision(event, line, reports, audits, acceptance, audited)
            checked += 1
    last = records[-1].event
    if checks_incumbent(records) and keeps and isinstance(last, RunFinished) and not last.resumable \
            and checked_head != keeps[-1][0]:
        raise TraceError(len(records), f"the run finished with candidate {keeps[-1][1]}'s commit "
                                       f"{keeps[-1][0][:12]} at the head, never audited on fresh prompts at its end")
    return checked


def checks_incumbent(records: list[Record]) -> bool:
    """The single-GPU loop's runs since the incumbent is checked (a parallel run's coordinator does not audit its
    head): each such run that ends with a kept head audits it once more on fresh prompts."""
    started = records[0].event
    return started.task.get("sandbox", {}).get("workers", 1) <= 1 and any(
        isinstance(r.event, TokenAudit) and r.event.control_verdict is not None for r in records)


def head_audited_at_end(records: list[Record], head: str) -> bool:
    """A passing end-of-run audit of `head` (an incumbent audit of candidate 0 naming that commit)."""
    return any(isinstance(r.event, TokenAudit) and r.event.incumbent and r.event.candidate == 0
               and r.event.commit == head and audit_passed(r.event) for r in records)

def _check_reverted(event: IncumbentReverted, line: int, keeps: list, incumbent_audits: dict, base: str) -> None:
    """A revert follows from a failing audit of the incumbent on fresh prompts, and takes back the last keep in
    effect, to the commit before it."""
    failed = incumbent_audits.get(event.audit_seed)
    if failed is None or audit_passed(failed):
        raise TraceError(line, f"candidate {event.kept_by}'s keep was taken back, but the incumbent's audit "
                               f"(seed {event.audit_seed}) {'passed' if failed else 'is missing'}")
    if not keeps:
        raise TraceError(line, "a keep was taken back, but none is in effect")
    commit, candidate, speedup = keeps[-1]
    restored = keeps[-2][0] if len(keeps) > 1 else base
    if (event.failed_commit, event.kept_by, event.restored) != (commit, candidate, restored) \
            or failed.commit != commit or not _close(event.speedup, speedup):
        raise TraceError(line, f"the revert names {event.failed_commit[:12]} (candidate {event.kept_by}) back to "
                               f"{event.restored[:12]}; the trace's last keep in effect is {commit[:12]} (candidate "
                               f"{candidate}) on {restored[:12]}, audited at {failed.commit[:12] or 'no commit'}")


def _check_audit(event: TokenAudit, line: int, rule: Audit, acceptance: Acceptance,
                 calibrations: dict[int, TokenAudit], honest: dict[int, TokenAudit] | None = None) -> None:
    """A token audit's counts agree with its recorded deficits, and its verdict follows from them by the rule.
    `honest`: the trace's earlier base-tree controls by seed (token_audit.base_controls), the only audits a verdict
    may pool as honest deficits."""
    where = f"audit of candidate {event.candidate}" + (" (the A/A)" if event.calibration else "")
    honest = honest or {}
    side = event.side
    if side is None:  # written before the rate rule: violations against the tolerance alone
        if (event.violation_count == 0) != (event.deficits.max <= event.tolerance_nats):
            raise TraceError(line, f"{where}: {event.violation_count} violations do not follow from max deficit "
                                   f"{event.deficits.max} against tol {event.tolerance_nats}")
        return
    beyond = sum(v > event.tolerance_nats + EPSILON_NATS for v in side.values)
    if not (side.non_top1 == sum(side.per_request) == len(side.values) == event.deficits.non_top1
            and side.tokens == sum(side.request_tokens) == event.tokens
            and math.isclose(max(side.values, default=0.0), event.deficits.max, abs_tol=1e-3)
            and beyond == event.violation_count and _close(event.tolerance_nats, rule.hard_bound_nats)):
        raise TraceError(line, f"{where}: its counts do not agree with its recorded deficits ({side.non_top1} not "
                               f"top-1 in {len(side.values)} deficits and {sum(side.per_request)} per request, "
                               f"{event.violation_count} violations for {beyond} beyond {event.tolerance_nats:g})")
    if event.calibration:
        return
    if event.verdict is None:
        raise TraceError(line, f"{where}: a candidate's audit without a verdict")
    recorded = event.verdict
    calibration = calibrations.get(recorded.calibration_seed) if recorded.calibration_seed is not None else None
    if recorded.calibration_seed is not None and calibration is None:
        raise TraceError(line, f"{where}: compared with an A/A (seed {recorded.calibration_seed}) the trace lacks")
    if calibration is not None and (refusal := calibration_refusal(calibration, rule)):
        raise TraceError(line, f"{where}: judged after an A/A that should have refused the run: {refusal}")
    args = (rule.hard_bound_nats, rule.rate_ratio, acceptance.confidence)
    aa = calibration.side if calibration else None
    weighed = recorded.magnitude_p_value is not None  # traces from before the magnitude test replay without it
    control = event.control
    if event.control_verdict is not None:
        _check_verdict(event.control_verdict, _invalid(event, "control", line, where)
                       or judge(event.control, None, aa, *args,
                                magnitude=event.control_verdict.magnitude_p_value is not None,
                                honest=_pooled(event.control_verdict, honest, f"{where}, its control", line)),
                       f"{where}, its control", line)
        if not event.control_verdict.passed:
            control = None  # a control that fails its own audit is no reference for the candidate
    _check_verdict(recorded, _invalid(event, "candidate", line, where)
                   or judge(side, control, aa, *args, magnitude=weighed,
                            honest=_pooled(recorded, honest, where, line)), where, line)


def _pooled(verdict, honest: dict[int, TokenAudit], where: str, line: int) -> list:
    """The honest deficits a verdict pooled (its honest_seeds): each an earlier control of the base tree that
    passed; a seed that names anything else (another commit's control, a failed one, a later record) is refused."""
    seeds = verdict.honest_seeds or []
    unknown = [s for s in seeds if s not in honest]
    if unknown:
        raise TraceError(line, f"{where}: pools the deficits of audit {unknown[0]}, which is no earlier control of the "
                               f"base tree that passed")
    return [honest[s].control for s in seeds]


def _invalid(event: TokenAudit, side: str, line: int, where: str):
    """The recorded invalid outputs of one side, each consistent with itself; a verdict of `invalid` for them (None
    when that side has none)."""
    mine = [e for e in event.invalid if e.side == side]
    for e in mine:
        if e.kind == "vocabulary" and (e.token is None or e.limit is None or 0 <= e.token < e.limit) \
                or e.kind == "count" and e.limit is None:
            raise TraceError(line, f"{where}: invalid output (pass {e.repetition}, request {e.request}) is not what "
                                   f"it says: {e.detail}")
    if not mine:
        return None
    return type(event.verdict)(passed=False, test="invalid", reason="", hard_bound_nats=0, rate_ratio=0, alpha=0,
                               reference="none", reference_non_top1=0, reference_tokens=0, rate_p_value=1.0,
                               concentration_p_value=1.0)


def _check_verdict(recorded, derived, where: str, line: int) -> None:
    if (recorded.passed, recorded.test, recorded.reference) != (derived.passed, derived.test, derived.reference) \
            or not (_close(recorded.rate_p_value, derived.rate_p_value)
                    and _close(recorded.concentration_p_value, derived.concentration_p_value)) \
            or (derived.magnitude_p_value is not None and not _close(recorded.magnitude_p_value,
                                                                   derived.magnitude_p_value)):
        raise TraceError(line, f"{where}: recorded verdict '{recorded.test}' (rate p={recorded.rate_p_value:.4g}, "
                               f"concentration p={recorded.concentration_p_value:.4g}) does not follow from its "
                               f"deficits and the rule: '{derived.test}' (rate p={derived.rate_p_value:.4g}, "
                               f"concentration p={derived.concentration_p_value:.4g})")


def task_estimator(task: dict) -> str:
    """The estimator a run's task set: as recorded in its run_started record, or, where the task predates the
    setting, the rule that decided then (the mean with a t interval), not today's default."""
    return task.get("acceptance", {}).get("estimator", MEAN_T)


def _check_report(report: BenchReport, acceptance: Acceptance, line: int, planned: list[int],
                  estimator: str = MEAN_T) -> None:
    candidate = [getattr(s, report.metric) for s in report.samples if s.role == "candidate"]
    incumbent = [getattr(s, report.metric) for s in report.samples if s.role == "incumbent"]
    if report.sequential is None:  # fixed repetitions, before the stopping rule was recorded
        estimate = estimate_speedup(candidate, incumbent, acceptance.min_speedup, acceptance.confidence)
    else:
        estimate = _check_sequential(report, candidate, incumbent, acceptance, line, planned, estimator)
    if not (_close(report.speedup, estimate.speedup) and _close(report.ci_low, estimate.ci_low)
            and _close(report.ci_high, estimate.ci_high)):
        raise TraceError(line, f"benchmark of candidate {report.candidate}: its samples give "
                               f"{estimate.speedup:.4f}x [{estimate.ci_low:.4f}, {estimate.ci_high:.4f}], the record "
                               f"says {report.speedup:.4f}x [{report.ci_low:.4f}, {report.ci_high:.4f}]")


def _check_sequential(report: BenchReport, candidate: list[float], incumbent: list[float], acceptance: Acceptance,
                      line: int, planned: list[int], estimator: str = MEAN_T):
    """The looks again from the samples: the planned looks and the boundaries from the spending function, the
    estimator the task set, each statistic, and the stop at the first look that crossed a boundary, with no
    pair measured after it."""
    recorded, where = report.sequential, f"benchmark of candidate {report.candidate}"
    if recorded.planned != planned:
        raise TraceError(line, f"{where}: planned looks {recorded.planned}, the task's benchmark plans {planned}")
    if recorded.estimator != estimator:
        raise TraceError(line, f"{where}: decided by estimator {recorded.estimator}, the task sets {estimator}")
    logs = [math.log(c / i) for c, i in zip(candidate, incumbent)]
    try:
        estimate, derived = sequential_estimate(logs, order_signs([s.role for s in report.samples]), planned,
                                                acceptance.confidence, acceptance.min_speedup, recorded.estimator)
    except ValueError as exc:
        raise TraceError(line, f"{where}: {exc}") from None
    if recorded.spending != derived.spending or recorded.order_term != derived.order_term \
            or not _close(recorded.alpha, derived.alpha):
        raise TraceError(line, f"{where}: recorded spending {recorded.spending} at alpha {recorded.alpha}, the task "
                               f"gives {derived.spending} at alpha {derived.alpha}")
    for got, want in zip(recorded.looks, derived.looks):
        if got.pairs != want.pairs or not all(_close(getattr(got, f), getattr(want, f)) for f in
                                              ("spent_alpha", "z_boundary", "boundary", "statistic")):
            raise TraceError(line, f"{where}: look at {got.pairs} pairs does not follow from the samples and the "
                                   f"spending function (statistic {got.statistic:.4f} vs {want.statistic:.4f}, "
                                   f"boundary {got.boundary:.4f} vs {want.boundary:.4f})")
    if len(recorded.looks) != len(derived.looks) or recorded.stopped != derived.stopped \
            or derived.looks[-1].pairs != len(logs):
        raise TraceError(line, f"{where}: stopped '{recorded.stopped}' after {len(recorded.looks)} looks and "
                               f"{len(logs)} pairs, the rule stops '{derived.stopped}' after {len(derived.looks)} "
                               f"looks at {derived.looks[-1].pairs} pairs")
    return estimate


def _check_decision(decision: Decision, line: int, reports: dict, audits: dict, acceptance: Acceptance,
                    audited: bool) -> None:
    n = decision.candidate
    confirmations = sorted(k for (c, k) in reports if c == n)
    if not confirmations:
        raise TraceError(line, f"candidate {n} was decided at stage {decision.stage} without a benchmark")
    last = confirmations[-1]
    if decision.stage == "audit":
        audit = audits.get((n, last))
        if audit is None or audit_passed(audit):
            raise TraceError(line, f"candidate {n} was rejected at the audit, but its audit passed or is missing")
        return
    report = reports[n, last]
    if not (_close(decision.speedup, report.speedup) and _close(decision.ci_low, report.ci_low)):
        raise TraceError(line, f"decision for candidate {n} quotes other numbers than its benchmark")
    if (decision.verdict == "keep") != accepts(report.ci_low, acceptance.min_speedup):
        raise TraceError(line, f"candidate {n}: verdict {decision.verdict} does not follow from the interval's low end "
                               f"{report.ci_low:.4f} against min_speedup {acceptance.min_speedup}")
    if decision.verdict == "keep":
        if last != acceptance.confirmations:
            raise TraceError(line, f"candidate {n} was kept after {last} of {acceptance.confirmations} confirmations")
        for k in confirmations:
            if k < last and not accepts(reports[n, k].ci_low, acceptance.min_speedup):
                raise TraceError(line, f"candidate {n} was kept though benchmark {k} did not pass")
            if audited and ((n, k) not in audits or not audit_passed(audits[n, k])):
                raise TraceError(line, f"candidate {n} was kept without a passing token audit of benchmark {k}")
