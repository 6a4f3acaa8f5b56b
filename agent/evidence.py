"""Replay's second half: every recorded keep/discard must follow from its recorded evidence.

The speedup and interval are recomputed from the benchmark's samples with the task's acceptance
rule; a token audit's verdict is recomputed from its deficits and tolerance; where the task sets
benchmark.max_idle_cpu, a benchmark counts only if the candidate's server did not work while the
incumbent was measured. A decision that does not follow names its record."""
from __future__ import annotations

import math

from agent.stats import accepts, estimate_speedup, idle_work, order_signs, plan_looks, sequential_estimate
from agent.task import Acceptance, Benchmark
from agent.token_audit import audit_passed
from traces import TraceError
from traces.schema import BenchReport, Decision, Record, Remeasured, Resumed, RunStarted, TokenAudit

TOLERANCE = 1e-9


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


def check_decisions(records: list[Record]) -> int:
    """Re-derives each decision at the benchmark, audit and decision stages; returns how many were checked."""
    started: RunStarted = records[0].event
    acceptance = Acceptance.model_validate(started.task.get("acceptance", {}))
    b = Benchmark.model_validate(started.task.get("benchmark", {}))
    planned = plan_looks(b.repetitions, b.max_repetitions, b.look_every)
    audited = bool(started.task.get("audit", {}).get("enabled", False))
    reports: dict[tuple[int, int], BenchReport] = {}
    audits: dict[tuple[int, int], TokenAudit] = {}
    checked = 0
    for record in records:
        event, line = record.event, record.seq + 1
        if isinstance(event, BenchReport):
            reports[event.candidate, event.confirmation] = event
            _check_report(event, acceptance, line, planned)
            busy = idle_work(event.samples, b.max_idle_cpu)
            if busy:
                raise TraceError(line, f"benchmark of candidate {event.candidate} counted, though {busy}")
        elif isinstance(event, TokenAudit):
            audits[event.candidate, event.confirmation] = event
            if (event.violation_count == 0) != (event.deficits.max <= event.tolerance_nats):
                raise TraceError(line, f"audit of candidate {event.candidate}: {event.violation_count} violations "
                                       f"do not follow from max deficit {event.deficits.max} against tol "
                                       f"{event.tolerance_nats}")
        elif isinstance(event, (Resumed, Remeasured)):  # evaluated again: the candidates' old evidence is void
            void = {event.candidate, *getattr(event, "in_flight", [])}
            reports = {key: r for key, r in reports.items() if key[0] not in void}
            audits = {key: a for key, a in audits.items() if key[0] not in void}
        elif isinstance(event, Decision) and event.stage in ("audit", "decision") and event.verdict != "timeout":
            _check_decision(event, line, reports, audits, acceptance, audited)
            checked += 1
    return checked


def _check_report(report: BenchReport, acceptance: Acceptance, line: int, planned: list[int]) -> None:
    candidate = [getattr(s, report.metric) for s in report.samples if s.role == "candidate"]
    incumbent = [getattr(s, report.metric) for s in report.samples if s.role == "incumbent"]
    if report.sequential is None:  # fixed repetitions, before the stopping rule was recorded
        estimate = estimate_speedup(candidate, incumbent, acceptance.min_speedup, acceptance.confidence)
    else:
        estimate = _check_sequential(report, candidate, incumbent, acceptance, line, planned)
    if not (_close(report.speedup, estimate.speedup) and _close(report.ci_low, estimate.ci_low)
            and _close(report.ci_high, estimate.ci_high)):
        raise TraceError(line, f"benchmark of candidate {report.candidate}: its samples give "
                               f"{estimate.speedup:.4f}x [{estimate.ci_low:.4f}, {estimate.ci_high:.4f}], the record "
                               f"says {report.speedup:.4f}x [{report.ci_low:.4f}, {report.ci_high:.4f}]")


def _check_sequential(report: BenchReport, candidate: list[float], incumbent: list[float], acceptance: Acceptance,
                      line: int, planned: list[int]):
    """The looks again from the samples: the planned looks and the boundaries from the spending function, each
    statistic, and the stop at the first look that crossed a boundary, with no pair measured after it."""
    recorded, where = report.sequential, f"benchmark of candidate {report.candidate}"
    if recorded.planned != planned:
        raise TraceError(line, f"{where}: planned looks {recorded.planned}, the task's benchmark plans {planned}")
    logs = [math.log(c / i) for c, i in zip(candidate, incumbent)]
    try:
        estimate, derived = sequential_estimate(logs, order_signs([s.role for s in report.samples]), planned,
                                                acceptance.confidence, acceptance.min_speedup)
    except ValueError as exc:
        raise TraceError(line, f"{where}: {exc}") from None
    if recorded.spending != derived.spending or not _close(recorded.alpha, derived.alpha):
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
