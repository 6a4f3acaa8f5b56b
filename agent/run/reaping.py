"""The leftovers of a dead parallel run on this host: its workers' processes, then their servers."""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

from sandbox.host import process_identity
from sandbox.local import reap_servers


def reap_workers(run_dir: Path, wait_s: float = 10) -> int:
    """The workers of a dead coordinator still running on this host (Ray would kill them soon) are killed, then
    the servers of every worker of the run; returns how many servers were killed."""
    for path in (Path(run_dir) / "workers").glob("w*/status.json"):
        try:
            row = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        pid, identity = int(row.get("pid") or 0), row.get("identity") or ""
        if pid <= 0 or row.get("host") != socket.gethostname() or not identity or process_identity(pid) != identity:
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        deadline = time.time() + wait_s
        while process_identity(pid) == identity and time.time() < deadline:
            time.sleep(0.05)
    return reap_servers(Path(run_dir) / "workers")
