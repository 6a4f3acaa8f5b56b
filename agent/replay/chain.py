"""Audit a finished (or crashed) run: the trace chain is intact and the branch is what it says."""
from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import git

from agent.replay.evidence import check_decisions
from agent.world.serve_args import SERVE_FILE
from traces import TraceError, read_trace
from traces.errors import NightshiftError
from traces.schema import (Commit, Decision, IncumbentReverted, PatchApplied, Record, Resumed, Reverted, RunFinished,
                           RunStarted)

TRAILER = "Nightshift-Trace-Event:"
BUNDLE = "branch.bundle"


class RunNotFound(NightshiftError, FileNotFoundError):
    stage = "audit"


class BranchUnreadable(NightshiftError, RuntimeError):
    """The run's checkout (or bundle) cannot be read: the run cannot be audited, nothing was tampered with."""

    stage = "checkout"


@dataclass
class AuditResult:
    records: int
    commits: int
    finished: bool
    notes: list[str] = field(default_factory=list)
    decisions: int = 0
    """Decisions re-derived from their recorded evidence (samples, intervals, audits)."""
    pending_commit: str = ""
    """With `pending`: the branch's last commit, made for the trace's last record (a keep, or a revert) but not
    recorded."""
    reverts: int = 0
    """Commits that took a keep back after its server failed the token audit (agent/run/recheck.py)."""


def resolve_run(run: str, runs_dir: Path) -> Path:
    """The run's folder, absolute: git runs in the checkout, where a relative folder means something else."""
    path = Path(run)
    for candidate in (path, Path(runs_dir) / run):
        if (candidate / "trace.jsonl").is_file():
            return candidate.resolve()
    raise RunNotFound(f"no run at {run} (looked for trace.jsonl there and in {runs_dir})")


def audit(run_dir: Path, records: list[Record] | None = None, pending: bool = False) -> AuditResult:
    """Raises TraceError naming the first bad record (1-based line). `records`: the trace's records, if read
    already. `pending`: a run killed between a keep and its commit record may have one commit more, whose
    trailer names that keep (the trace's last record but `resumed` ones)."""
    records = records if records is not None else read_trace(Path(run_dir) / "trace.jsonl")
    started: RunStarted = records[0].event
    by_sha = {r.sha256: r for r in records}
    commit_records = [r for r in records if isinstance(r.event, Commit)]
    _check_keeps_committed(records, commit_records)
    branch_records = [r for r in records if isinstance(r.event, (Commit, Reverted))]
    decisions = check_decisions(records)
    try:
        repo = _open_repo(Path(run_dir), records)
        shas = repo.git.rev_list("--reverse", "--first-parent", f"{started.base_commit}..{started.branch}").split()
    except (git.GitError, git.NoSuchPathError) as exc:
        where = Path(run_dir) / BUNDLE if (Path(run_dir) / BUNDLE).is_file() else checkout_of(records)
        raise BranchUnreadable(f"cannot read branch {started.branch} in {where}: {exc}") from None
    for index, record in enumerate(branch_records):
        event: Commit | Reverted = record.event
        line = record.seq + 1
        if index >= len(shas):
            raise TraceError(line, f"commit {event.commit[:12]} is not on branch {started.branch}")
        if shas[index] != event.commit:
            raise TraceError(line, f"branch has {shas[index][:12]} where the trace says {event.commit[:12]}")
        if isinstance(event, Reverted):
            _check_revert(repo, event, by_sha, line, shas[index - 1] if index else started.base_commit)
            continue
        trailer = trace_event_of(repo.commit(event.commit).message)
        if trailer != event.decision_sha256:
            raise TraceError(line, f"commit {event.commit[:12]} has trace event {trailer[:12] or 'none'}, "
                                   f"not {event.decision_sha256[:12]}")
        decision = by_sha.get(event.decision_sha256)
        if decision is None or not isinstance(decision.event, Decision) or decision.event.verdict != "keep" \
                or decision.event.candidate != event.candidate:
            raise TraceError(line, "commit does not point at a keep decision for its candidate")
        applied = _applied(records, event.candidate)
        changed = set(repo.git.diff("--name-only", f"{event.commit}^", event.commit).split())
        extra = changed - set(applied.files if applied else []) - {SERVE_FILE}
        if extra:
            raise TraceError(line, f"commit changes files the candidate's patch did not: {sorted(extra)}")
    pending_commit = ""
    if pending and len(shas) == len(branch_records) + 1 \
            and isinstance(_tail(records).event, (Decision, IncumbentReverted)) \
            and trace_event_of(repo.commit(shas[-1]).message) == _tail(records).sha256:
        pending_commit = shas.pop()
    if len(shas) > len(branch_records):
        raise TraceError(len(records), f"branch has {len(shas) - len(branch_records)} commit(s) the trace "
                                       f"does not account for, first {shas[len(branch_records)][:12]}")
    last = records[-1].event
    finished = isinstance(last, RunFinished) and not last.resumable
    notes = [] if finished else [f"the run was stopped ({last.reason}) and can go on: nightshift run --resume"
                                 if isinstance(last, RunFinished) else
                                 "the run did not finish (no run_finished record): it crashed or is still running"]
    return AuditResult(records=len(records), commits=len(commit_records), finished=finished, notes=notes,
                       decisions=decisions, pending_commit=pending_commit,
                       reverts=len(branch_records) - len(commit_records))


def _check_revert(repo: git.Repo, event: Reverted, by_sha: dict, line: int, parent: str) -> None:
    """A revert commit: its trailer names an `incumbent_reverted` record, it follows the commit that record takes
    back, and its tree is the tree of the commit it restores."""
    named = by_sha.get(event.event_sha256)
    trailer = trace_event_of(repo.commit(event.commit).message)
    if named is None or not isinstance(named.event, IncumbentReverted) or trailer != event.event_sha256:
        raise TraceError(line, f"revert {event.commit[:12]} does not point at an incumbent_reverted record "
                               f"(trailer {trailer[:12] or 'none'})")
    reverted: IncumbentReverted = named.event
    if not (event.reverts == reverted.failed_commit == parent and event.candidate == reverted.kept_by):
        raise TraceError(line, f"revert {event.commit[:12]} follows {parent[:12]}, but takes back "
                               f"{event.reverts[:12]} (the record says {reverted.failed_commit[:12]})")
    commit = repo.commit(event.commit)
    if [p.hexsha for p in commit.parents] != [parent] or commit.tree.hexsha != repo.commit(reverted.restored).tree.hexsha:
        raise TraceError(line, f"revert {event.commit[:12]} does not restore the tree of {reverted.restored[:12]}")


def _tail(records: list[Record]) -> Record:
    """The last record that is neither a `resumed` one nor a resumable stop: a keep there may still be committed
    by a resumed run."""
    return next((r for r in reversed(records) if not isinstance(r.event, Resumed) and not stopped(r)), records[0])


def stopped(record: Record) -> bool:
    """A `run_finished` record of a run that was stopped, not ended: it may go on (`run --resume`)."""
    return isinstance(record.event, RunFinished) and record.event.resumable


def checkout_of(records: list[Record]) -> str:
    """The vLLM checkout that holds the run's branch now: where it started, or where it last moved to."""
    moves = [r.event.moved for r in records if isinstance(r.event, Resumed) and r.event.moved is not None]
    return moves[-1].to_checkout if moves else records[0].event.checkout


def trace_event_of(message: str) -> str:
    return next((l.split(":", 1)[1].strip() for l in message.splitlines() if l.startswith(TRAILER)), "")


def _open_repo(run_dir: Path, records: list[Record]) -> git.Repo:
    """The run's checkout; for a packed run (`nightshift pack`), a temporary bare repo of its bundle."""
    bundle = run_dir / BUNDLE
    if not bundle.is_file():
        return git.Repo(checkout_of(records))
    folder = tempfile.mkdtemp(prefix="nightshift-bundle-")
    repo = git.Repo.init(folder, bare=True)
    weakref.finalize(repo, shutil.rmtree, folder, True)
    repo.git.bundle("verify", str(bundle.resolve()))
    repo.git.fetch("--quiet", str(bundle.resolve()), "+refs/*:refs/*")
    return repo


def _applied(records: list[Record], candidate: int) -> PatchApplied | None:
    return next((r.event for r in reversed(records)
                 if isinstance(r.event, PatchApplied) and r.event.candidate == candidate), None)


def _check_keeps_committed(records: list[Record], commits: list[Record]) -> None:
    committed = {r.event.decision_sha256 for r in commits}
    last = _tail(records).sha256
    for record in records:
        if isinstance(record.event, Decision) and record.event.verdict == "keep" and record.sha256 not in committed \
                and record.sha256 != last:
            raise TraceError(record.seq + 1, f"candidate {record.event.candidate} was kept but never committed")
