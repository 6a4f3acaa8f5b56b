"""Greedy completion requests with token-id prompts, timed and counted on the harness side."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

FIRST_REGULAR_TOKEN = 4


def draw_prompts(seed: int, count: int, length: int, vocab_size: int) -> list[list[int]]:
    """Random token-id prompts; special ids below FIRST_REGULAR_TOKEN are never drawn."""
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_REGULAR_TOKEN, vocab_size, size=(count, length)).tolist()


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    sent: float = 0.0
    first_token: float | None = None
    done: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    """(arrival time, token count) of each streamed chunk that carried tokens."""

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token is None else (self.first_token - self.sent) * 1000

    @property
    def tpot_ms(self) -> float | None:
        if self.first_token is None or len(self.tokens) < 2:
            return None
        return (self.done - self.first_token) * 1000 / (len(self.tokens) - 1)


class RequestError(RuntimeError):
    pass


ANSWER_ERRORS = (RequestError, OSError, httpx.HTTPError)
"""How a server can fail to answer: error status, dead process, timeout."""


def completion_body(prompt: list[int], max_tokens: int, *, stream: bool = False, model: str = "model",
                    **extra) -> dict:
    """A greedy /v1/completions request of exactly `max_tokens` tokens (temperature 0, EOS ignored,
    seed 0) that returns token ids; `extra` fields (logprobs, say) are added last and win."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, "seed": 0, **extra}


async def first_choice(client: httpx.AsyncClient, body: dict) -> dict:
    """The first choice of one non-streamed /v1/completions request; RequestError on an error status."""
    response = await client.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RequestError(f"HTTP {response.status_code}: {response.text[:500]}")
    return response.json()["choices"][0]


async def complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                   model: str = "model", progress: list[float] | None = None) -> Completion:
    """One streamed greedy completion; token ids come from the stream, the clock is ours."""
    result = Completion(sent=time.perf_counter())
    body = completion_body(prompt, max_tokens, stream=True, model=model)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise RequestError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids:
                    now = time.perf_counter()
                    if progress is not None:
                        progress[0] = now
                    if result.first_token is None:
                        result.first_token = now
                    result.tokens.extend(int(t) for t in ids)
                    result.chunks.append((now, len(ids)))
    result.done = time.perf_counter()
    return result


async def _watch(progress: list[float], stall_s: float, lanes: int) -> None:
    """Raises once no token has arrived for `stall_s`; runs until cancelled otherwise."""
    while True:
        silent = time.perf_counter() - progress[0]
        if silent > stall_s:
            raise RequestError(f"stalled: no token arrived on any of {lanes} streams for {silent:.0f} s "
                               f"(benchmark.stall_timeout_s {stall_s:g})")
        await asyncio.sleep(min(1.0, stall_s / 4))


async def complete_all(server, prompts: list[list[int]], max_tokens: int, concurrency: int | None,
                       timeout_s: float, stall_s: float | None = None) -> list[Completion]:
    """All prompts, in order, by at most `concurrency` lanes (None: all at once, 1: one at a time).

    Each lane has a client (and connection) of its own: one shared httpx pool costs time per chunk
    that grows with the number of connections, which caps what the harness can measure. With `stall_s`,
    the whole call fails (RequestError) once no token has arrived on any lane for that long: a queued
    request may wait longer than that for its first token, as long as the others move."""
    results: list[Completion | None] = [None] * len(prompts)
    queue = iter(range(len(prompts)))
    progress = [time.perf_counter()]

    async def lane() -> None:
        async with server.client(timeout_s) as client:
            for index in queue:
                results[index] = await complete(client, prompts[index], max_tokens, progress=progress)
                progress[0] = time.perf_counter()

    lanes = min(concurrency or len(prompts), len(prompts))
    tasks = [asyncio.create_task(lane()) for _ in range(lanes)]
    work = asyncio.gather(*tasks)
    work.add_done_callback(_retrieved)
    try:
        if stall_s:  # the watch must not outlive the work: a pass's clock stops when its last token is in
            tasks.append(asyncio.create_task(_watch(progress, stall_s, lanes)))
            await asyncio.wait([work, tasks[-1]], return_when=asyncio.FIRST_COMPLETED)
            if tasks[-1].done():
                tasks[-1].result()
        await work
    finally:
        work.cancel()
        for task in tasks:
            task.cancel()
        if tasks:  # the lanes close their connections before the call returns
            await asyncio.wait(tasks, timeout=5)
    return results


def _retrieved(future: asyncio.Future) -> None:
    """Marks a failed or called-off gather's exception as seen. Unseen, it is logged with its traceback when the
    future is collected, at any point of the harness's thread; on Python 3.11 formatting that traceback inside
    another compile() fails it ("AST constructor recursion depth mismatch")."""
    if not future.cancelled():
        future.exception()
