"""Everything a run needs before its first candidate: checkout, model, branch, trace, sandbox."""
from __future__ import annotations

import json
import platform
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import git

import agent
from agent.build import build
from agent.checkout import create_checkout, default_checkout_path, installed_vllm, open_checkout, version_tag
from agent.checkpoint import CheckpointInfo, cache_root, ensure_synthetic, real_checkpoint
from agent.task import Task
from agent.workspace import Workspace
from sandbox import make_sandbox
from sandbox.base import Sandbox, SandboxError, Server, ServerSpec
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
                            final_norm_scale=synthetic.final_norm_scale, post_norm_scale=synthetic.post_norm_scale,
                            embedding_norm_sigma=synthetic.embedding_norm_sigma)


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
        self.cache_seed = cache_root() / "compile-caches" / f"vllm-{task.target.vllm_version}"
        """Kept across runs: only servers of the unmodified vLLM (every run's baseline) export to it."""
        self._cache_lock = threading.Lock()

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
        """Start one server. Servers of the unmodified baseline tree export their compile caches,
        which later servers (of this run and later runs) start from; a candidate's caches are never
        exported."""
        engine = self.task.engine
        env = {**engine.env, **(self.task.parity.env if parity else {})}
        args = {"dtype": self.task.model.dtype, "max_model_len": self.task.model.max_model_len, **args,
                **(self.task.parity.args if parity else {})}
        trusted = self.baseline is not None and Path(tree) == self.baseline
        seed = self.cache_seed if self.cache_seed.is_dir() else None
        spec = ServerSpec(name=name, labels={"nightshift.run": self.run_id, "nightshift.candidate": name},
                          source_tree=tree, model_dir=self.model.path, engine_args=args, env=env,
                          startup_timeout_s=engine.startup_timeout_s, gpus=self.task.sandbox.gpus, cache_seed=seed)
        server = self.sandbox.start(spec)
        self.servers.append(server)
        export = getattr(self.sandbox, "export_cache", None)
        if trusted and export is not None:
            with self._cache_lock:
                export(server, self.cache_seed)
        return server

    def start_servers(self, requests: list[tuple[str, Path, dict, bool]]) -> list[Server]:
        """Start several servers (side by side unless sandbox.parallel_starts is off); if one fails,
        the others are stopped and the first failure is raised."""
        if not self.task.sandbox.parallel_starts or len(requests) < 2:
            started: list[Server] = []
            try:
                for request in requests:
                    started.append(self.start_server(*request))
            except BaseException:
                for server in started:
                    self.stop(server)
                raise
            return started
        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(self.start_server, *request) for request in requests]
            outcomes: list = []
            for future in futures:  # an interrupt here propagates once the starts end; the run stops them
                try:
                    outcomes.append(future.result())
                except Exception as exc:
                    outcomes.append(exc)
        failures = [o for o in outcomes if isinstance(o, Exception)]
        if failures:
            for server in outcomes:
                if not isinstance(server, Exception):
                    self.stop(server)
            raise next((f for f in failures if isinstance(f, SandboxError)), failures[0])
        return outcomes

    def stop(self, server: Server) -> None:
        if server in self.servers:
            self.servers.remove(server)
        server.stop()

    def stop_servers(self) -> None:
        for server in list(self.servers):
            self.stop(server)

    def branch_diff(self, limit: int = 50_000) -> str:
        return self.repo.git.diff(self.base_commit, self.workspace.head())[:limit]
