"""For a run on a remote host: its status at a glance, and a pack to audit elsewhere."""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import socket
import tarfile
import tempfile
import time
from collections import deque
from pathlib import Path

import git
from pydantic import BaseModel
from rich.table import Table

from agent.replay.chain import BUNDLE, checkout_of
from agent.run.phases import phase_after
from agent.run.move import queued_patches, traced_place
from agent.world.paths import cache_root
from agent.run.setup import HARNESS_FILE
from sandbox.host import owner_alive, running
from traces.errors import NightshiftError
from traces.log import parse_trace, read_trace_so_far
from traces.schema import Commit, Decision, Record, RunFinished, RunStarted

LOG_LINES = 200
PACKED = ("trace.jsonl", "task.json", "summary.json", "measurements.json")


class PackError(NightshiftError, RuntimeError):
    stage = "pack"


class RunStatus(BaseModel):
    run_id: str
    branch: str
    last_event: str
    candidate: int | None
    in_progress: str
    since_last_s: float
    evaluated: int
    kept: int
    best_speedup: float
    candidates_left: int
    elapsed_s: float
    wall_clock_left_s: float
    finished: bool
    finish_reason: str = ""
    harness_pid: int | None = None
    harness_alive: bool | None = None
    """Whether the process that started the run's servers still runs (None: no server started yet)."""
    records: int
    torn_last_line: bool


def run_status(run_dir: Path, now: float | None = None) -> RunStatus:
    """From the trace alone; the trace may still be written (a torn last line is left out)."""
    records, torn = read_trace_so_far(Path(run_dir) / "trace.jsonl")
    now = time.time() if now is None else now
    started: RunStarted = records[0].event
    budget = started.task.get("budget", {})
    last = records[-1].event
    decisions = [r.event for r in records if isinstance(r.event, Decision)]
    committed = {r.event.candidate for r in records if isinstance(r.event, Commit)}
    committed -= {r.event.candidate for r in records if r.event.kind == "reverted"}  # kept, then taken back
    best = 1.0
    for decision in decisions:
        if decision.candidate in committed and decision.speedup:
            best *= decision.speedup
    finished = last if isinstance(last, RunFinished) and not last.resumable else None
    elapsed = finished.seconds if finished else now - records[0].time
    in_progress = "finished" if finished else phase_after(last).doing
    if isinstance(last, RunFinished) and last.resumable:
        in_progress = f"stopped ({last.reason}); it goes on with nightshift run --resume"
    pid = _harness_pid(Path(run_dir))
    return RunStatus(
        run_id=started.run_id, branch=started.branch, last_event=last.kind,
        candidate=getattr(last, "candidate", None) or None, in_progress=in_progress,
        since_last_s=max(0.0, now - records[-1].time), evaluated=len(decisions), kept=len(committed),
        best_speedup=finished.best_speedup if finished else best,
        candidates_left=max(0, int(budget.get("max_candidates", 0)) - len(decisions)),
        elapsed_s=elapsed, wall_clock_left_s=max(0.0, float(budget.get("wall_clock_s", 0)) - elapsed),
        finished=finished is not None, finish_reason=finished.reason if finished else "",
        harness_pid=pid, harness_alive=None if pid is None else running(pid),
        records=len(records), torn_last_line=torn)


def _harness_pid(run_dir: Path) -> int | None:
    owners = sorted(run_dir.glob("servers/*/owner"), key=lambda p: p.stat().st_mtime)
    text = owners[-1].read_text().strip() if owners else ""
    return int(text) if text.isdigit() else None


def status_table(status: RunStatus) -> Table:
    table = Table(title=f"run {status.run_id}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    concerns = f" (candidate {status.candidate})" if status.candidate else ""
    if status.finished:
        state = f"[green]finished[/green]: {status.finish_reason}"
    elif status.last_event == "run_finished":
        state = f"[yellow]stopped[/yellow]: {status.in_progress}"
    elif status.harness_alive is False:
        state = (f"[red]stopped[/red]: the run's process (pid {status.harness_pid}) is gone without a "
                 f"run_finished record; it was {status.in_progress}{concerns}")
    else:
        state = f"[yellow]running[/yellow]: {status.in_progress}{concerns}"
    rows = [
        ("state", state),
        ("branch", status.branch),
        ("last event", f"{status.last_event}{concerns}, {status.since_last_s:.0f} s ago"
                       + ("; a record is being written" if status.torn_last_line else "")),
        ("candidates", f"{status.evaluated} evaluated, {status.kept} kept"),
        ("best speedup", f"{status.best_speedup:.3f}x"),
        ("budget left", f"{status.candidates_left} candidate(s), {_duration(status.wall_clock_left_s)} of wall clock"),
        ("elapsed", _duration(status.elapsed_s)),
        ("trace", f"{status.records} records"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m{s:02d}s" if minutes >= 60 else f"{minutes}m{s:02d}s"


def pack_run(run_dir: Path, dest: Path, settle_s: float = 10.0) -> dict:
    """Write DEST (tar.gz): the trace's complete lines, the run's JSON files, the heads and tails of its
    logs, a queue run's patch files, the run branch as a git bundle, and manifest.json. Returns the manifest."""
    run_dir, dest = Path(run_dir), Path(dest)
    files: dict[str, bytes] = {}
    trace, records, head = _consistent_snapshot(run_dir, settle_s)
    files["trace.jsonl"] = trace
    for name in PACKED[1:]:
        if (run_dir / name).is_file():
            files[name] = (run_dir / name).read_bytes()
    queue, patches = queued_patches(records, run_dir)  # a host without the recorded patch folder reads these
    files.update(patches)
    logs = {}
    detached = run_dir.parent / f"{run_dir.name}.log"
    for log in sorted([*run_dir.glob("*.log"), *run_dir.glob("servers/*/server.log")]) + [detached]:
        if not log.is_file():
            continue
        name = "nightshift.log" if log == detached else log.relative_to(run_dir).as_posix()
        logs[name], files[f"{name}.head"], files[f"{name}.tail"] = _head_tail(log)
    started: RunStarted = records[0].event
    files[BUNDLE] = _bundle(started, checkout_of(records), head)
    harness = (run_dir / HARNESS_FILE).read_text().strip() if (run_dir / HARNESS_FILE).is_file() else ""
    manifest = {"run_id": started.run_id, "branch": started.branch, "base_commit": started.base_commit,
                "head_commit": head, "records": len(records), "finished": records[-1].event.kind == "run_finished",
                "packed_at": time.time(), "log_lines": logs,
                "host": socket.gethostname(), "run_dir": str(run_dir.resolve()), "checkout": checkout_of(records),
                "cache": traced_place(records)["cache"] or str(cache_root()), "harness": harness, "harness_alive": bool(harness) and owner_alive(harness),
                "queue": queue,
                "files": {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                          for name, data in sorted(files.items())}}
    files["manifest.json"] = json.dumps(manifest, indent=2).encode()
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{started.run_id}/{name}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
    partial.replace(dest)
    return manifest


def _head_tail(path: Path) -> tuple[int, bytes, bytes]:
    """(lines, the first LOG_LINES, the last LOG_LINES after those), reading the file once."""
    with open(path, "rb") as f:
        head = list(itertools.islice(f, LOG_LINES))
        tail, count = deque(maxlen=LOG_LINES), len(head)
        for line in f:
            tail.append(line)
            count += 1
    return count, b"".join(head), b"".join(tail)


def _consistent_snapshot(run_dir: Path, settle_s: float) -> tuple[bytes, list[Record], str]:
    """The trace's complete lines and the branch head they account for. A live run commits just before
    it records the commit, so a snapshot taken in between is retried until the two agree."""
    deadline = time.time() + settle_s
    while True:
        data = (run_dir / "trace.jsonl").read_bytes()
        data = data[:data.rfind(b"\n") + 1]
        records = parse_trace(data)
        started: RunStarted = records[0].event
        commits = [r.event.commit for r in records if isinstance(r.event, Commit)]
        expected = commits[-1] if commits else started.base_commit
        try:
            head = git.Repo(checkout_of(records)).git.rev_parse(f"refs/heads/{started.branch}")
        except (git.GitError, git.NoSuchPathError) as exc:
            raise PackError(f"cannot read branch {started.branch} in {checkout_of(records)}: {exc}") from None
        if head == expected or time.time() > deadline:
            return data, records, head
        time.sleep(0.5)


def _bundle(started: RunStarted, checkout: str, head: str) -> bytes:
    """The run branch at HEAD with its whole history, so that `git clone` of it works on its own."""
    repo = git.Repo(checkout)
    with tempfile.TemporaryDirectory(prefix="nightshift-pack-") as tmp:
        path = Path(tmp) / BUNDLE
        repo.git.bundle("create", "--quiet", str(path), f"refs/heads/{started.branch}")
        heads = git.Git().bundle("list-heads", str(path)).split()
        if heads[:1] != [head]:
            raise PackError(f"branch {started.branch} moved while it was packed; pack again")
        return path.read_bytes()
