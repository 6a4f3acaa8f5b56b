"""One candidate's evaluation owns its worktree and every server it starts; on exit it releases
them exactly once, whatever happened, except what a keep handed over to the run. With a time limit
(budget.candidate_timeout_s), its servers are killed when the time is up, which ends whatever waits on them."""
from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

from agent.run.pool import ServerPool, ServerRequest, Starting
from agent.run.workspace import Workspace
from sandbox.base import Server


class Trial:
    def __init__(self, candidate: int, pool: ServerPool, workspace: Workspace, timeout_s: float | None = None):
        self.candidate, self.pool, self.workspace = candidate, pool, workspace
        self.tree: Path | None = None
        self.servers: list[Server] = []
        self.handed_over: Server | None = None
        self.timeout_s, self.deadline, self.expired, self.armed = timeout_s, None, False, False
        self._lock, self._timer = threading.Lock(), None

    def __enter__(self) -> Trial:
        if self.timeout_s:
            self.deadline, self.armed = time.monotonic() + self.timeout_s, True
            self._timer = threading.Timer(self.timeout_s, self._expire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def _expire(self) -> None:
        with self._lock:
            if not self.armed:
                return
            self.expired, servers = True, list(self.servers)
        for server in servers:
            server.kill("timeout")

    def disarm(self) -> bool:
        """Stop the clock before the decision; True if the candidate's time ran out (its servers were killed)."""
        with self._lock:
            self.armed = False
        if self._timer is not None:
            self._timer.cancel()
        return self.expired or (self.deadline is not None and time.monotonic() >= self.deadline)

    def __exit__(self, *exc) -> None:
        self.disarm()
        for server in self.servers:
            if server is not self.handed_over:
                self.pool.release(server)
        self.servers = []
        if self.tree is not None and self.handed_over is None:
            self.workspace.remove(self.tree)

    def worktree(self) -> Path:
        """A fresh worktree at the run branch's head, for this candidate."""
        self.tree = self.workspace.worktree(f"candidate-{self.candidate}")
        return self.tree

    def begin(self, requests: list[ServerRequest]) -> Starting:
        """Start these servers, each the trial's own as soon as it answers (`Starting.get`), within its time."""
        if self.deadline is not None:
            left = max(0.1, self.deadline - time.monotonic())
            requests = [dataclasses.replace(r, startup_timeout_s=left) for r in requests]
        return self.pool.begin(requests, self._own)

    def _own(self, server: Server) -> None:
        with self._lock:
            self.servers.append(server)
            late = self.expired
        if late:
            server.kill("timeout")

    def release(self, server: Server) -> None:
        """Done with one of this trial's servers before the trial ends (a parity server, say)."""
        self.pool.release(server)

    def hand_over(self, server: Server) -> tuple[Server, Path]:
        """The kept candidate's production server and tree now belong to the run."""
        self.handed_over = server
        return server, self.tree
