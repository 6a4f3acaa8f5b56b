"""Per-server resource limits for the namespace backend: a cgroup nested under the harness's own
(cgroup v2, or v1's memory/pids/cpu hierarchies), or rlimits where no cgroup is writable."""
from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Literal

Limits = Literal["cgroup2", "cgroup1", "prlimit"]
ROOT = Path(os.environ.get("NIGHTSHIFT_CGROUP_ROOT", "/sys/fs/cgroup"))
V1 = ("memory", "pids", "cpu")


def own_path(controller: str) -> str | None:
    """The harness's cgroup in a v1 hierarchy (`controller`), or in v2 (controller "")."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if (controller == "" and number == "0") or (controller and controller in controllers.split(",")):
            return path
    return None


def _writable(parent: Path) -> bool:
    probe = parent / f"nightshift-probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        probe.rmdir()
        return True
    except OSError:
        return False


def v2_parent() -> Path | None:
    """The harness's own v2 cgroup, if it can hold children with memory and pids limits."""
    path = own_path("")
    if path is None or not (ROOT / "cgroup.controllers").exists():
        return None
    parent = ROOT / path.lstrip("/")
    try:
        available = set((parent / "cgroup.controllers").read_text().split())
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        if not {"memory", "pids"} <= available:
            return None
        missing = ({"memory", "pids", "cpu"} & available) - enabled
        if missing:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(missing)))
    except OSError:
        return None  # e.g. EBUSY: the harness's cgroup holds processes, so it cannot delegate
    return parent if _writable(parent) else None


def v1_parents() -> dict[str, Path] | None:
    parents = {}
    for controller in V1:
        path = own_path(controller)
        parent = ROOT / controller / (path or "/").lstrip("/")
        if path is not None and (parent / "cgroup.procs").exists() and _writable(parent):
            parents[controller] = parent
    return parents if {"memory", "pids"} <= parents.keys() else None


def detect() -> Limits:
    if v2_parent() is not None:
        return "cgroup2"
    if v1_parents() is not None:
        return "cgroup1"
    return "prlimit"


class Cgroup:
    """One server's cgroup (one folder in v2; one per hierarchy in v1)."""

    def __init__(self, mode: Limits, dirs: list[Path]):
        self.mode, self.dirs = mode, dirs

    @classmethod
    def create(cls, mode: Limits, name: str, memory_bytes: int, pids: int, cpus: float | None) -> Cgroup:
        group = cls(mode, [])
        try:
            group._make(name, memory_bytes, pids, cpus)
        except OSError:
            group.remove(timeout_s=1)
            raise
        return group

    def _make(self, name: str, memory_bytes: int, pids: int, cpus: float | None) -> None:
        parents = {"": v2_parent()} if self.mode == "cgroup2" else v1_parents()
        if not parents or None in parents.values():
            raise OSError(f"no writable {self.mode} hierarchy for the harness's cgroup")
        if self.mode == "cgroup1" and not cpus:
            # A v1 `cpu` group of its own would make the whole server one scheduling entity, weighed as one thread
            # of the harness's group: beside busy processes it would get a smaller share of the cores than the
            # same server run locally. Without a CPU cap it stays in the harness's group, scheduled as a local
            # server is (benchmarks/results/cpu-noise-backends.md).
            parents = {controller: path for controller, path in parents.items() if controller != "cpu"}
        folder = {}
        for controller, parent in parents.items():
            (parent / name).mkdir()
            folder[controller] = parent / name
            self.dirs.append(parent / name)
        if self.mode == "cgroup2":
            _write(folder[""] / "memory.max", memory_bytes)
            _write(folder[""] / "memory.swap.max", 0, optional=True)
            _write(folder[""] / "pids.max", pids)
            if cpus:
                _write(folder[""] / "cpu.max", f"{int(cpus * 100_000)} 100000", optional=True)
            return
        _write(folder["memory"] / "memory.limit_in_bytes", memory_bytes)
        _write(folder["memory"] / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
        _write(folder["pids"] / "pids.max", pids)
        if cpus and "cpu" in folder:
            _write(folder["cpu"] / "cpu.cfs_period_us", 100_000)
            _write(folder["cpu"] / "cpu.cfs_quota_us", int(cpus * 100_000))

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        for folder in self.dirs:
            for name in ("memory.events", "memory.oom_control"):
                try:
                    for line in (folder / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
                except OSError:
                    continue
        return 0

    def remove(self, timeout_s: float = 10) -> None:
        remove_dirs(self.dirs, timeout_s)


def _write(path: Path, value, optional: bool = False) -> None:
    try:
        path.write_text(str(value))
    except OSError:
        if not optional:
            raise


def pids_in(folder: Path) -> list[int]:
    try:
        return [int(p) for p in (folder / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove_dirs(dirs: list[Path], timeout_s: float = 10) -> int:
    """Kill whatever still runs in these cgroups and remove them; returns how many were removed."""
    removed = 0
    deadline = time.monotonic() + timeout_s
    for folder in dirs:
        while folder.exists():
            for pid in pids_in(folder):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                folder.rmdir()
                removed += 1
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    return removed
