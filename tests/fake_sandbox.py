"""A Sandbox whose servers are tests/fake_vllm.py processes: same protocol, same process handling."""
import os
import shutil
import subprocess
import threading
import sys
from pathlib import Path

from sandbox.base import ServerSpec
from sandbox.host import server_marks
from sandbox.local import LocalServer, free_port, on_a_fresh_port, reap_servers, record_server, wait_healthy

FAKE = Path(__file__).parent / "fake_vllm.py"


class CountedServer(LocalServer):
    """A LocalServer that tells its sandbox each time it is stopped."""

    def stop(self):
        self.sandbox.stops[self.name] = self.sandbox.stops.get(self.name, 0) + 1
        return super().stop()


class FakeSandbox:
    def __init__(self, root: Path):
        self.root = root
        self.started: list[ServerSpec] = []
        self.exported: list[str] = []
        self.stops: dict[str, int] = {}

    def start(self, spec: ServerSpec, cancel: threading.Event | None = None) -> LocalServer:
        """As the local backend's: made again on a fresh port when another process took this one first (a neighbour
        test's server bound it between free_port() and the fake's bind: 'Address already in use' in a paced run)."""
        return on_a_fresh_port(lambda: self._start(spec, cancel))

    def _start(self, spec: ServerSpec, cancel: threading.Event | None) -> LocalServer:
        home = self.root / spec.name
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        port, log, imports = free_port(), home / "server.log", home / "imports.txt"
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, str(FAKE), str(spec.source_tree), str(port), str(imports)],
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, **server_marks(home), **spec.env})
        record_server(home, process.pid)
        (home / "tmp").mkdir()
        server = CountedServer(spec, process, port, home, log, imports, home / "tmp")
        server.sandbox = self
        wait_healthy(server, min(30, spec.startup_timeout_s), cancel)
        self.started.append(spec)
        return server

    def export_cache(self, server: LocalServer, dest: Path) -> None:
        self.exported.append(server.name)

    def reap(self) -> int:
        """As the local backend: the servers of runs (next to this one) whose harness is gone."""
        return reap_servers(self.root.parent.parent)


def worker_sandbox(config, folder: Path) -> FakeSandbox:
    """A parallel worker's sandbox (agent/run/worker.py): its servers under its own folder."""
    return FakeSandbox(Path(folder) / "servers")
