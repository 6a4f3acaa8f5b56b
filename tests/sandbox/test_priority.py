"""sandbox/priority.py: servers started at the task's niceness, and the client raised to theirs while it times them,
then let back down; where lowering is refused (not root), everything stays as it was."""
import os
import subprocess
import sys
import threading

import pytest

from agent.stages.bench import client_nice
from sandbox import priority

ROOT = os.geteuid() == 0


class Started:
    """A server as bench.client_nice sees one: its first process."""

    def __init__(self, process):
        self.process = process


def start(nice):
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=priority.in_child(nice))


def test_a_server_starts_at_the_asked_niceness_and_the_client_is_raised_to_it_while_it_measures():
    own = priority.thread_nice()
    child = start(own - 5)
    try:
        got = priority.of(child.pid)
        assert got == (own - 5 if ROOT else own)  # refused without root: the harness's own, and the start goes on
        assert client_nice(Started(child)) == got
        with priority.raised(got) as ran_at:
            assert ran_at == priority.thread_nice() == got
        assert priority.thread_nice() == own  # let back down
    finally:
        child.kill()
        child.wait()


def test_the_raise_is_the_calling_threads_only_and_never_lowers_its_priority():
    own = priority.thread_nice()
    seen = {}
    with priority.raised(own - 3):
        worker = threading.Thread(target=lambda: seen.update(other=priority.thread_nice()))
        worker.start()
        worker.join()
        inside = priority.thread_nice()
    assert inside == (own - 3 if ROOT else own)
    assert seen["other"] == inside  # a thread made inside the raise takes it (as the client's processes do)
    with priority.raised(own + 5) as ran_at:  # higher than its own: left alone, not lowered in priority
        assert ran_at == priority.thread_nice() == own
    with priority.raised(None) as ran_at:
        assert ran_at == own
    assert priority.thread_nice() == own


def test_a_server_the_harness_cannot_see_leaves_the_client_as_it_is():
    class Unseen:
        pass
    assert client_nice(Unseen()) is None
    assert priority.of(None) is None and priority.of(2 ** 22 + 12345) is None
    child = start(None)
    try:
        assert client_nice(Started(child), Unseen()) is None  # one side unseen: not raised for the other alone
        assert priority.of(child.pid) == priority.thread_nice()
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not ROOT, reason="a refusal is what an unprivileged user sees anyway")
def test_a_refused_raise_leaves_the_thread_as_it_was():
    """As a user who may not lower a niceness (a child that drops to nobody): the block runs at its own."""
    code = ("import os; os.setgid(65534); os.setuid(65534); from sandbox import priority;"
            "own = priority.thread_nice();"
            "ctx = priority.raised(own - 5); ran = ctx.__enter__(); ctx.__exit__(None, None, None);"
            "print(own, ran, priority.thread_nice())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    own, ran, after = map(int, out.stdout.split())
    assert own == ran == after
