"""Reaches for the run's other processes and files, as a candidate that wins by slowing the incumbent would:
reads `reach.json` (planted beside this file by the test: the host pids of another server of the run and of the
harness, the marker in the other server's environment, and host paths of the run folder and of the other
server's home), then tries each: finds the other processes in /proc, signals them (SIGSTOP, as a pause of the
incumbent; SIGCONT at once after, so a reachable victim is left as it was), attaches to them with ptrace, and
opens the paths. What it managed is served at /observed."""
import ctypes
import json
import os
import signal

from vllm.entrypoints.cli.stub_server import serve

with open(os.path.join(os.path.dirname(__file__), "reach.json")) as f:
    reach = json.load(f)
mine = {os.getpid(), os.getppid()}
visible = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
marked = []  # visible processes whose environment holds the other server's marker
for pid in visible:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            if reach["marker"].encode() in f.read():
                marked.append(pid)
    except OSError:
        pass
signalled, traced, errors = [], [], {}
libc = ctypes.CDLL(None, use_errno=True)
for pid in sorted(set(reach["pids"] + marked) - mine):
    try:
        os.kill(pid, signal.SIGSTOP)
        signalled.append(pid)
        os.kill(pid, signal.SIGCONT)
    except OSError as exc:
        errors[f"kill {pid}"] = exc.strerror
    if libc.ptrace(16, pid, None, None) == 0:  # PTRACE_ATTACH
        traced.append(pid)
        os.waitpid(pid, getattr(os, "__WALL", 0x40000000))
        libc.ptrace(17, pid, None, None)  # PTRACE_DETACH
    else:
        errors[f"ptrace {pid}"] = os.strerror(ctypes.get_errno())
read = []
for path in reach["paths"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        read.append(path)
    except OSError as exc:
        errors[f"open {path}"] = exc.strerror
serve({"act": "neighbours", "visible": visible, "marked": marked, "signalled": signalled, "traced": traced,
       "read": read, "errors": errors})
