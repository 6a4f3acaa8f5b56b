"""Facts about harness processes and host files that more than one backend needs."""
from __future__ import annotations

import os
import socket
import stat
from pathlib import Path


def process_identity(pid: int) -> str:
    """host:pid:start-time, which a reused pid does not share."""
    return f"{socket.gethostname()}:{pid}:{start_time(pid)}"


def start_time(pid: int) -> str:
    """The start time of a running process; "?" for one that is gone, or dead and not yet waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
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
    try:
        host, pid, start = owner.rsplit(":", 2)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    return pid.isdigit() and start != "?" and start_time(int(pid)) == start


SERVER_HOME_ENV, OWNER_ENV = "NIGHTSHIFT_SERVER_HOME", "NIGHTSHIFT_OWNER"
"""Every local server process carries its home and its harness's identity in its environment, so that the
processes of a dead harness are found even where it died before recording them."""


def server_marks(home: Path) -> dict[str, str]:
    return {SERVER_HOME_ENV: str(Path(home).resolve()), OWNER_ENV: process_identity(os.getpid())}


def marked_processes(under: Path) -> list[tuple[int, str]]:
    """(pid, owner) of every process on this host whose environment names a server home under `under`."""
    root, found = str(Path(under).resolve()).rstrip("/") + "/", []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            text = environ.read_bytes().decode(errors="replace")
        except OSError:
            continue
        entries = dict(entry.split("=", 1) for entry in text.split("\0") if "=" in entry)
        home = entries.get(SERVER_HOME_ENV, "")
        if home.startswith(root):
            found.append((int(environ.parent.name), entries.get(OWNER_ENV, "")))
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
