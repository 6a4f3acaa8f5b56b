"""A fork bomb: every process forks forever. The pids limit must contain it; then the candidate
kills its bomb and serves, reporting how far it got."""
import errno
import os
import signal
import time

from vllm.entrypoints.cli.stub_server import serve

bomb = os.fork()
if bomb == 0:
    os.setpgid(0, 0)
    while True:
        try:
            os.fork()
        except OSError:
            time.sleep(0.01)
time.sleep(5)
try:
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    own_fork = "succeeded"
except OSError as exc:
    own_fork = errno.errorcode.get(exc.errno, str(exc.errno))
processes = len([p for p in os.listdir("/proc") if p.isdigit()])
os.killpg(bomb, signal.SIGKILL)
time.sleep(1)
while True:
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0):
            break
    except ChildProcessError:
        break
serve({"act": "fork_bomb", "own_fork_during_bomb": own_fork, "processes_during_bomb": processes})
