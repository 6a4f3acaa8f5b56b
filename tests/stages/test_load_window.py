"""The steady-state window of a pass: throughput while the load client holds its concurrency, against a fake
server in a real process whose pace is known."""
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agent.stages.load import LoadClient, steady_window
from agent.stages.completions import Completion
from sandbox.base import Endpoint
from sandbox.local import free_port

SERVER = Path(__file__).parents[1] / "fake_ramp_server.py"
DELAY_S, LANES, TOKENS = 0.02, 4, 10


pytestmark = pytest.mark.serial  # serial: a pass's steady-state throughput against the known one


@pytest.fixture(scope="module")
def endpoint():
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), str(port), str(DELAY_S)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield Endpoint(url)
    process.kill()
    process.wait()


def completion(sent, first, done, tokens):
    step = (done - first) / max(1, tokens - 1)
    return Completion(tokens=[5] * tokens, sent=sent, first_token=first, done=done,
                      chunks=[(first + i * step, 1) for i in range(tokens)])


def test_the_window_runs_from_full_concurrency_to_the_first_completion_of_the_drain():
    # Two lanes: requests 0 and 1 start at 0 and 0.1; 2 follows 0 at 1.0; the drain starts when 1 ends at 1.5.
    done = [completion(0.0, 0.2, 1.0, 9), completion(0.1, 0.3, 1.5, 13), completion(1.0, 1.1, 3.0, 20)]
    window = steady_window(done, [7, 7, 7], lanes=2)
    assert (window.start, window.end) == (0.1, 1.5)
    assert window.input_tokens == 3 * 7  # all three first tokens arrived inside it
    inside = sum(1 for c in done for at, _ in c.chunks if 0.1 <= at <= 1.5)
    assert window.output_tokens == inside
    assert steady_window(done, [7, 7, 7], lanes=4) is None  # never four in flight


@pytest.mark.parametrize("processes", [1, 2])
def test_a_slow_last_request_drags_the_whole_pass_but_not_the_steady_window(endpoint, processes):
    prompts = [[0, 1]] * 23 + [[9, 1]]  # 23 fast requests, then one ten times slower, sent last
    with LoadClient(processes) as load:
        started = time.perf_counter()
        result = asyncio.run(load.run(endpoint, prompts, TOKENS, LANES, 30))
        seconds = time.perf_counter() - started
    window = steady_window(result.completions, [len(p) for p in prompts], LANES)
    steady = window.output_tokens / window.seconds
    whole = 24 * TOKENS / seconds
    known = LANES / DELAY_S  # 200 tokens/s while four fast requests are in flight
    assert 0.75 * known < steady < 1.05 * known
    assert whole < 0.6 * steady and seconds > window.seconds + 1.5  # the 2 s slow request is the drain


def test_passes_are_sized_by_waves_or_duration():
    from agent.stages.bench import pass_size, sample_metric
    from agent.world.task import load_task, with_overrides

    task = load_task(Path(__file__).resolve().parents[2] / "tasks" / "gemma4-e2b.yaml")
    assert pass_size(task) == task.workload.num_prompts and sample_metric(task) == "steady_total_tokens_per_s"
    assert pass_size(with_overrides(task, workload={"waves": 2})) == 2 * 256
    timed = with_overrides(task, workload={"duration_s": 20.0})
    assert pass_size(timed, wave_seconds=4.4) == 5 * 256 and pass_size(timed, wave_seconds=60) == 256
    assert sample_metric(with_overrides(task, benchmark={"window": "whole_pass"})) == "total_tokens_per_s"
