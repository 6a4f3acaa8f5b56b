"""The run's servers: started here (side by side where configured), tracked while they run, and
stopped here exactly once. Servers of the unmodified baseline tree export their compile caches."""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sandbox.base import split_serve_args
from agent.world.task import Task
from sandbox.base import Sandbox, SandboxError, Server, ServerSpec

START_SCALE = 3.0
"""A candidate's server may take this many times the baseline's slowest start on this host (at least
engine.startup_timeout_s): a host loaded enough to slow the baseline's start slows the candidate's too, and
that is no fault of the candidate's."""


@dataclass(frozen=True)
class ServerRequest:
    name: str
    tree: Path
    args: dict
    parity: bool = False
    """A parity server: the task's parity.env / parity.args on top (batch-invariant mode, say)."""
    startup_timeout_s: float | None = None
    """At most this long to start (a candidate's time left); engine.startup_timeout_s otherwise."""


START_LOG_CHARS = 2_000_000
"""How much of a server's log is kept as it stood once the server answered (`start_log`): far above any server's
start log (vLLM's on an H200, routes and CUDA-graph capture included, is tens of KB)."""


class ServerPool:
    def __init__(self, task: Task, sandbox: Sandbox, model_dir: Path, run_id: str, cache_seed: Path | None = None,
                 starts_log: Path | None = None):
        self.task, self.sandbox, self.model_dir, self.run_id = task, sandbox, Path(model_dir), run_id
        self.cache_seed = cache_seed
        """Kept across runs: only servers of the unmodified vLLM (every run's baseline) export to it."""
        self.starts_log = starts_log
        """Where each start's duration goes, a JSON line per server (operational, not part of the trace)."""
        self.trusted: Path | None = None
        self.baseline_start_s = 0.0
        """The slowest start of a server of the unmodified baseline tree, as measured in this pool."""
        self.running: list[Server] = []
        self._start_logs: dict[int, str] = {}
        """Each running server's log as it stood when it answered: the engine configuration and limits it logged
        at start, which a log read later from its tail loses once the server has served long enough."""
        self._lock = threading.Lock()
        self.sandbox.reap()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def trust(self, tree: Path) -> None:
        """The unmodified baseline tree: its servers may export compile caches."""
        self.trusted = Path(tree)

    def start_timeout(self, request: ServerRequest) -> tuple[float, str]:
        """(seconds, on what they rest): engine.startup_timeout_s, for a server not of the baseline tree raised to
        START_SCALE x the baseline's slowest start, and never past the candidate's time left."""
        timeout, basis = self.task.engine.startup_timeout_s, "engine.startup_timeout_s"
        if Path(request.tree) != self.trusted and START_SCALE * self.baseline_start_s > timeout:
            timeout = START_SCALE * self.baseline_start_s
            basis = f"{START_SCALE:g} x the baseline's start ({self.baseline_start_s:.1f} s)"
        if request.startup_timeout_s is not None and request.startup_timeout_s < timeout:
            timeout, basis = request.startup_timeout_s, "the candidate's time left"
        return timeout, basis

    def spec(self, request: ServerRequest) -> ServerSpec:
        engine, parity = self.task.engine, self.task.parity
        env = {**engine.env, **(parity.env if request.parity else {})}
        args = {"dtype": self.task.model.dtype, "max_model_len": self.task.model.max_model_len, **request.args,
                **(parity.args if request.parity else {})}
        args, lever_env = split_serve_args(args)
        env = {**env, **lever_env}
        seed = self.cache_seed if self.cache_seed is not None and self.cache_seed.is_dir() else None
        return ServerSpec(name=request.name, labels={"nightshift.run": self.run_id, "nightshift.candidate": request.name},
                          source_tree=request.tree, model_dir=self.model_dir, engine_args=args, env=env,
                          startup_timeout_s=self.start_timeout(request)[0],
                          gpus=self.task.sandbox.gpus, nice=self.task.sandbox.nice, cache_seed=seed)

    def _start_one(self, request: ServerRequest, cancel: threading.Event | None = None) -> Server:
        began = time.monotonic()
        try:
            server = self.sandbox.start(self.spec(request), cancel)
        except BaseException as exc:
            self._log_start(request, began, "cancelled" if cancelled(exc) else type(exc).__name__)
            raise
        self._log_start(request, began, "ok")
        start_log = server.logs(START_LOG_CHARS)
        with self._lock:
            self.running.append(server)
            self._start_logs[id(server)] = start_log
            if self.trusted is not None and Path(request.tree) == self.trusted:
                self.baseline_start_s = max(self.baseline_start_s, time.monotonic() - began)
        if self.cache_seed is not None and self.trusted is not None and Path(request.tree) == self.trusted:
            with self._lock:
                self.sandbox.export_cache(server, self.cache_seed)
        return server

    def _log_start(self, request: ServerRequest, began: float, outcome: str) -> None:
        if self.starts_log is None:
            return
        timeout, basis = self.start_timeout(request)
        line = {"server": request.name, "parity": request.parity, "trusted": Path(request.tree) == self.trusted,
                "backend": self.task.sandbox.backend, "seconds": round(time.monotonic() - began, 2), "outcome": outcome,
                "timeout_s": round(timeout, 1), "timeout_from": basis}
        with self._lock, open(self.starts_log, "a") as f:
            f.write(json.dumps(line) + "\n")

    def begin(self, requests: list[ServerRequest], on_started=lambda server: None) -> Starting:
        """Start every request (side by side unless sandbox.parallel_starts is off) and return at once."""
        return Starting(self, requests, on_started)

    def start(self, requests: list[ServerRequest]) -> list[Server]:
        """Start every request and wait for all; if one fails, the others are called off or released and the
        failure (a SandboxError where there is one) is raised."""
        return self.begin(requests).all()

    def start_log(self, server: Server) -> str:
        """The server's log as it stood when it answered (for a server this pool did not start: as it is now)."""
        with self._lock:
            kept = self._start_logs.get(id(server))  # released servers' entries go with them
        return kept if kept is not None else server.logs(START_LOG_CHARS)

    def release(self, server: Server) -> None:
        """Stop a server this pool started; a second release of the same server does nothing."""
        with self._lock:
            if not any(s is server for s in self.running):
                return
            self.running = [s for s in self.running if s is not server]
            self._start_logs.pop(id(server), None)
        server.stop()

    def close(self) -> None:
        for server in list(reversed(self.running)):
            self.release(server)


def cancelled(exc: BaseException) -> bool:
    return isinstance(exc, SandboxError) and exc.outcome == "cancelled"


class Starting:
    """Servers being started, each taken as soon as it answers (`get`): a check that needs one server need not
    wait for the others. A start that fails calls off the rest, as `cancel` does (a parity failure must not wait
    for a production server's start); servers already up are released. One after another when
    sandbox.parallel_starts is off: a start not begun when the rest is called off never begins."""

    def __init__(self, pool: ServerPool, requests: list[ServerRequest], on_started):
        self.pool, self.requests, self.on_started = pool, requests, on_started
        self.off = threading.Event()
        self.failure: BaseException | None = None
        """The first start that failed by itself (not called off): what called off the rest."""
        side_by_side = pool.task.sandbox.parallel_starts and len(requests) > 1
        self.executor = ThreadPoolExecutor(len(requests) if side_by_side else 1, thread_name_prefix="start")
        self.futures = [self.executor.submit(self._one, request) for request in requests]
        self.executor.shutdown(wait=False)

    def _one(self, request: ServerRequest) -> Server:
        if self.off.is_set():
            raise SandboxError("cancelled", f"{request.name}: start called off before it began")
        try:
            server = self.pool._start_one(request, self.off)
        except BaseException as exc:
            if not cancelled(exc) and self.failure is None:
                self.failure = exc
            self.off.set()
            raise
        self.on_started(server)
        return server

    def get(self, index: int) -> Server:
        """The server of requests[index] once it answers; raises its start's failure, or the failure of the
        start that called it off."""
        exc = self.futures[index].exception()
        if exc is None:
            return self.futures[index].result()
        raise self.failure if cancelled(exc) and self.failure is not None else exc

    def cancel(self) -> None:
        """Call off every start still under way and release every server that came up; returns when all ended."""
        self.off.set()
        for future in self.futures:
            if future.exception() is None:
                self.pool.release(future.result())

    def all(self) -> list[Server]:
        """Every server, once each answers; if any start failed, the rest is called off or released and the
        first real failure (not a called-off start; a SandboxError where there is one) is raised."""
        try:
            failures = [exc for exc in (f.exception() for f in self.futures) if exc is not None]
        except BaseException:  # interrupted while waiting: no start may finish after its pool closed
            self.cancel()
            raise
        if not failures:
            return [f.result() for f in self.futures]
        self.cancel()
        real = [exc for exc in failures if not cancelled(exc)] or failures
        raise next((exc for exc in real if isinstance(exc, SandboxError)), real[0])
