"""The incumbent: the server of the branch head that every candidate is benchmarked beside. It is replaced by a
keep, restarted when its server fails mid-benchmark, and restored (served from the branch head) when a run resumes
or a parallel worker moves to another head."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from agent.run.pool import ServerPool, ServerRequest
from agent.run.setup import RunSetup
from agent.run.workspace import serve_args_at
from agent.stages import bench
from agent.stages.build import build
from sandbox.base import SandboxError, Server
from sandbox.host import describe_snapshot, server_snapshot
from traces.errors import NightshiftError
from traces.schema import IncumbentRestarted

MAX_INCUMBENT_RESTARTS = 3
"""Per run: an incumbent that keeps failing is a broken setup, not bad luck."""


class IncumbentFailed(NightshiftError):
    stage = "benchmark"


class Incumbent:
    def __init__(self, setup: RunSetup, pool: ServerPool, reference: Server, server: Server, args: dict, tree: Path,
                 emit: Callable):
        self.s, self.pool, self.reference, self.emit = setup, pool, reference, emit
        self.server, self.args, self.tree = server, dict(args), Path(tree)
        self.restarts = 0

    def replace(self, server: Server, args: dict, tree: Path) -> None:
        """`server` serving `tree` with `args` is the incumbent now; the previous one's server and tree go (never
        the reference, nor the trusted baseline tree)."""
        previous_server, previous_tree = self.server, self.tree
        self.server, self.args, self.tree = server, dict(args), Path(tree)
        if previous_server is not self.reference:
            self.pool.release(previous_server)
        if previous_tree != self.pool.trusted:
            self.s.workspace.remove(previous_tree)

    def restore(self, head: str, name: str = "incumbent") -> None:
        """Serve the commit `head` with the flags of its nightshift.serve.yaml (a resumed run's branch head)."""
        tree = self.s.workspace.worktree(name)
        build(0, tree, [], bytecode_from=self.pool.trusted, link=self.s.linked)
        args = serve_args_at(self.s.repo, head) or dict(self.s.task.engine.args)
        self.replace(self.pool.start([ServerRequest(name, tree, args)])[0], args, tree)

    def restart(self, n: int, confirmation: int, failure: bench.PassFailed) -> None:
        """A fresh server of the incumbent's tree and flags in place of one that failed mid-benchmark."""
        if self.server is self.reference:
            raise IncumbentFailed(f"{failure}; the incumbent is also the parity reference, which is not replaced "
                                  "mid-run: resume the run (nightshift run --resume)")
        if self.restarts >= MAX_INCUMBENT_RESTARTS:
            raise IncumbentFailed(f"{failure}; the incumbent's server already failed {self.restarts} times in this run")
        self.restarts += 1
        post_mortem = server_snapshot(self.server)
        self.pool.release(self.server)
        began = time.monotonic()
        try:
            self.server = self.pool.start([ServerRequest(f"incumbent-r{self.restarts}", self.tree, self.args)])[0]
        except SandboxError as exc:
            raise IncumbentFailed(f"{failure}; its replacement failed to start: {exc}") from None
        self.emit(IncumbentRestarted(candidate=n, confirmation=confirmation, failed_server=failure.server,
                                     server=self.server.name, reason=f"{failure}; {describe_snapshot(post_mortem)}",
                                     seconds=round(time.monotonic() - began, 2), post_mortem=post_mortem))
