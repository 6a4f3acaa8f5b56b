"""`nightshift run --resume RUN`: continue a run whose harness was killed (SIGKILL, the OOM killer, a reboot).

Checked first, as `replay` checks a run: the trace's hash chain (a torn last line is cut off, and the `resumed`
record says what it held) and the branch against the trace. A run that fails that audit, that finished, or whose
harness still runs is refused. The state then comes from the trace and the branch alone: the incumbent is the
branch head with its serving flags, the history and the budget spent are the trace's, each proposer takes up
its own state from the records (`Proposer.restore`). The dead harness's servers and worktrees are removed, the
baseline phase runs again, and the candidate in flight at the kill is evaluated again from its recorded
proposal. A keep decided but not recorded as committed is committed exactly once: found on the branch by its
`Nightshift-Trace-Event` trailer, or made. A parallel run (agent/run/parallel.py) resumes the same way, with every
candidate that was in flight evaluated again and its dead workers (on this host) and their servers reaped.
A run stopped rather than ended (a check refused at its start, a signal: a resumable `run_finished`) resumes the
same way. A pack of the run (`nightshift pack`), or its unpacked folder, resumes on a host that has never seen it
(agent/run/move.py): the `resumed` record's `moved` says from where to where.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import git

from agent.replay.chain import audit, resolve_run, stopped
from agent.world.checkout import installed_vllm, open_checkout
from agent.world.checkpoint import cache_root, mismatch, prepare_model
from agent.run.move import (Arrival, find_queue, is_pack, moved, place_checkout, refuse_if_alive_here, settled,
                            unpack)
from agent.run.commits import commit_keep
from agent.run.relaxed import of_run
from agent.proposers import Proposer, make_proposer
from agent.proposers.base import Attempt
from agent.run.setup import RunSetup, _version, lock_run
from agent.world.task import builtin_tasks, map_project_paths, parse_task
from agent.run.reaping import reap_workers
from agent.run.workspace import Workspace
from sandbox import make_sandbox
from sandbox.base import Sandbox
from traces import TraceError, TraceWriter
from traces.errors import NightshiftError
from traces.log import parse_trace
from traces.schema import (Commit, Decision, IncumbentReverted, ParityReport, PatchApplied, Proposal, Record,
                           Resumed, Reverted, RunFinished, RunStarted, TokenAudit)


class ResumeRefused(NightshiftError):
    stage = "resume"


@dataclass
class PendingKeep:
    """A keep decision (the trace's last record but `resumed` ones) with no commit record yet."""

    decision: Record
    proposal: Proposal
    applied: PatchApplied
    parity_digest: str
    audits: list[TokenAudit]
    found: str = ""
    """The branch's commit for it, if it was made before the kill."""


@dataclass
class Resumption:
    """What the loop continues from; `event` is the run's next record."""

    event: Resumed
    history: list[Attempt]
    best_speedup: float
    kept: int
    spent_s: float
    redo: list[Proposal] = field(default_factory=list)
    """The proposals in flight at the kill, by candidate number: each is evaluated again."""
    pending: PendingKeep | None = None
    proposed_on: dict[int, str] = field(default_factory=dict)
    """The branch head when each candidate was proposed."""
    records: list[Record] = field(default_factory=list)
    """The trace as the dead harness left it."""

    def head_unaudited(self, head: str, base: str) -> bool:
        """A kept head that a run checking its incumbent never audited on fresh prompts at its end: a finishing
        resume audits it (a baseline phase, then the end-of-run audit) instead of only recording the end."""
        from agent.replay.evidence import checks_incumbent, head_audited_at_end

        return head != base and checks_incumbent(self.records) and not head_audited_at_end(self.records, head)

    def gpu_hours(self, task) -> float:
        """GPU-hours the run's workers held before the kill (all of them, for the wall clock it had used)."""
        return self.spent_s * task.sandbox.workers * task.sandbox.gpus_per_candidate / 3600

    def in_flight(self, n: int) -> Proposal | None:
        """The recorded proposal of candidate n if it was in flight at the kill (once)."""
        proposal = next((p for p in self.redo if p.candidate == n), None)
        if proposal is not None:
            self.redo.remove(proposal)
        return proposal

    def settle(self, setup: RunSetup, emit) -> None:
        """What is left once the resumed record is on disk: a pack's bundle is dropped (the branch is in the
        checkout now), and the pending keep's commit recorded: the one on the branch, or one made now. Never two
        for a decision."""
        settled(setup.run_dir)
        p, self.pending = self.pending, None
        if p is None:
            return
        if p.found:
            commit_keep(setup, p.proposal, p.decision.event, p.decision.sha256, p.parity_digest, p.audits, None,
                        p.applied.engine_args, emit, found=p.found)
            return
        head = setup.workspace.head()
        if head != p.applied.parent_commit:
            raise ResumeRefused(f"candidate {p.proposal.candidate} was kept on {p.applied.parent_commit[:12]}, but the "
                                f"branch is at {head[:12]}")
        tree = setup.workspace.worktree(f"commit-{p.proposal.candidate}")
        try:
            setup.workspace.apply(tree, p.proposal.patch)
            commit_keep(setup, p.proposal, p.decision.event, p.decision.sha256, p.parity_digest, p.audits, tree,
                        p.applied.engine_args, emit)
        finally:
            setup.workspace.remove(tree)


def read_for_resume(trace: Path) -> tuple[list[Record], bytes, int]:
    """(the verified records, the torn bytes to cut off, the length to keep). A last line that lacks only its
    newline but verifies is kept."""
    data = trace.read_bytes()
    keep = data.rfind(b"\n") + 1
    torn = data[keep:]
    try:
        if torn:
            try:
                return parse_trace(data + b"\n"), b"", len(data)
            except TraceError:
                pass
        return parse_trace(data[:keep]), torn, keep
    except TraceError as exc:
        raise ResumeRefused(f"the trace fails the audit at record {exc.line}: {exc}; not resuming") from None


def rebuild(records: list[Record]) -> Resumption:
    """The run's state from its trace: history, kept, best speedup, wall clock spent, what was in flight."""
    proposals: dict[int, Proposal] = {}
    decisions: dict[int, Record] = {}
    proposed_on, head = {}, records[0].event.base_commit
    committed = {r.event.decision_sha256 for r in records if isinstance(r.event, Commit)}
    for record in records:
        if isinstance(record.event, Proposal):
            proposals[record.event.candidate] = record.event
            proposed_on[record.event.candidate] = head
        elif isinstance(record.event, Decision):
            decisions[record.event.candidate] = record
        elif isinstance(record.event, (Commit, Reverted)):
            head = record.event.commit
    history = [Attempt(proposals[n], decisions[n].event) for n in sorted(decisions, key=lambda n: decisions[n].seq)]
    keeps = [r for r in decisions.values() if r.event.verdict == "keep"]
    pending = next((r for r in keeps if r.sha256 not in committed), None)
    best = math.prod(r.event.speedup for r in keeps)
    taken_back = _taken_back(records)  # keeps whose server failed the audit later, reverted on the branch
    best /= math.prod(taken_back)
    redo = [proposals[n] for n in sorted(proposals) if n not in decisions]
    state = Resumption(event=None, history=history, best_speedup=best, kept=len(keeps) - len(taken_back),
                       spent_s=_spent(records),
                       redo=redo, proposed_on=proposed_on)
    if pending is not None:
        state.pending = _pending(records, pending, proposals[pending.event.candidate])
    return state


def _taken_back(records: list[Record]) -> list[float]:
    """The speedups of the keeps a `reverted` record took back (agent/run/recheck.py)."""
    by_sha = {r.sha256: r.event for r in records}
    return [by_sha[r.event.event_sha256].speedup for r in records
            if isinstance(r.event, Reverted) and isinstance(by_sha.get(r.event.event_sha256), IncumbentReverted)]


def nothing_left(task, state: Resumption) -> str:
    """Why a resumed run has no budget left for another evaluation ('' when it has): then it only finishes."""
    b = task.budget
    if state.spent_s > b.wall_clock_s:
        return "budget: wall clock"
    if b.max_gpu_hours and task.sandbox.workers > 1 and state.gpu_hours(task) > b.max_gpu_hours:
        return "budget: GPU-hours"
    if not state.redo and len(state.history) >= b.max_candidates:
        return "budget: candidates"
    return ""


def _spent(records: list[Record]) -> float:
    """Wall clock used: each stretch from run_started or a `resumed` record to the last record before the next."""
    spent, first = 0.0, records[0].time
    for previous, record in zip(records, records[1:]):
        if isinstance(record.event, Resumed):
            spent, first = spent + previous.time - first, record.time
    return spent + records[-1].time - first


def _pending(records: list[Record], decision: Record, proposal: Proposal) -> PendingKeep:
    n = proposal.candidate
    start = max(r.seq for r in records if isinstance(r.event, PatchApplied) and r.event.candidate == n)
    after = [r.event for r in records[start:decision.seq]]
    applied = records[start].event
    parity = [e for e in after if isinstance(e, ParityReport) and e.candidate == n]
    audits = [e for e in after if isinstance(e, TokenAudit) and e.candidate == n and not e.calibration
              and not e.incumbent]
    return PendingKeep(decision, proposal, applied, parity[-1].digest, audits)


def open_run(run_dir: Path, records: list[Record], vllm_version: str | None, lock,
             checkout: Path | None = None) -> RunSetup:
    """The run's setup again, from its first record: same branch, model and vLLM, in its checkout (a pack's
    branch brought into this host's checkout first)."""
    started: RunStarted = records[0].event
    task = map_project_paths(parse_task(started.task, f"{run_dir / 'trace.jsonl'} (run_started.task)"), here)
    find_queue(task, run_dir)
    linked = vllm_version is None
    version = installed_vllm()[1] if linked else vllm_version
    if version != started.vllm_version:
        raise ResumeRefused(f"the run started with vLLM {started.vllm_version}, but {version} is installed")
    model = prepare_model(task)
    if model.sha256 != started.model_sha256:
        raise ResumeRefused(f"the model's weights are not the run's (sha256 {model.sha256[:12]}, the run had "
                            f"{started.model_sha256[:12]}): {mismatch(started.model_written, model)}")
    repo = open_checkout(place_checkout(run_dir, records, version, checkout, linked), version)
    vocab_size = int(json.loads((model.path / "config.json").read_text())["vocab_size"])
    workspace = Workspace(repo, started.run_id, run_dir / "worktrees")
    seed = cache_root() / "compile-caches" / f"vllm-{version}"
    return RunSetup(task=task, run_id=started.run_id, run_dir=run_dir, repo=repo, model=model, vocab_size=vocab_size,
                    trace=None, workspace=workspace, base_commit=started.base_commit, vllm_version=version,
                    torch_version=_version("torch"), linked=linked, cache_seed=seed, lock=lock,
                    relaxed=of_run(started))


PROJECT = Path(__file__).resolve().parents[2]
"""The folder holding the `agent` package: the project in a source checkout (site-packages when installed)."""


def here(recorded: Path, project: Path = PROJECT) -> Path:
    """A path the run recorded, on this host: itself where it exists, else the same path within this
    project (the task's model config and patch folder live in the project, which another host may hold
    elsewhere: /old/place/tasks/models/x/config.json is looked for at PROJECT/tasks/models/x/config.json),
    else within the built-in tasks (an installed package's copy: models/x/config.json there).
    What it names is checked after (the model by its weights' sha256)."""
    if recorded.exists():
        return recorded
    for root in (project, builtin_tasks()):
        for i in range(1, len(recorded.parts)):
            candidate = root.joinpath(*recorded.parts[i:])
            if candidate.exists():
                return candidate
    return recorded


def refuse_unless_resumable(run_dir: Path, records: list[Record]):
    """The run's audit result; raises ResumeRefused if it finished, fails the audit or its branch is unreadable."""
    started: RunStarted = records[0].event
    finished = next((r for r in reversed(records) if isinstance(r.event, RunFinished)), None)
    if finished is not None and not stopped(finished):
        raise ResumeRefused(f"run {started.run_id} already finished (record {finished.seq + 1}: "
                            f"{finished.event.reason}); there is nothing to resume")
    try:
        return audit(run_dir, records, pending=True)
    except TraceError as exc:
        raise ResumeRefused(f"run {started.run_id} fails the audit at record {exc.line}: {exc}; not resuming") \
            from None
    except git.GitError as exc:
        raise ResumeRefused(f"cannot read the run's branch: {exc}") from None


def _open_checked(run: str, runs_dir: Path, claim: bool = True):
    """The run folder (a pack is unpacked into RUNS_DIR first), its lock, its trace as read for resuming, and
    the checks' findings; a refusal lets go of the lock before it is raised."""
    arrival = unpack(Path(run), runs_dir) if is_pack(run) else Arrival(resolve_run(run, runs_dir).resolve())
    run_dir = arrival.run_dir
    refuse_if_alive_here(run_dir)
    lock = lock_run(run_dir, claim=claim)
    try:
        read = read_for_resume(run_dir / "trace.jsonl")
        return arrival, lock, read, refuse_unless_resumable(run_dir, read[0])
    except BaseException:
        lock.close()
        raise


def check_resumable(run: str, runs_dir: Path) -> Path:
    """The run folder, if `run --resume` would take it now (checked without writing to it; the lock is let go
    again). A pack is unpacked into RUNS_DIR: the folder is what goes on."""
    arrival, lock, _, _ = _open_checked(run, runs_dir, claim=False)
    lock.close()
    return arrival.run_dir


def resume_run(run: str, runs_dir: Path, vllm_version: str | None = None, sandbox=None,
               checkout: Path | None = None) -> tuple[RunSetup, Proposer, Sandbox, Resumption]:
    """Check the run, rebuild its state, clean up after the dead harness; the trace is touched only once
    everything checked out (the torn line cut off). RUN: a run id or folder, or a pack (CHECKOUT: where its
    branch goes on). SANDBOX: one, or one made for the run folder (a callable). Raises ResumeRefused (or another NightshiftError)."""
    arrival, lock, (records, torn, keep), checked = _open_checked(run, runs_dir)
    run_dir = arrival.run_dir
    trace = run_dir / "trace.jsonl"
    state = rebuild(records)
    state.records = records
    try:
        setup = open_run(run_dir, records, vllm_version, lock, checkout)
    except BaseException:
        lock.close()
        raise
    if state.pending is not None:
        state.pending.found = checked.pending_commit
    proposer = make_proposer(setup.task)
    proposer.restore(records)
    if setup.task.sandbox.workers > 1:
        from agent.run.parallel import preflight

        preflight(setup.task)
    sandbox = sandbox(run_dir) if callable(sandbox) else sandbox or make_sandbox(setup.task.sandbox, run_dir)
    reaped = sandbox.reap() + reap_workers(run_dir)
    removed = setup.workspace.remove_under(run_dir)  # the dead harness's, its workers' too
    if torn:
        os.truncate(trace, keep)
    setup.trace = TraceWriter(trace)
    last = records[-1]
    pending = state.pending
    state.event = Resumed(
        after_seq=last.seq, after_event=last.event.kind + (f" of candidate {last.event.candidate}"
                                                           if getattr(last.event, "candidate", 0) else ""),
        dropped_bytes=len(torn), dropped=torn[:300].decode(errors="replace"),
        candidate=state.redo[0].candidate if state.redo else 0, in_flight=[p.candidate for p in state.redo],
        pending_keep="" if pending is None else (f"found {pending.found}" if pending.found else "commit"),
        head_commit=setup.workspace.head(), candidates_done=len(state.history), kept=state.kept,
        best_speedup=state.best_speedup, spent_s=round(state.spent_s, 3),
        downtime_s=round(max(0.0, time.time() - last.time), 3), reaped=reaped, worktrees_removed=removed,
        finishing=nothing_left(setup.task, state),
        moved=moved(records, run_dir, Path(setup.repo.working_dir), arrival, find_queue(setup.task, run_dir)))
    return setup, proposer, sandbox, state


def describe(event: Resumed) -> str:
    """One line: from where the run goes on."""
    what = [f"after record {event.after_seq + 1} ({event.after_event})"]
    if event.moved is not None:
        m = event.moved
        what.append(f"moved from {m.from_host or '?'}:{m.from_run_dir or '?'} to {m.to_host}:{m.to_run_dir}, "
                    f"branch in {m.to_checkout}" + (" (packed while it ran there)" if m.packed_live else "")
                    + (f", queued patches from {m.queue}" if m.queue else ""))
    if event.dropped_bytes:
        what.append(f"a torn last line of {event.dropped_bytes} bytes cut off")
    if event.pending_keep:
        what.append("the last keep " + ("found on the branch" if event.pending_keep.startswith("found")
                                        else "committed now"))
    again = event.in_flight or [event.candidate] * bool(event.candidate)
    if again:
        what.append(f"candidate{'s' * (len(again) > 1)} {', '.join(map(str, again))} evaluated again from "
                    f"{'their proposals' if len(again) > 1 else 'its proposal'}")
    what.append(f"{event.candidates_done} candidates done, {event.kept} kept, {event.spent_s:.0f} s spent, "
                f"{event.reaped} leftover server(s) killed")
    if event.finishing:
        what.append(f"nothing left to evaluate ({event.finishing}): the run only finishes")
    return "resumed " + "; ".join(what)
