"""Everything a run needs before its first candidate: checkout, model, branch, trace, sandbox."""
from __future__ import annotations

import json
import platform
import secrets
import sys
import time
from pathlib import Path

import git

import agent
from agent.build import build
from agent.checkout import create_checkout, default_checkout_path, installed_vllm, open_checkout, version_tag
from agent.checkpoint import CheckpointInfo, ensure_synthetic, real_checkpoint
from agent.task import Task
from agent.workspace import Workspace
from sandbox import make_sandbox
from sandbox.base import Sandbox, Server, ServerSpec
from traces import TraceWriter
from traces.schema import RunStarted


class SetupError(RuntimeError):
    pass


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def prepare_model(task: Task) -> CheckpointInfo:
    if task.model.path:
        return real_checkpoint(task.model.path)
    synthetic = task.model.synthetic
    return ensure_synthetic(synthetic.config, synthetic.seed, synthetic.logit_scale, task.model.dtype,
                            final_norm_scale=synthetic.final_norm_scale, post_norm_scale=synthetic.post_norm_scale)


def prepare_checkout(task: Task) -> git.Repo:
    _, installed = installed_vllm()
    if installed != task.target.vllm_version:
        raise SetupError(f"the task targets vLLM {task.target.vllm_version}, but {installed} is installed")
    path = task.target.checkout or default_checkout_path(installed)
    if task.target.checkout is None and not path.exists():
        create_checkout(path)
    return open_checkout(path, installed)


class RunSetup:
    def __init__(self, task: Task, runs_dir: Path, run_id: str | None = None, sandbox: Sandbox | None = None):
        self.task = task
        self.run_id = run_id or new_run_id()
        self.run_dir = Path(runs_dir).resolve() / self.run_id
        if self.run_dir.exists():
            raise SetupError(f"run folder {self.run_dir} already exists")
        self.repo = prepare_checkout(task)
        self.model = prepare_model(task)
        self.vocab_size = int(json.loads((self.model.path / "config.json").read_text())["vocab_size"])
        self.run_dir.mkdir(parents=True)
        (self.run_dir / "task.json").write_text(task.model_dump_json(indent=2))
        self.trace = TraceWriter(self.run_dir / "trace.jsonl")
        self.workspace = Workspace(self.repo, self.run_id, self.run_dir / "worktrees")
        self.base_commit = self.workspace.create_branch(version_tag(task.target.vllm_version))
        self.sandbox = sandbox or make_sandbox(task.sandbox, self.run_dir)
        self.sandbox.reap()
        self.servers: list[Server] = []
        self.baseline: Path | None = None

    def run_started(self) -> RunStarted:
        import torch

        return RunStarted(run_id=self.run_id, nightshift_version=agent.__version__,
                          vllm_version=self.task.target.vllm_version, torch_version=torch.__version__,
                          python_version=sys.version.split()[0], platform=platform.platform(),
                          checkout=str(self.repo.working_dir), base_commit=self.base_commit,
                          branch=self.workspace.branch, model_sha256=self.model.sha256,
                          model_margins=self.model.margins.model_dump() if self.model.margins else None,
                          task=self.task.model_dump(mode="json"))

    def baseline_tree(self) -> Path:
        self.baseline = self.workspace.worktree("baseline")
        build(0, self.baseline, [])
        return self.baseline

    def start_server(self, name: str, tree: Path, args: dict, parity: bool = False) -> Server:
        engine = self.task.engine
        env = {**engine.env, **(self.task.parity.env if parity else {})}
        args = {"dtype": self.task.model.dtype, "max_model_len": self.task.model.max_model_len, **args,
                **(self.task.parity.args if parity else {})}
        spec = ServerSpec(name=name, labels={"nightshift.run": self.run_id, "nightshift.candidate": name},
                          source_tree=tree, model_dir=self.model.path, engine_args=args, env=env,
                          startup_timeout_s=engine.startup_timeout_s, gpus=self.task.sandbox.gpus)
        server = self.sandbox.start(spec)
        self.servers.append(server)
        return server

    def stop(self, server: Server) -> None:
        if server in self.servers:
            self.servers.remove(server)
        server.stop()

    def stop_servers(self) -> None:
        for server in list(self.servers):
            self.stop(server)

    def branch_diff(self, limit: int = 50_000) -> str:
        return self.repo.git.diff(self.base_commit, self.workspace.head())[:limit]
