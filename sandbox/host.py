"""Facts about harness processes and host files that more than one backend needs."""
from __future__ import annotations

import socket
import stat
from pathlib import Path


def process_identity(pid: int) -> str:
    """host:pid:start-time, which a reused pid does not share."""
    return f"{socket.gethostname()}:{pid}:{start_time(pid)}"


def start_time(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def owner_alive(owner: str) -> bool:
    """Whether the harness process that started a server still runs (other hosts: assume so)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    return pid.isdigit() and Path(f"/proc/{pid}").exists() and start_time(int(pid)) == start


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
