"""Docker backend: each candidate's server runs in its own hardened container (see docs/sandbox.md).

The container has no network; the harness reaches `vllm serve --uds` through a Unix socket in a
per-server folder on the host (/tmp/nightshift-io/...), which is the only thing mounted
read-write. The container's shape is decided by sandbox.docker_spec.container_spec.
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import tarfile
import tempfile
import threading
from pathlib import Path

import docker
from docker.errors import DockerException, NotFound

from sandbox.base import Endpoint, Outcome, Reachable, SandboxError, ServerSpec, read_imports, wait_healthy
from sandbox.config import SandboxConfig
from sandbox.docker_spec import EXPORTING, IMPORT_LOG_NAME, LABEL, SANDBOX_UID, SOCKET_NAME, container_spec, slug
from sandbox.gpu_idle import gpu_memory_used_mib, wait_until_idle
from sandbox.host import open_for_reading, owner_alive, process_identity
from traces.errors import NightshiftError

log = logging.getLogger(__name__)

RECORDER = Path(__file__).parent / "recorder"
IO_ROOT = Path(os.environ.get("NIGHTSHIFT_SANDBOX_IO", "/tmp/nightshift-io"))
STOP_GRACE_S = 15
LOG_TAIL_LINES = 5000


class DockerUnavailable(NightshiftError, RuntimeError):
    """No Docker engine answers (not a candidate's fault)."""

    stage = "sandbox"


class GpuNotIdle(NightshiftError, RuntimeError):
    """A GPU still holds memory after the previous candidate (not the next candidate's fault)."""

    stage = "start"


def connect() -> docker.DockerClient:
    try:
        client = docker.from_env(timeout=120)
        client.ping()
        return client
    except DockerException as exc:
        raise DockerUnavailable(f"no Docker engine reachable ({exc}); start one with "
                                "scripts/docker-engine.sh") from None


def classify(state: dict) -> Outcome:
    if state.get("OOMKilled"):
        return "oom"
    if state.get("Running"):
        return "ok"
    return "crash"


class DockerServer(Reachable):
    def __init__(self, spec: ServerSpec, container, io_dir: Path, gpus: list[int], idle_mib: dict[int, int]):
        self.name, self.spec, self.container, self.io_dir = spec.name, spec, container, io_dir
        self.gpus, self.idle_mib = gpus, idle_mib
        self.socket = io_dir / SOCKET_NAME
        self.endpoint = Endpoint("http://sandbox", uds=str(self.socket))
        self.gpu_idle: tuple[bool, str] | None = None
        self._final: tuple[Outcome, str, list[str]] | None = None

    def imported_files(self) -> list[str]:
        return self._final[2] if self._final else read_imports(self.io_dir / IMPORT_LOG_NAME)

    def logs(self, limit: int = 20_000) -> str:
        if self._final:
            return self._final[1][-limit:]
        try:
            return self.container.logs(tail=LOG_TAIL_LINES).decode(errors="replace")[-limit:]
        except DockerException:
            return ""

    def state(self) -> dict:
        try:
            self.container.reload()
            return self.container.attrs["State"]
        except NotFound:
            return {"Running": False}

    def alive(self) -> bool:
        return bool(self.state().get("Running"))

    def host_pid(self) -> int | None:
        """The container's init as this host sees it (the engine runs here: the socket is a bind mount)."""
        return self.state().get("Pid") or None

    def hold(self, frozen: bool) -> None:
        """The engine's pause (the container's cgroup frozen: every process in it, however it was started)."""
        try:
            state = self.state()
            if frozen and state.get("Running") and not state.get("Paused"):
                self.container.pause()
            elif not frozen and state.get("Paused"):
                self.container.unpause()
        except DockerException:
            pass

    def exit_code(self) -> int | None:
        state = self.state()
        if state.get("Running") or state.get("Status") == "created":
            return None
        return state.get("ExitCode", -1)

    def stop(self) -> Outcome:
        """Stop (SIGTERM, then SIGKILL after a grace period), keep logs and imports, remove."""
        if self._final:
            return self._final[0]
        outcome = classify(self.state())
        self.hold(False)  # a paused container would sit out the grace period with its SIGTERM pending
        try:
            self.container.stop(timeout=STOP_GRACE_S)
        except DockerException:
            pass
        if outcome == "ok" and self.state().get("OOMKilled"):
            outcome = "oom"
        self._finish(outcome)
        return outcome

    def kill(self, outcome: Outcome | None = None) -> Outcome:
        if self._final:
            return self._final[0]
        outcome = outcome or classify(self.state())
        self._finish(outcome)
        return outcome

    def _finish(self, outcome: Outcome) -> None:
        logs, imports = self.logs(limit=1_000_000), self.imported_files()
        try:
            self.container.remove(force=True)
        except NotFound:
            pass
        shutil.rmtree(self.io_dir, ignore_errors=True)
        self._final = (outcome, logs, imports)
        self.gpu_idle = wait_until_idle(self.gpus, self.idle_mib)


class DockerSandbox:
    @classmethod
    def probe(cls, config: SandboxConfig | None = None) -> None:
        """An engine that answers; raises DockerUnavailable."""
        connect().close()

    def __init__(self, config: SandboxConfig | None = None, run_dir: Path | None = None):
        self.config = config or SandboxConfig(backend="docker")
        self.run_dir = Path(run_dir or Path.cwd()).resolve()
        self.run = slug(self.run_dir.name)
        self.owner = process_identity(os.getpid())
        self.idle_mib: dict[int, int] = {}
        self._client: docker.DockerClient | None = None
        self._reaped = False
        self.gpu_idle_timeout_s = 60.0

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = connect()
        return self._client

    def user(self) -> str:
        return f"{SANDBOX_UID}:{SANDBOX_UID}" if os.getuid() == 0 else f"{os.getuid()}:{os.getgid()}"

    def io_folder(self) -> Path:
        IO_ROOT.mkdir(parents=True, exist_ok=True)
        io_dir = Path(tempfile.mkdtemp(prefix="ns-", dir=IO_ROOT))
        if os.getuid() == 0:
            os.chown(io_dir, SANDBOX_UID, SANDBOX_UID)
        return io_dir

    def spec_for(self, spec: ServerSpec, io_dir: Path) -> dict:
        c = self.config
        return container_spec(
            spec, image=c.image, run=self.run, io_dir=io_dir, recorder=RECORDER, owner=self.owner,
            user=self.user(), memory_gb=c.memory_gb, cpus=c.cpus, pids_limit=c.pids_limit,
            tmpfs_mb=c.tmpfs_mb, gpus=list(spec.gpus or c.gpus), private=[self.run_dir],
            host_env=os.environ)

    def start(self, spec: ServerSpec, cancel: threading.Event | None = None) -> DockerServer:
        if not self._reaped:
            self.reap()
        gpus = list(spec.gpus or self.config.gpus)
        self.check_gpus_idle(gpus)
        if os.getuid() == 0:  # the container runs as another user, who must read the tree, the model and the seed
            for root in (Path(spec.source_tree), Path(spec.model_dir), *([Path(spec.cache_seed)] if spec.cache_seed else [])):
                if changed := open_for_reading(root.resolve()):
                    log.info("made %d paths under %s readable for the sandbox user", changed, root)
        io_dir = self.io_folder()
        kwargs = self.spec_for(spec, io_dir)
        self._remove_named(kwargs["name"])
        try:
            container = self.client.containers.create(**kwargs)
        except DockerException as exc:
            shutil.rmtree(io_dir, ignore_errors=True)
            raise SandboxError("crash", f"cannot create the container: {exc}") from None
        server = DockerServer(spec, container, io_dir, gpus, self.idle_mib)
        try:
            container.start()
        except DockerException as exc:
            server.kill()
            raise SandboxError("crash", f"cannot start the container: {exc}", server.logs()) from None
        wait_healthy(server, spec.startup_timeout_s, cancel)
        return server

    def export_cache(self, server: DockerServer, dest: Path) -> None:
        """Copy a (trusted) server's compile caches out of its tmpfs into `dest` (each later container is started
        with them copied in: docker_spec.SEEDING). The engine's archive API cannot see a tmpfs, so a process in
        the container writes them as a tar to its output."""
        try:
            result = server.container.exec_run(["python3", "-c", EXPORTING], demux=True)
        except DockerException as exc:
            log.warning("could not export %s's caches: %s", server.name, exc)
            return
        out, err = result.output
        if result.exit_code != 0 or not out:
            log.warning("could not export %s's caches: %s", server.name, (err or b"").decode(errors="replace")[-500:])
            return
        Path(dest).mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(out)) as tar:
            tar.extractall(dest, filter="data")

    def check_gpus_idle(self, gpus: list[int]) -> None:
        """The first sight of a GPU sets its idle level; later, wait for it to come back there."""
        for gpu, mib in (gpu_memory_used_mib(gpus) or {}).items():
            self.idle_mib.setdefault(gpu, mib)
        idle, reason = wait_until_idle(gpus, self.idle_mib, timeout_s=self.gpu_idle_timeout_s)
        if not idle:
            raise GpuNotIdle(reason)

    def _remove_named(self, name: str) -> None:
        try:
            old = self.client.containers.get(name)
        except NotFound:
            return
        old.remove(force=True)
        io = old.labels.get(f"{LABEL}.io")
        if io and Path(io).parent == IO_ROOT:
            shutil.rmtree(io, ignore_errors=True)

    def reap(self) -> int:
        """Remove the containers (and socket folders) of harness processes that no longer run."""
        self._reaped = True
        reaped = 0
        for container in self.client.containers.list(all=True, filters={"label": f"{LABEL}=sandbox"}):
            if owner_alive(container.labels.get(f"{LABEL}.owner", "")):
                continue
            log.info("reaping %s (run %s, owner %s gone)", container.name,
                     container.labels.get(f"{LABEL}.run"), container.labels.get(f"{LABEL}.owner"))
            try:
                container.remove(force=True)
                reaped += 1
            except NotFound:
                pass
            io = container.labels.get(f"{LABEL}.io")
            if io and Path(io).parent == IO_ROOT:
                shutil.rmtree(io, ignore_errors=True)
        return reaped

