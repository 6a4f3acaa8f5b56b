"""The run's servers: started here (side by side where configured), tracked while they run, and
stopped here exactly once. Servers of the unmodified baseline tree export their compile caches."""
from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agent.serve_args import split_args
from agent.task import Task
from sandbox.base import Sandbox, SandboxError, Server, ServerSpec


@dataclass(frozen=True)
class ServerRequest:
    name: str
    tree: Path
    args: dict
    parity: bool = False
    """A parity server: the task's parity.env / parity.args on top (batch-invariant mode, say)."""
    startup_timeout_s: float | None = None
    """At most this long to start (a candidate's time left); engine.startup_timeout_s otherwise."""


class ServerPool:
    def __init__(self, task: Task, sandbox: Sandbox, model_dir: Path, run_id: str, cache_seed: Path | None = None,
                 starts_log: Path | None = None):
        self.task, self.sandbox, self.model_dir, self.run_id = task, sandbox, Path(model_dir), run_id
        self.cache_seed = cache_seed
        self.starts_log = starts_log
        """Where each start's duration goes, a JSON line per server (operational, not part of the trace)."""
        """Kept across runs: only servers of the unmodified vLLM (every run's baseline) export to it."""
        self.trusted: Path | None = None
        self.running: list[Server] = []
        self._lock = threading.Lock()
        self.sandbox.reap()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def trust(self, tree: Path) -> None:
        """The unmodified baseline tree: its servers may export compile caches."""
        self.trusted = Path(tree)

    def spec(self, request: ServerRequest) -> ServerSpec:
        engine, parity = self.task.engine, self.task.parity
        env = {**engine.env, **(parity.env if request.parity else {})}
        args = {"dtype": self.task.model.dtype, "max_model_len": self.task.model.max_model_len, **request.args,
                **(parity.args if request.parity else {})}
        args, lever_env = split_args(args)
        env = {**env, **lever_env}
        seed = self.cache_seed if self.cache_seed is not None and self.cache_seed.is_dir() else None
        return ServerSpec(name=request.name, labels={"nightshift.run": self.run_id, "nightshift.candidate": request.name},
                          source_tree=request.tree, model_dir=self.model_dir, engine_args=args, env=env,
                          startup_timeout_s=min(engine.startup_timeout_s, request.startup_timeout_s or math.inf),
                          gpus=self.task.sandbox.gpus, cache_seed=seed)

    def _start_one(self, request: ServerRequest) -> Server:
        began = time.monotonic()
        try:
            server = self.sandbox.start(self.spec(request))
        except BaseException as exc:
            self._log_start(request, began, type(exc).__name__)
            raise
        self._log_start(request, began, "ok")
        with self._lock:
            self.running.append(server)
        if self.cache_seed is not None and self.trusted is not None and Path(request.tree) == self.trusted:
            with self._lock:
                self.sandbox.export_cache(server, self.cache_seed)
        return server

    def _log_start(self, request: ServerRequest, began: float, outcome: str) -> None:
        if self.starts_log is None:
            return
        line = {"server": request.name, "parity": request.parity, "trusted": Path(request.tree) == self.trusted,
                "backend": self.task.sandbox.backend, "seconds": round(time.monotonic() - began, 2), "outcome": outcome}
        with self._lock, open(self.starts_log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def start(self, requests: list[ServerRequest]) -> list[Server]:
        """Start every request (side by side unless sandbox.parallel_starts is off); if one fails, the
        others are released and the first failure (a SandboxError where there is one) is raised."""
        if not self.task.sandbox.parallel_starts or len(requests) < 2:
            outcomes: list = []
            for request in requests:
                try:
                    outcomes.append(self._start_one(request))
                except Exception as exc:
                    outcomes.append(exc)
                    break
        else:
            with ThreadPoolExecutor(len(requests)) as pool:
                futures = [pool.submit(self._start_one, request) for request in requests]
                outcomes = []
                for future in futures:
                    try:
                        outcomes.append(future.result())
                    except Exception as exc:
                        outcomes.append(exc)
        failures = [o for o in outcomes if isinstance(o, Exception)]
        if failures:
            for server in outcomes:
                if not isinstance(server, Exception):
                    self.release(server)
            raise next((f for f in failures if isinstance(f, SandboxError)), failures[0])
        return outcomes

    def release(self, server: Server) -> None:
        """Stop a server this pool started; a second release of the same server does nothing."""
        with self._lock:
            if not any(s is server for s in self.running):
                return
            self.running = [s for s in self.running if s is not server]
        server.stop()

    def close(self) -> None:
        for server in list(reversed(self.running)):
            self.release(server)
