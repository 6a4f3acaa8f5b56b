"""The benchmark's load generator: the workload's lanes, spread over client processes, so that a
measurement never measures the harness's own CPU. It reports how busy its busiest process was."""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from agent.stages.completions import Completion, RequestError, complete_all
from sandbox.base import Endpoint


@dataclass
class Load:
    completions: list[Completion]
    cpu_s: float
    """CPU time of all client processes together."""
    busy: float
    """The busiest client process's CPU time over its wall time; near 1, the client was the limit."""


@dataclass
class Window:
    """The steady state of a pass: from the first moment `lanes` requests were in flight to the first
    completion after the last request was sent, when in-flight falls below `lanes` for good (the drain)."""

    start: float
    end: float
    input_tokens: int
    """Prompt tokens of the requests whose first token (the end of their prefill) arrived in the window."""
    output_tokens: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


def levels(spans: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """(time, how many spans are open just after it) at each start and end of `spans`, in time order, an end before
    a start at the same instant: the level of requests in flight (sent to done) or streaming (first token to done)."""
    walk, level = [], 0
    for at, step in sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans]):
        level += step
        walk.append((at, level))
    return walk


def steady_window(completions: list[Completion], prompt_lens: list[int], lanes: int) -> Window | None:
    """None where the pass never held `lanes` requests in flight before its drain began."""
    if not completions:
        return None
    start = next((at for at, level in levels([(c.sent, c.done) for c in completions]) if level >= lanes), None)
    last_sent = max(c.sent for c in completions)
    end = min((c.done for c in completions if c.done > last_sent), default=None)
    if start is None or end is None or end <= start:
        return None
    output = sum(n for c in completions for at, n in c.chunks if start <= at <= end)
    prefilled = sum(k for c, k in zip(completions, prompt_lens)
                    if c.first_token is not None and start <= c.first_token <= end)
    return Window(start, end, prefilled, output)


DECODING_SHARE = 0.9
"""decoding_at_once: the level held for all but a tenth of the pass's streaming time."""


def decoding_at_once(completions: list[Completion]) -> int:
    """How many requests were streaming at once (from each one's first token to its last, as the client received
    them) for all but a tenth of the time any was: not the momentary peak, which a loaded client inflates (a request's
    end read late while the next one streams: 7 for a stand-in holding 4 seats, beside four other test workers)."""
    walk = levels([(c.first_token, c.done) for c in completions if c.first_token is not None])
    if not walk:
        return 0
    held: dict[int, float] = {}
    for (at, level), (later, _) in zip(walk, walk[1:] + walk[-1:]):
        held[level] = held.get(level, 0.0) + (later - at)
    total = sum(t for lvl, t in held.items() if lvl > 0)
    if total <= 0:
        return max(held, default=0)
    above = 0.0
    for lvl in sorted(held, reverse=True):
        above += held[lvl]
        if above >= (1 - DECODING_SHARE) * total:
            return lvl
    return 0


def _shard(endpoint: Endpoint, prompts: list[list[int]], max_tokens: int, lanes: int,
           timeout_s: float, stall_s: float | None = None) -> tuple[list[Completion], float, float]:
    cpu, started = time.process_time(), time.perf_counter()
    try:
        completions = asyncio.run(complete_all(endpoint, prompts, max_tokens, lanes, timeout_s, stall_s))
    except Exception as exc:  # crosses a process boundary: keep the message, in a type that pickles
        raise RequestError(f"{type(exc).__name__}: {exc}") from None
    return completions, time.process_time() - cpu, time.perf_counter() - started


def _ready() -> bool:
    time.sleep(0.2)
    return True


class LoadClient:
    """`processes` client processes (1: the harness process itself), started before any timing."""

    def __init__(self, processes: int = 1):
        self.processes = processes
        self.pool = None
        if processes > 1:
            self.pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
            if not all(f.result() for f in [self.pool.submit(_ready) for _ in range(processes)]):
                raise RuntimeError("load client processes did not start")

    def __enter__(self) -> LoadClient:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool:
            self.pool.shutdown(cancel_futures=True)

    async def run(self, endpoint: Endpoint, prompts: list[list[int]], max_tokens: int, concurrency: int | None,
                  timeout_s: float, stall_s: float | None = None) -> Load:
        """All prompts by at most `concurrency` lanes in all (None: all at once); results in prompt order. A
        client process in which no token arrives on any lane for `stall_s` fails the run (complete_all)."""
        lanes = min(concurrency or len(prompts), len(prompts))
        if self.pool is None or lanes < 2:
            cpu, started = time.process_time(), time.perf_counter()
            completions = await complete_all(endpoint, prompts, max_tokens, lanes, timeout_s, stall_s)
            cpu = time.process_time() - cpu
            return Load(completions, cpu, cpu / (time.perf_counter() - started))
        parts = min(self.processes, lanes)
        shards = [list(range(j, len(prompts), parts)) for j in range(parts)]
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(
            loop.run_in_executor(self.pool, _shard, endpoint, [prompts[i] for i in shard], max_tokens,
                                 lanes // parts + (j < lanes % parts), timeout_s, stall_s)
            for j, shard in enumerate(shards)))
        completions: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
        for shard, (done, _, _) in zip(shards, results):
            for index, completion in zip(shard, done):
                completions[index] = completion
        return Load(completions, sum(r[1] for r in results), max(r[1] / r[2] for r in results))
