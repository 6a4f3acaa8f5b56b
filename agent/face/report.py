"""Run summaries and the review tables, read back from the trace alone."""
from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from agent.run.relaxed import of_run
from agent.stages.token_audit import trailer
from agent.face.view import noise_line
from traces import read_trace
from traces.schema import (BenchReport, Commit, Decision, IncumbentReverted, ParityReport, PatchApplied, Proposal,
                           NoiseFloor, NotebookEntry, Resumed, Reverted, RunFinished, SelfParity, TokenAudit)


def _by_candidate(records) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for record in records:
        event = record.event
        n = getattr(event, "candidate", None)
        if n is not None and n > 0:
            out.setdefault(n, {})[event.kind] = event
    return out


def _audits(records) -> dict[int, list[TokenAudit]]:
    out: dict[int, list[TokenAudit]] = {}
    for record in records:
        if isinstance(record.event, TokenAudit) and not record.event.incumbent:
            out.setdefault(record.event.candidate, []).append(record.event)
    return out


def _taken_back(records) -> list[dict]:
    """Each kept change found wrong later and taken back: what found it and the commit that restored the branch."""
    commits = {r.event.event_sha256: r.event.commit for r in records if isinstance(r.event, Reverted)}
    return [{"at_record": r.seq + 1, **r.event.model_dump(), "revert_commit": commits.get(r.sha256, "")}
            for r in records if isinstance(r.event, IncumbentReverted)]


def _incumbent_checks(records) -> dict:
    """The incumbent checked in every benchmark: how many controls were judged and failed, the audits on fresh
    prompts, and the end-of-run audit of the branch head."""
    judged = [r.event.control_verdict for r in records if isinstance(r.event, TokenAudit) and r.event.control_verdict]
    fresh = [r.event for r in records if isinstance(r.event, TokenAudit) and r.event.incumbent]
    final = [a for a in fresh if a.candidate == 0]
    return {"controls_judged": len(judged), "controls_failed": sum(not v.passed for v in judged),
            "fresh_audits": len(fresh), "fresh_failed": sum(not (a.verdict and a.verdict.passed) for a in fresh),
            "final": ({"commit": final[-1].commit, "passed": bool(final[-1].verdict and final[-1].verdict.passed),
                       "reason": final[-1].verdict.reason if final[-1].verdict else ""} if final else None)}


def write_summary(run_dir: Path) -> str:
    records = read_trace(Path(run_dir) / "trace.jsonl")
    candidates = _by_candidate(records)
    finished = next((r.event for r in reversed(records) if isinstance(r.event, RunFinished)), None)
    audits = _audits(records)
    rows, measurements = [], []
    for n, events in sorted(candidates.items()):
        proposal: Proposal | None = events.get("proposal")
        decision: Decision | None = events.get("decision")
        bench: BenchReport | None = events.get("benchmark")
        rows.append({"candidate": n, "summary": proposal.summary if proposal else "",
                     "verdict": decision.verdict if decision else "unfinished",
                     "stage": decision.stage if decision else "", "reason": decision.reason if decision else "",
                     "speedup": bench.speedup if bench else None,
                     "ci": [bench.ci_low, bench.ci_high] if bench else None,
                     "audit": {"tokens": sum(a.tokens for a in audits[n]),
                               "violations": sum(a.violation_count for a in audits[n]),
                               "max_deficit_nats": max(a.deficits.max for a in audits[n]),
                               "non_top1": sum(a.deficits.non_top1 for a in audits[n]),
                               "control_non_top1": sum(a.control.non_top1 for a in audits[n] if a.control),
                               "verdicts": [a.verdict.test for a in audits[n] if a.verdict],
                               "seconds": round(sum(a.seconds for a in audits[n]), 3)} if n in audits else None})
        if bench:
            measurements += [{"candidate": n, **s.model_dump()} for s in bench.samples]
    self_parity = next((r.event for r in records if isinstance(r.event, SelfParity)), None)
    summary = {"run_id": records[0].event.run_id, "finished": finished.model_dump() if finished else None,
               "self_parity": self_parity.model_dump() if self_parity else None,
               "audit_calibration": audits[0][0].model_dump() if 0 in audits else None, "candidates": rows}
    noise = [r.event for r in records if isinstance(r.event, NoiseFloor)]
    summary["noise_floor"] = noise[-1].model_dump() if noise else None
    summary["resumed"] = [{"at_record": r.seq + 1, **r.event.model_dump()} for r in records
                          if isinstance(r.event, Resumed)]
    summary["incumbent_checks"] = _incumbent_checks(records)
    summary["taken_back"] = _taken_back(records)
    summary["incumbent_restarts"] = [{"at_record": r.seq + 1, **r.event.model_dump()} for r in records
                                     if r.event.kind == "incumbent_restarted"]
    if any(r.event.kind == "llm_call" for r in records):
        from agent.proposers.funnel import llm_funnel

        summary["llm"] = llm_funnel([r.event for r in records])
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    (Path(run_dir) / "measurements.json").write_text(json.dumps(measurements, indent=2))
    lines = [f"{r['candidate']:>3} {r['verdict']:<8} {r['stage']:<10} {r['summary'][:50]:<50} {r['reason'][:80]}"
             for r in rows]
    return "\n".join(["  # verdict  stage      summary" + " " * 43 + "reason", *lines])


def _shown(entry: dict, key: str) -> str:
    return "" if key not in entry else "null" if entry[key] is None else str(entry[key])


def review_tables(run_dir: Path) -> list[Table]:
    records = read_trace(Path(run_dir) / "trace.jsonl")
    candidates = _by_candidate(records)
    kept = Table(title=f"branch {records[0].event.branch} (base {records[0].event.base_commit[:12]})")
    audits = _audits(records)
    for column in ("commit", "candidate", "what changed", "speedup [interval]", "parity evidence", "token audit",
                   "samples"):
        kept.add_column(column, overflow="fold")  # a narrow terminal wraps a long word rather than cut it
    taken = {entry["failed_commit"] for entry in _taken_back(records)}
    for record in records:
        if not isinstance(record.event, Commit):
            continue
        events = candidates[record.event.candidate]
        proposal: Proposal = events["proposal"]
        applied: PatchApplied = events["patch_applied"]
        parity: ParityReport = events["parity"]
        bench: BenchReport = events["benchmark"]
        changed = ", ".join(applied.files) or "serving flags only"
        live = f"; live: {len(bench.liveness.imported_patched)}/{len(bench.liveness.patched_files)} files imported" \
            if bench.liveness and bench.liveness.patched_files else ""
        kept.add_row(record.event.commit[:12] + ("\nTAKEN BACK" if record.event.commit in taken else ""),
                     str(record.event.candidate), f"{proposal.summary}\n{changed}",
                     f"{bench.speedup:.3f}x [{bench.ci_low:.3f}, {bench.ci_high:.3f}] @{bench.confidence:.0%}\n"
                     f"p={bench.p_value:.4f}",
                     f"{parity.prompts} prompts x {parity.tokens_per_prompt} tokens identical ({parity.regime})\n"
                     f"digest {parity.digest[:16]}{live}",
                     trailer(audits[record.event.candidate]) if record.event.candidate in audits else "not audited",
                     f"{len(bench.samples) // 2} paired reps\n{bench.output_check[:60]}")
    rejected = Table(title="not kept")
    for column in ("candidate", "proposal", "verdict", "stage", "reason"):
        rejected.add_column(column)
    for n, events in sorted(candidates.items()):
        decision: Decision | None = events.get("decision")
        if decision and decision.verdict != "keep":
            rejected.add_row(str(n), events["proposal"].summary[:60], decision.verdict, decision.stage,
                             decision.reason[:160])
    tables = [kept, rejected]
    reverts = _taken_back(records)
    if reverts:
        back = Table(title="kept, then taken back (the incumbent failed the token audit)")
        for column in ("candidate", "commit", "found", "restored", "revert commit", "why"):
            back.add_column(column, overflow="fold")
        for entry in reverts:
            back.add_row(str(entry["kept_by"]), entry["failed_commit"][:12],
                         f"benchmark of candidate {entry['candidate']}" if entry["candidate"] else "end of run",
                         entry["restored"][:12], entry["revert_commit"][:12] or "not made", entry["reason"][:240])
        tables.insert(1, back)
    loosened = of_run(records[0].event)
    if loosened:
        relaxed = Table(title="relaxed checks (looser than their default or the task file)")
        for column in ("setting", "value", "default", "task file"):
            relaxed.add_column(column)
        for entry in loosened:
            relaxed.add_row(entry["setting"], *(_shown(entry, k) for k in ("value", "default", "task_file")))
        tables.insert(0, relaxed)
    for record in records:
        if isinstance(record.event, NoiseFloor):
            noise = Table(title="noise floor (baseline A/A)")
            for column in ("measured", "warning"):
                noise.add_column(column)
            noise.add_row(noise_line(record.event), record.event.warning or "none")
            tables.append(noise)
    entries = [r.event for r in records if isinstance(r.event, NotebookEntry)]
    if entries:
        notebook = Table(title="lab notebook (the LLM proposer's candidates)")
        notebook.add_column("candidate")
        notebook.add_column("entry")
        for entry in entries:
            notebook.add_row(str(entry.candidate), entry.summary)
        tables.append(notebook)
    return tables
