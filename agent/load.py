"""The benchmark's load generator: the workload's lanes, spread over client processes, so that a
measurement never measures the harness's own CPU. It reports how busy its busiest process was."""
from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from agent.requests import Completion, RequestError, complete_all
from sandbox.base import Endpoint


@dataclass
class Load:
    completions: list[Completion]
    cpu_s: float
    """CPU time of all client processes together."""
    busy: float
    """The busiest client process's CPU time over its wall time; near 1, the client was the limit."""


def _shard(endpoint: Endpoint, prompts: list[list[int]], max_tokens: int, lanes: int,
           timeout_s: float) -> tuple[list[Completion], float, float]:
    cpu, started = time.process_time(), time.perf_counter()
    try:
        completions = asyncio.run(complete_all(endpoint, prompts, max_tokens, lanes, timeout_s))
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
                  timeout_s: float) -> Load:
        """All prompts by at most `concurrency` lanes in all (None: all at once); results in prompt order."""
        lanes = min(concurrency or len(prompts), len(prompts))
        if self.pool is None or lanes < 2:
            cpu, started = time.process_time(), time.perf_counter()
            completions = await complete_all(endpoint, prompts, max_tokens, lanes, timeout_s)
            cpu = time.process_time() - cpu
            return Load(completions, cpu, cpu / (time.perf_counter() - started))
        parts = min(self.processes, lanes)
        shards = [list(range(j, len(prompts), parts)) for j in range(parts)]
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(
            loop.run_in_executor(self.pool, _shard, endpoint, [prompts[i] for i in shard], max_tokens,
                                 lanes // parts + (j < lanes % parts), timeout_s)
            for j, shard in enumerate(shards)))
        completions: list[Completion] = [None] * len(prompts)  # type: ignore[list-item]
        for shard, (done, _, _) in zip(shards, results):
            for index, completion in zip(shard, done):
                completions[index] = completion
        return Load(completions, sum(r[1] for r in results), max(r[1] / r[2] for r in results))
