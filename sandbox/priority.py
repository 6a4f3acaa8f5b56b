"""The CPU priority of what a benchmark measures: both servers' processes and the client that times them.

Beside other work on the machine (a test suite, another job), the two sides of a benchmark share the cores with
it, and the pass-to-pass spread grows with what the neighbour happens to do. Started at a lower niceness
(`sandbox.nice`, off by default), every process of a server, and the harness's client thread while it measures
(`raised`), weighs about 9 times a process at nice 0 in the kernel's fair scheduler (its weights go by 1.25 a
step): the neighbour keeps what they leave. Among the measured processes nothing changes, since all are raised
alike. Measured beside the test suite at -10, the per-pair SD was no lower (0.158 against 0.171) and the suite's
own tests starved, so it is off unless a task sets it (benchmarks/results/cpu-judge.md, "Beside the test suite, at
nice -10").

Going below nice 0 needs root or CAP_SYS_NICE. Where that is refused, the servers run at the harness's own
niceness, the client is not raised, and each sample records the niceness its client and server had
(`client_nice`, `server_nice`).
A Docker container's processes are not the harness's children and sit in the container's own cgroup, where a
niceness weighs only against the container's other processes: that backend does not set one (its servers report
None and the client stays as it is).
"""
from __future__ import annotations

import contextlib
import os
import threading

from sandbox.host import stat_fields


def of(pid: int | None) -> int | None:
    """The niceness of process `pid` (its main thread), from /proc; None where it is gone or unknown."""
    if pid is None:
        return None
    try:
        return int(stat_fields(pid)[16])
    except (OSError, IndexError, ValueError):
        return None


def in_child(nice: int | None):
    """A `preexec_fn` for subprocess.Popen: the child (and what it starts) runs at `nice` where this user may set
    it, and at the parent's niceness where not (a refusal does not stop the start). None: no change."""
    if nice is None:
        return None

    def set_nice() -> None:  # runs in the forked child before exec: one system call, no lock taken
        try:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError:
            pass
    return set_nice


def thread_nice() -> int:
    """The calling thread's niceness (Linux keeps one per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@contextlib.contextmanager
def raised(nice: int | None):
    """The calling thread at `nice` for the block, where it is lower than the thread's own and this user may set
    it; its own niceness again after. Yields the niceness the thread ran the block at."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    if nice is None or nice >= before:
        yield before
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        yield before
        return
    try:
        yield nice
    finally:
        os.setpriority(os.PRIO_PROCESS, tid, before)  # back up: allowed to anyone
