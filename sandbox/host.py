"""Facts about harness processes and host files that more than one backend needs."""
from __future__ import annotations

import os
import signal
import socket
import stat
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name: [0] the state, [1] the parent, [2] the group, [11:15] the CPU
    times, [19] the start time. Raises OSError for a process that is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_tree(pid: int | None) -> set[int]:
    """pid and its descendants, from /proc (empty where pid is None or /proc is absent)."""
    if pid is None:
        return set()
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            children.setdefault(int(stat_fields(int(entry.name))[1]), []).append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += children.get(p, [])
    return tree


HOLD_ROUNDS = 3
"""Passes over a server's processes when it is held: a process forked while one pass signals is found by the next."""


def hold_processes(find, frozen: bool) -> int:
    """SIGSTOP (frozen) or SIGCONT every process that `find()` returns, over HOLD_ROUNDS passes; returns how many
    processes were signalled. A process that is gone, or that this user may not signal, is skipped."""
    sig, done = (signal.SIGSTOP if frozen else signal.SIGCONT), set()
    for _ in range(HOLD_ROUNDS):
        todo = set(find()) - done
        if not todo:
            break
        for pid in todo:
            try:
                os.kill(pid, sig)
                done.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
    return len(done)


def _status(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Name", "State", "Threads", "VmRSS"):
            fields[key.lower()] = value.strip()
    try:
        fields["wchan"] = Path(f"/proc/{pid}/wchan").read_text().strip() or "0"
    except OSError:
        pass
    return fields


def snapshot(pid: int | None, scratch: str | None = None) -> dict:
    """What a server's processes are doing, from /proc, for the record of one that stopped answering: each
    process's state, threads, resident memory and where it waits; with `scratch`, how full that folder is
    as the server's processes see it (through /proc/<pid>/root)."""
    processes = []
    for p in sorted(process_tree(pid)):
        try:
            processes.append({"pid": p, **_status(p)})
        except OSError:
            continue
    out: dict = {"processes": processes, "threads": sum(int(x.get("threads", 0)) for x in processes)}
    if scratch and pid is not None:
        for p in [x["pid"] for x in processes][::-1]:
            try:
                fs = os.statvfs(f"/proc/{p}/root{scratch}")
            except OSError:
                continue
            out["scratch"] = {"path": scratch, "used_mb": round((fs.f_blocks - fs.f_bfree) * fs.f_frsize / 2**20, 1),
                              "size_mb": round(fs.f_blocks * fs.f_frsize / 2**20, 1)}
            break
    return out


def server_pid(server) -> int | None:
    """The root of a server's processes where the harness sees them: a local or namespace server's process, a
    container's init (`host_pid`); None where the harness cannot see them."""
    process = getattr(server, "process", None)
    if process is not None:
        return process.pid
    host_pid = getattr(server, "host_pid", None)
    return host_pid() if callable(host_pid) else None


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _tree_sum(pid: int, fields: tuple[int, ...]) -> int:
    """The sum of the given `stat_fields` over pid's process tree (a process gone meanwhile counts nothing)."""
    total = 0
    for p in process_tree(pid):
        try:
            values = stat_fields(p)
            total += sum(int(values[i]) for i in fields)
        except (OSError, IndexError, ValueError):
            continue
    return total


def cpu_seconds(pid: int | None) -> float | None:
    """User and system CPU time used so far by pid's process tree, the children it reaped included (so a
    process that ends within the tree keeps counting); None where pid is None."""
    return None if pid is None else _tree_sum(pid, (11, 12, 13, 14)) / CLOCK_TICKS  # utime, stime, cutime, cstime


def major_faults(pid: int | None) -> int | None:
    """Major page faults (reads from disk) of pid's process tree so far, reaped children included."""
    return None if pid is None else _tree_sum(pid, (9, 10))  # majflt, cmajflt


def cpu_pressure_s() -> float | None:
    """Seconds so far in which some runnable task of the machine waited for a CPU (/proc/pressure/cpu, "some");
    None where the kernel has no pressure accounting."""
    try:
        line = Path("/proc/pressure/cpu").read_text().split("\n", 1)[0]
        return int(line.rsplit("total=", 1)[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


def machine_cpu() -> tuple[float, float] | None:
    """(CPU seconds every process of the machine used, CPU seconds stolen by the hypervisor) so far, all cores
    together (/proc/stat); None where /proc/stat is absent."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


def server_snapshot(server) -> dict:
    """`snapshot` of a server's process tree."""
    return snapshot(server_pid(server), getattr(server, "scratch", None))


def describe_snapshot(snap: dict) -> str:
    states: dict[str, int] = {}
    for p in snap.get("processes", []):
        key = f"{p.get('state', '?').split()[0]}:{p.get('wchan', '?')}"
        states[key] = states.get(key, 0) + 1
    count = len(snap.get("processes", []))
    text = f"{count} process{'es' if count != 1 else ''}, {snap.get('threads', 0)} threads"
    if states:
        common = sorted(states.items(), key=lambda kv: -kv[1])[:4]
        text += " (state:wait " + ", ".join(f"{k} x{n}" for k, n in common) + ")"
    if "scratch" in snap:
        text += f", scratch {snap['scratch']['used_mb']:.0f} of {snap['scratch']['size_mb']:.0f} MB used"
    return text


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def process_identity(pid: int) -> str:
    """`host:boot id:pid:start time` of a running process, which neither a reused pid nor a reboot shares;
    "" where /proc cannot tell, or the process is dead (a zombie)."""
    start, boot = start_time(pid), boot_id()
    return "" if start == "?" or not boot else f"{socket.gethostname()}:{boot}:{pid}:{start}"


def same_boot(identity: str) -> bool:
    """Whether IDENTITY was taken on this host since its last boot."""
    parts = identity.split(":")
    return len(parts) == 4 and parts[0] == socket.gethostname() and parts[1] == boot_id() != ""


def start_time(pid: int) -> str:
    """The start time of a running process; "?" for one that is gone, or dead and not yet waited for."""
    try:
        fields = stat_fields(pid)
    except OSError:
        return "?"
    return "?" if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def running(pid: int) -> bool:
    """Whether PID runs (a zombie does not: it is dead, waiting for its parent)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return start_time(pid) != "?"


def owner_alive(owner: str) -> bool:
    """Whether the harness process that started a server still runs (other hosts: assume so)."""
    parts = owner.split(":")
    if len(parts) != 4 or not parts[2].isdigit():
        return False
    return parts[0] != socket.gethostname() or process_identity(int(parts[2])) == owner


SERVER_HOME_ENV, OWNER_ENV = "NIGHTSHIFT_SERVER_HOME", "NIGHTSHIFT_OWNER"
"""Every local server process carries its home and its harness's identity in its environment, so that the
processes of a dead harness are found even where it died before recording them."""


def server_marks(home: Path) -> dict[str, str]:
    return {SERVER_HOME_ENV: str(Path(home).resolve()), OWNER_ENV: process_identity(os.getpid())}


def marked_processes(under: Path, with_home: bool = False) -> list[tuple]:
    """(pid, owner) of every process on this host whose environment names a server home under `under`;
    `with_home`: (pid, owner, that home)."""
    root, found = str(Path(under).resolve()).rstrip("/") + "/", []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            text = environ.read_bytes().decode(errors="replace")
        except OSError:
            continue
        entries = dict(entry.split("=", 1) for entry in text.split("\0") if "=" in entry)
        home = entries.get(SERVER_HOME_ENV, "")
        if home.startswith(root):
            found.append((int(environ.parent.name), entries.get(OWNER_ENV, ""), *([home] * with_home)))
    return found


def open_for_reading(root: Path) -> int:
    """Make `root`'s files readable (and folders traversable) by others, for the sandbox's
    user; returns how many had to change. Weights and sources are not private; secrets are
    never mounted in the first place."""
    changed = 0
    for path in [root, *root.rglob("*")]:
        try:
            mode = path.lstat().st_mode
        except OSError:
            continue
        if stat.S_ISLNK(mode):
            continue
        wanted = mode | stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        if wanted != mode:
            path.chmod(stat.S_IMODE(wanted))
            changed += 1
    return changed
