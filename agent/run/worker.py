"""One parallel worker: a GPU (or sandbox.gpus_per_candidate GPUs), its own reference and incumbent servers, and
one Trial at a time there. It runs the baseline phase and the Judge as the loop does, but writes no trace: its
events come back in a WorkerResult, and the coordinator (agent/run/parallel.py) appends them to the run's one hash
chain."""
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
from agent.run.judge import Judge
from agent.run.pool import ServerPool
from agent.run.setup import RunSetup
from agent.run.trial import Trial
from agent.run.workspace import Workspace
from sandbox import make_sandbox
from sandbox.host import process_identity
from traces.schema import Decision, Proposal, TokenAudit

STAGE_OF = {"proposal": "surface", "patch_applied": "build", "build": "start", "parity": "benchmark",
            "sample": "benchmark", "benchmark": "audit", "audit": "benchmark", "decision": "decision"}
"""The stage a worker is in after each event: where its candidate was when the worker died."""


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


class Worker:
    def __init__(self, index: int, plain: dict, gpus: list[int], sandbox_factory: Callable | None = None):
        self.index, self.gpus = index, list(gpus)
        task = plain["task"]
        if gpus:
            task = task.model_copy(update={"sandbox": task.sandbox.model_copy(update={"gpus": list(gpus)})})
        run_dir = Path(plain["run_dir"])
        self.folder = run_dir / "workers" / f"w{index}"
        self.folder.mkdir(parents=True, exist_ok=True)
        repo = git.Repo(plain["checkout"])
        workspace = PinnedWorkspace(repo, plain["run_id"], self.folder / "worktrees", plain["base_commit"])
        self.setup = RunSetup(task=task, run_id=plain["run_id"], run_dir=run_dir, repo=repo, model=plain["model"],
                              vocab_size=plain["vocab_size"], trace=BufferTrace(), workspace=workspace,
                              base_commit=plain["base_commit"], vllm_version=plain["vllm_version"],
                              torch_version=plain["torch_version"], linked=plain["linked"],
                              cache_seed=Path(plain["cache_seed"]) if plain["cache_seed"] else None)
        sandbox = (sandbox_factory or make_sandbox)(task.sandbox, self.folder)
        self.pool = ServerPool(task, sandbox, self.setup.model.path, self.setup.run_id, self.setup.cache_seed,
                               run_dir / "server_starts.jsonl")
        self.judge: Judge | None = None
        self.candidate, self.stage, self.pending = 0, "starting", None
        self.status()

    def status(self) -> None:
        record = {"worker": self.index, "gpus": self.gpus, "pid": os.getpid(), "host": socket.gethostname(),
                  "identity": process_identity(os.getpid()), "candidate": self.candidate, "stage": self.stage,
                  "time": time.time()}
        tmp = self.folder / "status.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(self.folder / "status.json")

    def emit(self, event) -> str:
        sha = self.setup.trace.append(event)
        self.stage = STAGE_OF.get(event.kind, self.stage)
        self.status()
        return sha

    def drain(self) -> list:
        events, self.setup.trace.events = self.setup.trace.events, []
        return events

    @property
    def head(self) -> str:
        return self.setup.workspace.pinned

    def start(self, head: str) -> list:
        """The baseline phase on this worker's GPU; then its incumbent at `head`."""
        baseline = measure_baseline(self.setup, self.pool, self.emit)
        self.incumbent = baseline.incumbent
        self.judge = Judge(self.setup, self.pool, baseline.reference, baseline.incumbent, baseline.calibration,
                           dedicated_parity(self.setup), self.emit)
        if head != self.setup.base_commit:
            self.move(head)
        self.stage = "idle"
        self.status()
        return self.drain()

    def move(self, head: str) -> None:
        """Serve the incumbent at `head` (another worker's candidate was kept)."""
        self.setup.workspace.pinned = head
        self.incumbent.restore(head, f"incumbent-{head[:12]}")

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
        self.setup.workspace.pinned = commit
        self.incumbent.replace(server, meta["args"], tree)

    def evaluate(self, proposal: Proposal, head: str) -> WorkerResult:
        started = time.time()
        self.drop_pending()
        self.candidate, self.stage = proposal.candidate, "surface"
        self.status()
        if head != self.head:
            self.stage = "start"
            self.move(head)
        args = {**self.incumbent.args, **proposal.engine_args}
        audits: list[TokenAudit] = []
        n = proposal.candidate
        with Trial(n, self.pool, self.setup.workspace, self.setup.task.budget.candidate_timeout_s) as trial:
            decision, production, digest = self.judge.judge(trial, proposal, args, audits)
            tree = trial.tree
            if decision.verdict == "keep":
                server, tree = trial.hand_over(production)
                self.pending = (server, tree, {"candidate": n, "args": args})
        self.stage = "idle"
        self.status()
        return WorkerResult(worker=self.index, candidate=n, measured_against=head, decision=decision,
                            events=self.drain(), parity_digest=digest, audits=audits, args=args,
                            tree=str(tree or ""), started=started, finished=time.time())

    def close(self) -> None:
        try:
            self.drop_pending()
        finally:
            self.pool.close()
        self.stage = "stopped"
        self.status()
