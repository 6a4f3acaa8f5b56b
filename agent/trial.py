"""One candidate's evaluation owns its worktree and every server it starts; on exit it releases
them exactly once, whatever happened, except what a keep handed over to the run."""
from __future__ import annotations

from pathlib import Path

from agent.pool import ServerPool, ServerRequest
from agent.workspace import Workspace
from sandbox.base import Server


class Trial:
    def __init__(self, candidate: int, pool: ServerPool, workspace: Workspace):
        self.candidate, self.pool, self.workspace = candidate, pool, workspace
        self.tree: Path | None = None
        self.servers: list[Server] = []
        self.handed_over: Server | None = None

    def __enter__(self) -> Trial:
        return self

    def __exit__(self, *exc) -> None:
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

    def start(self, requests: list[ServerRequest]) -> list[Server]:
        servers = self.pool.start(requests)
        self.servers.extend(servers)
        return servers

    def release(self, server: Server) -> None:
        """Done with one of this trial's servers before the trial ends (a parity server, say)."""
        self.pool.release(server)

    def hand_over(self, server: Server) -> tuple[Server, Path]:
        """The kept candidate's production server and tree now belong to the run."""
        self.handed_over = server
        return server, self.tree
