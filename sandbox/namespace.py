"""Namespace backend: each server in fresh mount, pid, net, ipc, uts and cgroup namespaces made by
util-linux `unshare`, on a root built of read-only binds, with no Docker (see docs/sandbox.md).

`sandbox/ns_init.py` is the namespace's pid 1: it mounts the root, pivots into it and starts
`vllm serve --uds` as an unprivileged user. The harness reaches the server through a Unix socket
in a per-server host folder (/tmp/nightshift-ns/...), mounted read-write at /sandbox/io. Limits come
from a per-server cgroup (sandbox/cgroups.py), or from rlimits where no cgroup is writable.
"""
from __future__ import annotations

import compileall
import functools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sandbox import priority
from sandbox import cgroups
from sandbox.base import (Endpoint, Outcome, Reachable, SandboxError, ServerSpec, build_env, read_imports, runtime_env,
                          serve_argv, wait_healthy)
from sandbox.config import SandboxConfig
from sandbox.docker_spec import check_not_exposed, slug
from sandbox.host import hold_processes, open_for_reading, owner_alive, process_identity, process_tree, start_time
from sandbox.base import CACHE_DIRS
from sandbox.local import PASSED_ENV, PASSED_PREFIXES, copy_caches
from traces.errors import NightshiftError

log = logging.getLogger(__name__)

IO_ROOT = Path(os.environ.get("NIGHTSHIFT_NAMESPACE_IO", "/tmp/nightshift-ns"))
INIT = Path(__file__).with_name("ns_init.py")
RECORDER = Path(__file__).parent / "recorder"
TREE, MODEL, RECORDER_AT, IO, SCRATCH = "/sandbox/tree", "/sandbox/model", "/sandbox/recorder", "/sandbox/io", "/tmp"
SOCKET_NAME, IMPORT_LOG_NAME = "server.sock", "imports.txt"
SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "ssl", "ca-certificates",
       "alternatives", "mime.types", "os-release", "gai.conf", "protocols", "services")
UNSHARE = ("--mount", "--pid", "--net", "--ipc", "--uts", "--cgroup", "--fork", "--kill-child")
HARNESS = Path(__file__).resolve().parents[1]
"""The harness's own source: never bound into a sandbox, never on its import path."""
UID_RANGE = (100_000, 165_536)
STOP_GRACE_S = 15
INIT_FAILED = 125
JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
"""Put this shell into each cgroup given before `--`, then become the command after it."""


class NamespaceUnavailable(NightshiftError, RuntimeError):
    """This host cannot make the namespaces (not a candidate's fault)."""

    stage = "sandbox"


OTHER_BACKENDS = ("run as root, or set `sandbox.backend: docker` (a Docker engine; scripts/docker-engine.sh), or "
                  "`local` (no isolation: a candidate reaches every process and file of the run; flags and trusted "
                  "patches only); docs/sandbox.md")


@functools.cache
def probe() -> tuple[bool, str]:
    """(whether the server needs a user namespace, what was found); raises NamespaceUnavailable."""
    if shutil.which("unshare") is None:
        raise NamespaceUnavailable(f"the namespace sandbox needs util-linux's `unshare`; none is on PATH; {OTHER_BACKENDS}")
    userns = os.geteuid() != 0
    argv = ["unshare", *UNSHARE, *(["--user", "--map-root-user"] if userns else []), "true"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        why = done.stderr.strip() or f"exit code {done.returncode}"
        raise NamespaceUnavailable(f"cannot create namespaces with `{' '.join(argv)}`: {why}"
                                   + (" (not root, and no unprivileged user namespaces)" if userns else "")
                                   + f"; {OTHER_BACKENDS}")
    return userns, "user namespace (uid 0 inside, no capabilities)" if userns else "root: server runs as its own uid"


def python_roots(run_dir: Path | None = None) -> list[Path]:
    """What the interpreter and the installed vLLM need, beyond /usr: its prefixes and site folders. A folder that
    holds `run_dir` is left out, not mounted: `python -m` run from the folder of the runs puts it on the import path,
    and vLLM is never imported from a run folder's parents."""
    roots = {Path(os.path.realpath(p)) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    roots |= set(import_path())
    held = Path(os.path.realpath(run_dir)) if run_dir is not None else None
    roots = {r for r in roots if r.is_dir() and not r.is_relative_to("/usr") and not (held and held.is_relative_to(r))}
    return sorted(r for r in roots if not any(r != o and r.is_relative_to(o) for o in roots))


def import_path() -> list[Path]:
    """The harness interpreter's import path (site folders, PYTHONPATH), without the harness's own source."""
    found = []
    for entry in sys.path:
        path = Path(os.path.realpath(entry)) if entry else None
        if path and path.is_dir() and not path.is_relative_to(HARNESS) and path not in found:
            found.append(path)
    return found


_compiled: set[Path] = set()
_compile_lock = threading.Lock()


def precompile(folders: list[Path]) -> float:
    """Write the bytecode the server would otherwise compile at every start: its tree and site folders are
    read-only inside, so without it each of its processes compiles every module it imports from source.
    Once per folder and harness; files whose bytecode is current are skipped. Returns the seconds spent."""
    began = time.monotonic()
    with _compile_lock:
        for folder in folders:
            if folder in _compiled or not folder.is_dir() or not os.access(folder, os.W_OK):
                continue
            compileall.compile_dir(str(folder), quiet=2, workers=0)
            _compiled.add(folder)
    return round(time.monotonic() - began, 2)


def etc_files(uid: int) -> dict[str, str]:
    return {
        "/etc/passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\nnightshift:x:{uid}:{uid}::{SCRATCH}:/usr/sbin/nologin\n"
                       "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n",
        "/etc/group": f"root:x:0:\nnightshift:x:{uid}:\nnogroup:x:65534:\n",
        "/etc/hosts": "127.0.0.1 localhost\n::1 localhost\n",
        "/etc/hostname": "sandbox\n", "/etc/resolv.conf": "", "/etc/nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    }


def host_layout(run_dir: Path | None = None) -> tuple[list[list], list[list]]:
    """Read-only binds [source, target, writable] and symlinks [path, target] of the system folders."""
    binds, links = [], []
    for name in SYSTEM:
        path = Path("/") / name
        if path.is_symlink():
            links.append([str(path), os.readlink(path)])
        elif path.is_dir():
            binds.append([str(path), str(path), False])
    for name in ETC:
        path = Path("/etc") / name
        if path.is_symlink():
            links.append([str(path), os.readlink(path)])
        elif path.exists():
            binds.append([str(path), str(path), False])
    binds += [[str(r), str(r), False] for r in python_roots(run_dir)]
    return binds, links


def gpu_devices(gpus: list[int]) -> list[str]:
    return sorted(p.name for p in Path("/dev").glob("nvidia*")) if gpus else []


def prlimits(c: SandboxConfig, gpus: list[int]) -> dict[str, int]:
    """Limits without a cgroup. No address-space cap on a GPU server: CUDA reserves address space for the
    device's memory and more, so any cap low enough to mean something stops the server from starting."""
    limits = {"NPROC": max(1, c.pids_limit - 1)}
    if not gpus:
        limits["AS"] = int(c.memory_gb * (1 << 30))
    return limits


def memory_cap(limits: str, gpus: list[int]) -> str:
    if limits != "prlimit":
        return f"cgroup {limits}"
    return "none (no writable cgroup, and CUDA rules out RLIMIT_AS)" if gpus else "RLIMIT_AS per process"


def classify(returncode: int | None, logs: str, oom_kills: int, limits: str) -> Outcome:
    if oom_kills > 0:
        return "oom"
    if limits == "prlimit" and (returncode in (-signal.SIGKILL, 137) or "MemoryError" in logs
                                or "Cannot allocate memory" in logs or "OutOfMemoryError" in logs):
        return "oom"
    return "crash"


class NamespaceServer(Reachable):
    scratch = SCRATCH
    """The capped tmpfs its processes see at this path (a post-mortem reports how full it was)."""

    def __init__(self, spec: ServerSpec, process: subprocess.Popen, folder: Path, log_path: Path,
                 cgroup: cgroups.Cgroup | None, watch: int, isolation: dict):
        self.name, self.spec, self.process, self.folder = spec.name, spec, process, folder
        self.io_dir, self.log_path, self.cgroup, self.watch = folder / "io", log_path, cgroup, watch
        self.isolation = isolation
        """How this server is contained: namespaces, user namespace, limits, uid (recorded, not assumed)."""
        self.socket = self.io_dir / SOCKET_NAME
        self.endpoint = Endpoint("http://sandbox", uds=str(self.socket))
        self._init_pid: int | None = None
        self._final: tuple[Outcome, str, list[str]] | None = None
        self._lock = threading.Lock()

    def imported_files(self) -> list[str]:
        return self._final[2] if self._final else read_imports(self.io_dir / IMPORT_LOG_NAME)

    def logs(self, limit: int = 20_000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, self.log_path.stat().st_size - limit))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def exit_code(self) -> int | None:
        return self.process.poll()

    def alive(self) -> bool:
        return self.exit_code() is None

    def init_pid(self) -> int | None:
        """The host pid of the namespace's pid 1 (the child of `unshare`)."""
        if self._init_pid is None:
            pid = self.process.pid
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                children = []
            self._init_pid = int(children[0]) if children else None
        return self._init_pid

    def hold(self, frozen: bool) -> None:
        """Every process of its pid namespace but pid 1: all are descendants of it (an orphan is reparented to it).
        Pid 1 is the harness's own supervisor (sandbox/ns_init.py), not the candidate's code: left running, it still
        sees the harness's pipe close and takes the namespace down with it, a held server too."""
        pid = self.init_pid()
        if pid and self.alive():
            hold_processes(lambda: process_tree(pid) - {pid}, frozen)

    def root(self) -> Path | None:
        """The server's root file system, seen from the host (for exporting its caches)."""
        pid = self.init_pid()
        return Path(f"/proc/{pid}/root") if pid and self.alive() else None

    def mounts(self) -> list[tuple[str, str]]:
        """(mount point, options) inside the sandbox, from its pid 1's mountinfo."""
        pid = self.init_pid()
        try:
            lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        except OSError:
            return []
        return [(line.split()[4], line.split()[5]) for line in lines]

    def _oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup else 0

    def _outcome(self) -> Outcome:
        if self.alive():
            return "oom" if self._oom_kills() else "ok"
        return classify(self.process.returncode, self.logs(), self._oom_kills(), self.isolation["limits"])

    def stop(self) -> Outcome:
        """SIGTERM to every process of the sandbox (through its pid 1), SIGKILL after a grace period."""
        with self._lock:
            if self._final:
                return self._final[0]
            outcome = self._outcome()
            pid = self.init_pid()
            if pid and self.alive():
                self.hold(False)  # a held server would sit out the grace period with its SIGTERM pending
                try:
                    os.kill(pid, signal.SIGTERM)
                    self.process.wait(STOP_GRACE_S)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            if outcome == "ok" and self._oom_kills():
                outcome = "oom"
            self._finish(outcome)
            return outcome

    def kill(self, outcome: Outcome | None = None) -> Outcome:
        with self._lock:
            if self._final:
                return self._final[0]
            outcome = outcome or self._outcome()
            self._finish(outcome)
            return outcome

    def _finish(self, outcome: Outcome) -> None:
        try:
            self.process.kill()  # unshare --kill-child: its child, the sandbox's pid 1, dies with it
        except ProcessLookupError:
            pass
        self.process.wait()
        try:
            os.close(self.watch)
        except OSError:
            pass
        imports = self.imported_files()
        if self.cgroup:
            self.cgroup.remove()
        shutil.rmtree(self.folder, ignore_errors=True)
        self._final = (outcome, self.logs(limit=1_000_000), imports)


class NamespaceSandbox:
    @classmethod
    def probe(cls, config: SandboxConfig | None = None) -> None:
        """Raises NamespaceUnavailable where unshare cannot make the namespaces."""
        probe()

    def __init__(self, config: SandboxConfig | None = None, run_dir: Path | None = None,
                 limits: cgroups.Limits | None = None):
        self.config = config or SandboxConfig(backend="namespace")
        self.run_dir = Path(run_dir or Path.cwd()).resolve()
        self.root = self.run_dir / "servers"
        self.owner = process_identity(os.getpid())
        self.limits = limits
        self._reaped = False
        self._lock = threading.Lock()

    def start(self, spec: ServerSpec, cancel: threading.Event | None = None) -> NamespaceServer:
        userns, how = probe()
        with self._lock:
            if not self._reaped:
                self.reap()
            limits = self.limits or cgroups.detect()
            uid = 0 if userns else self._free_uid()
            folder = Path(tempfile.mkdtemp(prefix=f"{slug(spec.name, 24)}-", dir=_io_root()))
            (folder / "state.json").write_text(json.dumps(self._state(spec, uid, [])))  # claims the uid
        try:
            return self._start(spec, folder, uid, userns, how, limits, cancel)
        except BaseException:
            if folder.exists() and not (folder / "started").exists():
                shutil.rmtree(folder, ignore_errors=True)
            raise

    def _start(self, spec: ServerSpec, folder: Path, uid: int, userns: bool, how: str, limits: str,
               cancel: threading.Event | None = None) -> NamespaceServer:
        c = self.config
        tree, model = Path(spec.source_tree).resolve(), Path(spec.model_dir).resolve()
        seed = Path(spec.cache_seed).resolve() if spec.cache_seed else None
        io_dir = folder / "io"
        io_dir.mkdir(mode=0o700)
        (folder / "root").mkdir()
        try:
            check_not_exposed([tree, model, RECORDER.resolve(), io_dir, *python_roots(self.run_dir)], [self.run_dir])
        except ValueError as exc:
            raise SandboxError("crash", str(exc)) from None
        if not userns:
            os.chown(io_dir, uid, uid)
            for root in (tree, model):
                if changed := open_for_reading(root):
                    log.info("made %d paths under %s readable for the sandbox user", changed, root)
        site = [Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        compiled_s = precompile([tree / "vllm", *(p for p in site if not p.is_relative_to(HARNESS))])
        gpus = list(spec.gpus or c.gpus)
        memory = int(c.memory_gb * (1 << 30))
        group = None
        if limits != "prlimit":
            try:
                group = cgroups.Cgroup.create(limits, folder.name, memory, c.pids_limit, c.cpus)
            except OSError as exc:
                raise NamespaceUnavailable(f"cannot create a {limits} cgroup for {spec.name}: {exc}") from None
        state = self._state(spec, uid, [str(d) for d in group.dirs] if group else [])
        (folder / "state.json").write_text(json.dumps(state))
        home = self.root / spec.name
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        log_path = home / "server.log"
        read_end, write_end = os.pipe()
        plan = self.plan(spec, folder, uid, userns, limits, gpus, seed, read_end)
        argv = ["sh", "-c", JOIN, "sh", *(group.procs_files if group else []), "--", "unshare", *UNSHARE,
                *(["--user", "--map-root-user"] if userns else []), sys.executable, "-I", "-S", str(INIT)]
        isolation = {"namespaces": ["mount", "pid", "net", "ipc", "uts", "cgroup"] + (["user"] if userns else []),
                     "userns": userns, "identity": how, "limits": limits, "uid": uid, "gpus": gpus,
                     "memory_cap": memory_cap(limits, gpus), "precompiled_s": compiled_s}
        with open(log_path, "wb") as out:
            try:
                process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                           pass_fds=(read_end,), start_new_session=True, cwd="/",
                                           preexec_fn=priority.in_child(spec.nice),
                                           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
            finally:
                os.close(read_end)
        (folder / "started").write_text(str(process.pid))
        state.update(pid=process.pid, start=start_time(process.pid))
        (folder / "state.json").write_text(json.dumps(state))
        server = NamespaceServer(spec, process, folder, log_path, group, write_end, isolation)
        try:
            process.stdin.write(json.dumps(plan).encode())
            process.stdin.close()
        except BrokenPipeError:
            pass
        log.info("%s: %s", spec.name, isolation)
        wait_healthy(server, spec.startup_timeout_s, cancel)
        return server

    def _state(self, spec: ServerSpec, uid: int, cgroup_dirs: list[str]) -> dict:
        return {"owner": self.owner, "run": str(self.run_dir), "server": spec.name, "uid": uid, "cgroups": cgroup_dirs}

    def plan(self, spec: ServerSpec, folder: Path, uid: int, userns: bool, limits: str, gpus: list[int],
             seed: Path | None, watch_fd: int) -> dict:
        c = self.config
        binds, links = host_layout(self.run_dir)
        binds += [[str(Path(spec.source_tree).resolve()), TREE, False], [str(Path(spec.model_dir).resolve()), MODEL, False],
                  [str(RECORDER.resolve()), RECORDER_AT, False], [str(folder / "io"), IO, True]]
        rlimits = prlimits(c, gpus) if limits == "prlimit" else {}
        inside = spec.model_copy(update={"model_dir": Path(MODEL)})
        argv = [os.path.realpath(sys.executable), "-m", "vllm.entrypoints.cli.main", *serve_argv(inside),
                "--uds", f"{IO}/{SOCKET_NAME}"]
        return {"root": str(folder / "root"), "binds": binds, "symlinks": links, "files": etc_files(uid),
                "empty_dirs": ["/var", "/root", "/sandbox"], "scratch": SCRATCH, "tmpfs_mb": c.tmpfs_mb,
                "seed": str(seed) if seed else None, "cache_dirs": list(CACHE_DIRS), "uid": uid, "gid": uid,
                "userns": userns, "rlimits": rlimits, "devices": gpu_devices(gpus), "hostname": "sandbox",
                "argv": argv, "env": sandbox_env(spec, gpus), "cwd": SCRATCH, "watch_fd": watch_fd}

    def export_cache(self, server: NamespaceServer, dest: Path) -> None:
        """Copy a (trusted) server's compile caches from its tmpfs (through /proc/<pid>/root) into `dest`."""
        root = server.root()
        if root is not None:
            copy_caches(root / SCRATCH.lstrip("/"), Path(dest))

    def _free_uid(self) -> int:
        used = {json.loads(p.read_text()).get("uid") for p in _io_root().glob("*/state.json") if p.exists()}
        while (uid := random.randrange(*UID_RANGE)) in used:
            pass
        return uid

    def reap(self) -> int:
        """Remove the sandboxes (processes, cgroups, socket folders) of harness processes that are gone; returns how
        many servers were still running and were killed (a sandbox whose server died with its harness, as the pipe its
        pid 1 watches makes it, leaves only folders: removed, not counted; whichever harness looks first removes them,
        so the count would otherwise depend on who looked first)."""
        self._reaped = True
        reaped = 0
        for state_file in _io_root().glob("*/state.json"):
            try:
                state = json.loads(state_file.read_text())
            except (OSError, ValueError):
                continue
            if owner_alive(state.get("owner", "")):
                continue
            pid, killed = state.get("pid"), False
            if pid and start_time(pid) == state.get("start"):
                try:
                    os.killpg(pid, signal.SIGKILL)
                    killed = True
                except (ProcessLookupError, PermissionError):
                    pass
            cgroups.remove_dirs([Path(d) for d in state.get("cgroups", [])])
            shutil.rmtree(state_file.parent, ignore_errors=True)
            log.info("%s %s of run %s (owner %s gone)", "reaped" if killed else "removed the folders of",
                     state.get("server"), state.get("run"), state.get("owner"))
            reaped += killed
        return reaped


def _io_root() -> Path:
    IO_ROOT.mkdir(mode=0o711, parents=True, exist_ok=True)
    return IO_ROOT


def sandbox_env(spec: ServerSpec, gpus: list[int]) -> dict[str, str]:
    inherited = [str(p) for p in import_path() if not p.is_relative_to("/usr")]
    fixed = {
        "PATH": os.pathsep.join([str(Path(os.path.realpath(sys.executable)).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        **runtime_env(SCRATCH, TREE, RECORDER_AT, f"{IO}/{IMPORT_LOG_NAME}", inherited, user="nightshift"),
    }
    if gpus:
        fixed["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    passed = tuple(name for name in PASSED_ENV if name != "PATH")
    return build_env(os.environ, passed, PASSED_PREFIXES, fixed, spec)
