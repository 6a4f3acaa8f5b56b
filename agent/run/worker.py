"""The Worker: the only evaluator of a candidate. It holds its own reference and incumbent servers (the baseline
phase, agent/run/baseline.py) and judges one candidate at a time there (the Judge, agent/run/judge.py, in a Trial).

The coordinator (agent/run/loop.py) gives it candidates through a slot. In-process (one worker), it shares the
run's setup: its records go straight to the trace, a keep is committed on the run's branch, and a flagged incumbent
is taken back (agent/run/recheck.py). On Ray (agent/run/parallel.py, one actor per GPU), it writes no trace: its
records come back in a WorkerResult, and the coordinator appends them to the run's one hash chain."""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import git

from agent.run.baseline import dedicated_parity, measure_baseline
from agent.run.judge import Judge, Remeasure
from agent.run.phases import stage_after
from agent.run.pool import ServerPool
from agent.run.recheck import Recheck
from agent.run.setup import RunSetup
from agent.run.trial import Trial
from agent.run.workspace import Workspace
from sandbox import make_sandbox
from sandbox.base import Sandbox
from sandbox.host import process_identity
from traces.schema import Decision, Proposal, Remeasured, TokenAudit


class BufferTrace:
    def __init__(self):
        self.events: list = []

    def append(self, event) -> str:
        self.events.append(event)
        return ""


class PinnedWorkspace(Workspace):
    """The run's workspace, with the head a worker's incumbent is at (the branch may have moved on since)."""

    def __init__(self, repo: git.Repo, run_id: str, worktrees: Path, pinned: str):
        super().__init__(repo, run_id, worktrees)
        self.pinned = pinned

    def head(self) -> str:
        return self.pinned


@dataclass
class WorkerResult:
    worker: int
    candidate: int
    measured_against: str
    decision: Decision
    events: list = field(default_factory=list)
    parity_digest: str = ""
    audits: list[TokenAudit] = field(default_factory=list)
    args: dict = field(default_factory=dict)
    tree: str = ""
    started: float = 0.0
    finished: float = 0.0


def plain_setup(setup: RunSetup) -> dict:
    """What a worker needs of the run's setup, as data a Ray actor can receive."""
    return dict(task=setup.task, run_id=setup.run_id, run_dir=str(setup.run_dir), checkout=str(setup.repo.working_dir),
                model=setup.model, vocab_size=setup.vocab_size, base_commit=setup.base_commit,
                vllm_version=setup.vllm_version, torch_version=setup.torch_version, linked=setup.linked,
                cache_seed=str(setup.cache_seed) if setup.cache_seed else None)


def worker_setup(plain: dict, gpus: list[int], folder: Path) -> RunSetup:
    """A remote worker's setup: the run's, on its own GPUs, writing no trace, its workspace pinned to its head."""
    task = plain["task"]
    if gpus:
        task = task.model_copy(update={"sandbox": task.sandbox.model_copy(update={"gpus": list(gpus)})})
    repo = git.Repo(plain["checkout"])
    workspace = PinnedWorkspace(repo, plain["run_id"], folder / "worktrees", plain["base_commit"])
    return RunSetup(task=task, run_id=plain["run_id"], run_dir=Path(plain["run_dir"]), repo=repo,
                    model=plain["model"], vocab_size=plain["vocab_size"], trace=BufferTrace(), workspace=workspace,
                    base_commit=plain["base_commit"], vllm_version=plain["vllm_version"],
                    torch_version=plain["torch_version"], linked=plain["linked"],
                    cache_seed=Path(plain["cache_seed"]) if plain["cache_seed"] else None)


class Worker:
    """`emit`: where its records go (the coordinator's, in-process); None: buffered, returned with each result.
    `status_file`: where it writes its GPUs, candidate and stage for the coordinator and `reap_workers` (remote
    workers); `on_revert`: the run's bookkeeping when a flagged incumbent is taken back (in-process only)."""

    def __init__(self, index: int, setup: RunSetup, sandbox: Sandbox, gpus: list[int] = (),
                 emit: Callable | None = None, status_file: Path | None = None,
                 on_revert: Callable[[float], None] | None = None):
        self.index, self.gpus, self.setup = index, list(gpus), setup
        self.sink, self.status_file, self.on_revert = emit, status_file, on_revert
        self.pool = ServerPool(setup.task, sandbox, setup.model.path, setup.run_id, setup.cache_seed,
                               setup.run_dir / "server_starts.jsonl")
        self.judge: Judge | None = None
        self.baseline = None
        self.recheck: Recheck | None = None
        self.candidate, self.stage, self.pending = 0, "starting", None
        self.status()

    @staticmethod
    def remote_parts(index: int, plain: dict, gpus: list[int], sandbox_factory: Callable | None = None) -> tuple:
        """A worker in its own process (a Ray actor): its setup, and its sandbox and status file under
        workers/w<index>; the arguments of Worker()."""
        folder = Path(plain["run_dir"]) / "workers" / f"w{index}"
        folder.mkdir(parents=True, exist_ok=True)
        setup = worker_setup(plain, gpus, folder)
        return (index, setup, (sandbox_factory or make_sandbox)(setup.task.sandbox, folder), gpus, None,
                folder / "status.json")

    def status(self) -> None:
        if self.status_file is None:
            return
        record = {"worker": self.index, "gpus": self.gpus, "pid": os.getpid(), "host": socket.gethostname(),
                  "identity": process_identity(os.getpid()), "candidate": self.candidate, "stage": self.stage,
                  "time": time.time()}
        tmp = self.status_file.with_name(self.status_file.name + ".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.status_file)

    def row(self) -> dict:
        return {"worker": self.index, "gpus": self.gpus, "candidate": self.candidate, "stage": self.stage}

    def emit(self, event) -> str:
        sha = self.sink(event) if self.sink is not None else self.setup.trace.append(event)
        self.stage = stage_after(event, self.stage)
        self.status()
        return sha

    def drain(self) -> list:
        if self.sink is not None:
            return []
        events, self.setup.trace.events = self.setup.trace.events, []
        return events

    @property
    def head(self) -> str:
        return self.setup.workspace.head()

    def start(self, head: str) -> list:
        """The baseline phase on this worker's GPU; then its incumbent at `head` (a resumed run's branch head)."""
        self.baseline = measure_baseline(self.setup, self.pool, self.emit)
        self.incumbent = self.baseline.incumbent
        self.judge = Judge(self.setup, self.pool, self.baseline.reference, self.baseline.incumbent,
                           self.baseline.calibration, dedicated_parity(self.setup), self.emit)
        if head != self.setup.base_commit:
            self.move(head, "incumbent" if self.sink is not None else f"incumbent-{head[:12]}")
        if self.on_revert is not None and self.baseline.calibration is not None:
            self.recheck = self.judge.recheck = Recheck(self.setup, self.baseline.reference, self.incumbent,
                                                        self.baseline.calibration, self.emit, self.on_revert,
                                                        self.judge.honest)
        self.stage = "idle"
        self.status()
        return self.drain()

    def move(self, head: str, name: str | None = None) -> None:
        """Serve the incumbent at `head` (another worker's candidate was kept)."""
        if isinstance(self.setup.workspace, PinnedWorkspace):
            self.setup.workspace.pinned = head
        self.incumbent.restore(head, name or f"incumbent-{head[:12]}")

    def drop_pending(self) -> None:
        if self.pending is not None:
            server, tree, _ = self.pending
            self.pending = None
            self.pool.release(server)
            self.setup.workspace.remove(tree)

    def adopt(self, candidate: int, commit: str) -> None:
        """The coordinator committed this worker's last candidate: its production server is the incumbent now."""
        if self.pending is None or self.pending[2]["candidate"] != candidate:
            return
        server, tree, meta = self.pending
        self.pending = None
        if isinstance(self.setup.workspace, PinnedWorkspace):
            self.setup.workspace.pinned = commit
        self.incumbent.replace(server, meta["args"], tree)

    def evaluate(self, proposal: Proposal, head: str) -> WorkerResult:
        """Judge `proposal` beside the incumbent at `head`; a keep's production server is held until `adopt`. An
        incumbent taken back meanwhile (in-process) voids the evidence: judged again on the new head (`remeasured`)."""
        started = time.time()
        self.drop_pending()
        self.candidate, self.stage = proposal.candidate, "surface"
        self.status()
        if head != self.head:
            self.stage = "start"
            self.move(head)
        n = proposal.candidate
        while True:
            args = {**self.incumbent.args, **proposal.engine_args}
            audits: list[TokenAudit] = []
            with Trial(n, self.pool, self.setup.workspace, self.setup.task.budget.candidate_timeout_s) as trial:
                try:
                    decision, production, digest = self.judge.judge(trial, proposal, args, audits)
                except Remeasure as again:
                    self.emit(Remeasured(candidate=n, measured_against=again.measured_against,
                                         head_commit=self.head, worker=self.index, reason=again.reason))
                    continue
                tree = trial.tree
                if decision.verdict == "keep":
                    server, tree = trial.hand_over(production)
                    self.pending = (server, tree, {"candidate": n, "args": args})
            break
        if self.judge.null_due():
            self.stage = "null check"
            self.status()
            self.judge.null_check()
        self.stage = "idle"
        self.status()
        return WorkerResult(worker=self.index, candidate=n, measured_against=self.head, decision=decision,
                            events=self.drain(), parity_digest=digest, audits=audits, args=args,
                            tree=str(tree or ""), started=started, finished=time.time())

    def final(self) -> None:
        """The end-of-run audit of the branch head, where this worker takes a flagged incumbent back."""
        if self.recheck is not None:
            self.recheck.final()

    def close(self) -> None:
        try:
            self.drop_pending()
        finally:
            self.pool.close()
        self.stage = "stopped"
        self.status()
