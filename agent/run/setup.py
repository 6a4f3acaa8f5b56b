"""Everything a run needs before its first candidate, as plain data: the task, the checkout, the
model, the trace and the branch. Checked before anything is written: a run folder exists only once
the task, the vLLM install, the checkout and the model are known to be usable."""
from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import platform
import socket
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import git

import agent
from agent.stages.build import build
from agent.world.checkout import create_checkout, default_checkout_path, installed_vllm, open_checkout, version_tag
from agent.world.checkpoint import CheckpointInfo, cache_root, prepare_model
from agent.run.preflight import check_model_fits, check_proposer
from agent.run.relaxed import relaxed
from agent.world.task import Task
from agent.run.workspace import Workspace
from sandbox.host import process_identity
from traces import TraceWriter
from traces.errors import NightshiftError
from traces.schema import RunStarted


class SetupError(NightshiftError, RuntimeError):
    pass


class RunLocked(SetupError):
    stage = "resume"


HARNESS_FILE = "harness"
"""The identity (host:pid:start time) of the process that runs the run, written once it holds the lock: a pack
taken while the run is alive carries it, so that the pack is not resumed beside it on the same host."""


def lock_run(run_dir: Path, claim: bool = True):
    """Held while a harness runs the run (the kernel lets go when it dies): one harness per run folder.
    `claim`: this process runs it (not only checks that nothing else does)."""
    lock = open(Path(run_dir) / "run.lock", "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise RunLocked(f"run {Path(run_dir).name} is still running (another process holds {run_dir}/run.lock)")
    if claim:
        part = Path(run_dir) / f".{HARNESS_FILE}.part"
        part.write_text(process_identity(os.getpid()))
        os.replace(part, Path(run_dir) / HARNESS_FILE)
    return lock


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def prepare_checkout(task: Task, vllm_version: str) -> git.Repo:
    if vllm_version != task.target.vllm_version:
        raise SetupError(f"the task targets vLLM {task.target.vllm_version}, but {vllm_version} is installed",
                         "checkout")
    path = task.target.checkout or default_checkout_path(vllm_version)
    if task.target.checkout is None and not path.exists():
        create_checkout(path)
    return open_checkout(path, vllm_version)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@dataclass
class RunSetup:
    task: Task
    run_id: str
    run_dir: Path
    repo: git.Repo
    model: CheckpointInfo
    vocab_size: int
    trace: TraceWriter
    workspace: Workspace
    base_commit: str
    vllm_version: str
    torch_version: str
    linked: bool = True
    """Candidate trees link the installed vLLM's compiled parts (off only for a pure-Python stand-in)."""
    cache_seed: Path | None = None
    """Compile caches kept across runs; only servers of the unmodified vLLM export to it."""
    lock: object = None
    """The run folder's lock (`lock_run`), held as long as this setup lives."""
    relaxed: list[dict] = field(default_factory=list)
    """The checks this task loosens against its defaults and its task file (agent/run/relaxed.py)."""
    warnings: list[str] = field(default_factory=list)
    """What the checks before the run found but did not refuse (a queued patch that does not apply to the base)."""

    def run_started(self) -> RunStarted:
        return RunStarted(run_id=self.run_id, nightshift_version=agent.__version__, vllm_version=self.vllm_version,
                          torch_version=self.torch_version, python_version=sys.version.split()[0],
                          platform=platform.platform(), checkout=str(self.repo.working_dir),
                          base_commit=self.base_commit, branch=self.workspace.branch, model_sha256=self.model.sha256,
                          model_margins=self.model.margins.model_dump() if self.model.margins else None,
                          model_written=self.model.written,
                          task=self.task.model_dump(mode="json"), host=socket.gethostname(),
                          run_dir=str(self.run_dir), cache=str(cache_root()), relaxed=self.relaxed)

    def baseline_tree(self) -> Path:
        tree = self.workspace.worktree("baseline")
        build(0, tree, [], link=self.linked)
        return tree

    def release_worktrees(self) -> int:
        """Once the run has ended: its worktrees (the baseline's, the incumbent's) removed, and unregistered from
        the checkout, which runs share; the branch keeps what was kept. Returns how many."""
        return self.workspace.remove_under(self.run_dir)

    def branch_diff(self, limit: int = 50_000) -> str:
        return self.repo.git.diff(self.base_commit, self.workspace.head())[:limit]


def prepare_run(task: Task, runs_dir: Path, run_id: str | None = None, vllm_version: str | None = None,
                task_file: Task | None = None, servers: list | None = None) -> RunSetup:
    """Check the checkout and the model, then create the run folder, its trace and the run branch.
    `vllm_version` stands in for the installed vLLM (a test's pure-Python stand-in): nothing is linked.
    `task_file`: the task before `--set`, against which (and its defaults) loosened checks are named.
    `servers`: the (name, engine args) a GPU holds at once, where not a run's busiest step (a study's)."""
    run_id = run_id or new_run_id()
    run_dir = Path(runs_dir).resolve() / run_id
    if run_dir.exists():
        raise SetupError(f"run folder {run_dir} already exists", "run")
    linked = vllm_version is None
    version = installed_vllm()[1] if linked else vllm_version
    repo = prepare_checkout(task, version)
    warnings = check_proposer(task, repo)
    model = prepare_model(task)
    check_model_fits(task, model.path, servers)
    vocab_size = int(json.loads((model.path / "config.json").read_text())["vocab_size"])
    run_dir.mkdir(parents=True)
    lock = lock_run(run_dir)
    (run_dir / "task.json").write_text(task.model_dump_json(indent=2))
    trace = TraceWriter(run_dir / "trace.jsonl")
    workspace = Workspace(repo, run_id, run_dir / "worktrees")
    base_commit = workspace.create_branch(version_tag(task.target.vllm_version))
    seed = cache_root() / "compile-caches" / f"vllm-{version}"
    return RunSetup(task=task, run_id=run_id, run_dir=run_dir, repo=repo, model=model, vocab_size=vocab_size,
                    trace=trace, workspace=workspace, base_commit=base_commit, vllm_version=version,
                    torch_version=_version("torch"), linked=linked, cache_seed=seed, lock=lock,
                    relaxed=relaxed(task, task_file), warnings=warnings)
