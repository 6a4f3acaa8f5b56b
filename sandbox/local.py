"""Local-process backend: each server is its own process group with its own temp dirs and a
minimal environment (no inherited secrets), killed as a group on timeout or stop."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import tempfile
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

from sandbox.base import (CACHE_DIRS, Endpoint, Outcome, Reachable, SandboxError, ServerSpec, build_env, read_imports,
                          runtime_env, serve_argv, wait_healthy)
from sandbox.config import SandboxConfig
from sandbox import priority
from sandbox.host import (hold_processes, marked_processes, owner_alive, process_identity, process_tree, running,
                          same_boot, server_marks, stat_fields)

RECORDER = Path(__file__).parent / "recorder"
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "LD_LIBRARY_PATH",
              "CUDA_HOME", "CUDA_VISIBLE_DEVICES")
"""Host variables a server inherits; anything else it needs (NCCL, NVSHMEM settings) is the task's engine.env."""
PASSED_PREFIXES = ("VLLM_", "NVIDIA_")


def free_port() -> int:
    """A port free now: another process may take it before the server binds it (see LocalSandbox.start)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LISTEN = "0A"
"""A TCP socket's state in /proc/net/tcp while it listens."""


def listening_sockets(port: int) -> set[str]:
    """The inodes of the TCP sockets (IPv4 or IPv6) that listen on PORT on any address, from /proc/net/tcp*."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[9])
    return found


def holds_socket(pids: list[int], inodes: set[str]) -> bool:
    """Whether one of PIDS has one of the socket INODES open."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    return True
            except OSError:
                pass
    return False


T = TypeVar("T")
ADDRESS_IN_USE = "address already in use"
PORT_ATTEMPTS = 3
"""Starts on a fresh port after another process took the last one between its choice and the server's bind."""


def on_a_fresh_port(start: Callable[[], T]) -> T:
    """start(), made again (on the fresh port it chooses) while the server exits unable to bind the port it was given
    because another process took it first: PORT_ATTEMPTS times at most."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return start()
        except SandboxError as exc:
            if attempt == PORT_ATTEMPTS or exc.outcome != "crash" or ADDRESS_IN_USE not in exc.logs.lower():
                raise
    raise AssertionError("unreachable")


def server_env(spec: ServerSpec, home: Path, import_log: Path, source_tree: Path, tmp: Path | None = None) -> dict[str, str]:
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    fixed = {**runtime_env(str(home), str(source_tree), str(RECORDER), str(import_log), inherited,
                           tmp=str(tmp or home), write_bytecode=True), **server_marks(home)}
    if spec.gpus:
        fixed["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    return build_env(os.environ, PASSED_ENV, PASSED_PREFIXES, fixed, spec)


def classify_exit(returncode: int | None, logs: str) -> Outcome:
    if returncode in (-signal.SIGKILL, 137) or "OutOfMemoryError" in logs or "Cannot allocate memory" in logs:
        return "oom"
    return "crash"


class LocalServer(Reachable):
    def __init__(self, spec: ServerSpec, process: subprocess.Popen, port: int, home: Path, log: Path,
                 import_log: Path, tmp: Path):
        self.name, self.spec, self.process, self.port = spec.name, spec, process, port
        self.home, self.log, self.import_log = home, log, import_log
        self.tmp = tmp
        self.endpoint = Endpoint(f"http://127.0.0.1:{port}")

    def imported_files(self) -> list[str]:
        return read_imports(self.import_log)

    def logs(self, limit: int = 20_000) -> str:
        if not self.log.exists():
            return ""
        with open(self.log, "rb") as f:
            f.seek(max(0, self.log.stat().st_size - limit))
            return f.read().decode(errors="replace")

    def exit_code(self) -> int | None:
        return self.process.poll()

    def hold(self, frozen: bool) -> None:
        """Its process group and its process tree (a process that left the group is still its leader's
        descendant, unless it was orphaned: the local backend is no containment, see docs/sandbox.md)."""
        if _group_is_ours(self.process):
            hold_processes(lambda: set(_group_members(self.process.pid)) | process_tree(self.process.pid), frozen)

    def answers_itself(self) -> bool:
        """Whether the socket listening on this server's port is held by one of its own processes: a port is
        chosen free, but another process (another run's server, anything on the host) may bind it first, and
        then /health answers for that process, not this server."""
        return holds_socket(_group_members(self.process.pid), listening_sockets(self.port))

    def alive(self) -> bool:
        return self.exit_code() is None

    def stop(self) -> Outcome:
        self.hold(False)  # a held server would sit out the grace period with its SIGTERM pending
        return self._end(grace_s=15)

    def kill(self, outcome: Outcome | None = None) -> Outcome:
        return self._end(grace_s=0, outcome=outcome)

    def _end(self, grace_s: float, outcome: Outcome | None = None) -> Outcome:
        outcome = outcome or ("ok" if self.alive() else classify_exit(self.process.returncode, self.logs()))
        _kill_group(self.process, grace_s)
        (self.home / "pid").unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return outcome


def _group_is_ours(process: subprocess.Popen) -> bool:
    """Whether process group `process.pid` is still the server's. Until its leader is waited for, its pid (and so
    the group's id) is no one else's; once it is, another process may get that pid and, a session leader, the
    group id too (pids wrap within seconds where a fork bomb spends them: at pid_max 32768 every failed fork beside
    a pids limit takes one), and a hold or a kill would reach that stranger (a thread of another process too: kill()
    with a thread's id stops its whole process). Then the group is the server's only while nothing runs on the
    leader's pid: its leftovers hold the id, a stranger cannot have it."""
    return process.returncode is None or not running(process.pid)


def _kill_group(process: subprocess.Popen, grace_s: float) -> None:
    if not _group_is_ours(process):
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    if _group_is_ours(process):  # waited for now, maybe: its pid may be another's already
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


class LocalSandbox:
    @classmethod
    def probe(cls, config: SandboxConfig | None = None) -> None:
        """Servers run as this user's processes: nothing to check."""

    def __init__(self, config: SandboxConfig | None = None, run_dir: Path | None = None):
        self.config = config
        self.root = Path(run_dir or Path.cwd()) / "servers"

    def start(self, spec: ServerSpec, cancel: threading.Event | None = None) -> LocalServer:
        """A healthy server on a port of its own: a start whose port another process took first (the server
        exits unable to bind it) is made again on a fresh port, PORT_ATTEMPTS times at most."""
        return on_a_fresh_port(lambda: self._start(spec, cancel))

    def _start(self, spec: ServerSpec, cancel: threading.Event | None) -> LocalServer:
        home = self.root / spec.name
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        if spec.cache_seed is not None:
            copy_caches(Path(spec.cache_seed), home)
        tmp = Path(tempfile.mkdtemp(prefix="nightshift-"))  # short: vLLM binds Unix sockets in it
        log, import_log = home / "server.log", home / "imports.txt"
        port = free_port()
        source_tree = Path(spec.source_tree).resolve()
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", *serve_argv(spec),
                "--host", "127.0.0.1", "--port", str(port)]
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, cwd=tmp, env=server_env(spec, home, import_log, source_tree, tmp),
                                       stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=priority.in_child(spec.nice))
        record_server(home, process.pid)
        server = LocalServer(spec, process, port, home, log, import_log, tmp)
        wait_healthy(server, spec.startup_timeout_s, cancel)
        return server

    def export_cache(self, server: LocalServer, dest: Path) -> None:
        """Copy a (trusted) server's compile caches into `dest`, the seed for later servers."""
        copy_caches(server.home, Path(dest))

    def reap(self) -> int:
        """Kill the server process groups of runs (in the same runs folder) whose harness is gone."""
        return reap_servers(self.root.parent.parent)


def record_server(home: Path, pid: int) -> None:
    """What `reap_servers` needs to find a server's process group after its harness died: the group's pid,
    the harness's pid, and the leader's identity (boot and start time: a pid alone may be reused). Each file is
    whole when it appears, and the pid file comes last: a reaper in another process (a parallel run's workers
    reap while their neighbours start servers) never sees a pid without its owner."""
    for name, text in (("owner", str(os.getpid())), ("identity", process_identity(pid)), ("pid", str(pid))):
        part = home / f".{name}.part"
        part.write_text(text)
        os.replace(part, home / name)


def _group_members(pgid: int) -> list[int]:
    """The processes of group PGID that still run (a zombie is dead: it waits only for its parent)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = stat_fields(int(entry.name))
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return members


def _ours(pgid: int, recorded: str) -> bool:
    """Whether process group PGID is still the server recorded (its leader may have died before the others)."""
    if not recorded:
        return True
    if running(pgid):
        return process_identity(pgid) == recorded
    return same_boot(recorded) and bool(_group_members(pgid))


def reap_servers(runs_root: Path, wait_s: float = 10) -> int:
    """Kill the process group of every server under RUNS_ROOT/*/servers/ whose harness is gone; returns how many
    servers had processes killed (a server counts once, however many groups its processes were found in). A group
    whose leader is not the process that was recorded (another boot, a reused pid) is left alone. Waits (WAIT_S at
    most) until the killed processes are gone, so that no later look finds them dying and counts them again."""
    killed: dict[int, str] = {}
    """Each killed process group -> the server home it belongs to."""
    for pid_file in Path(runs_root).glob("*/servers/*/pid"):
        owner, identity = pid_file.with_name("owner"), pid_file.with_name("identity")
        try:
            owner_pid = int(owner.read_text())
        except (OSError, ValueError):
            continue  # not a whole record: the marks in the server's environment decide (_reap_unrecorded)
        if running(owner_pid):
            continue
        try:
            pgid = int(pid_file.read_text())
        except OSError:
            continue  # stopped meanwhile
        except ValueError:
            pgid = 0
        if pgid > 0 and _ours(pgid, identity.read_text() if identity.exists() else ""):
            try:
                os.killpg(pgid, signal.SIGKILL)
                killed[pgid] = str(pid_file.parent.resolve())
            except (ProcessLookupError, PermissionError):
                pass
        pid_file.unlink(missing_ok=True)
        identity.unlink(missing_ok=True)
    killed.update(_reap_unrecorded(runs_root, set(killed)))
    deadline = time.monotonic() + wait_s
    while any(_group_members(g) for g in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(set(killed.values()))


def _reap_unrecorded(runs_root: Path, done: set[int]) -> dict[int, str]:
    """Kill the groups of server processes under RUNS_ROOT whose harness is gone that no pid file names (a harness
    killed between starting a server and recording it; a home another start cleared; a process that left its
    server's group): found by their marks. Returns each group killed -> its server's home; groups in DONE were
    killed already (a dying process is still found by its marks) and are not killed again."""
    groups: dict[int, str] = {}
    for pid, owner, home in marked_processes(runs_root, with_home=True):
        if owner_alive(owner):
            continue
        try:
            group = os.getpgid(pid)
            if group in done:
                continue
            if group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            groups[group] = home
        except (ProcessLookupError, PermissionError):
            pass
    return groups


def copy_caches(source: Path, dest: Path) -> None:
    for name in CACHE_DIRS:
        if (source / name).is_dir():
            shutil.copytree(source / name, dest / name, symlinks=True, dirs_exist_ok=True)

