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
                   model: str = "model") -> Completion:
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
                    if result.first_token is None:
                        result.first_token = now
                    result.tokens.extend(int(t) for t in ids)
                    result.chunks.append((now, len(ids)))
    result.done = time.perf_counter()
    return result


async def complete_all(server, prompts: list[list[int]], max_tokens: int, concurrency: int | None,
                       timeout_s: float, stall_s: float | None = None) -> list[Completion]:
    """All prompts, in order, by at most `concurrency` lanes (None: all at once, 1: one at a time).

    Each lane has a client (and connection) of its own: one shared httpx pool costs time per chunk
    that grows with the number of connections, which caps what the harness can measure."""
    results: list[Completion | None] = [None] * len(prompts)
    queue = iter(range(len(prompts)))

    async def lane() -> None:
        timeout = httpx.Timeout(timeout_s, read=min(stall_s, timeout_s)) if stall_s else timeout_s
        async with server.client(timeout) as client:
            for index in queue:
                results[index] = await complete(client, prompts[index], max_tokens)

    lanes = min(concurrency or len(prompts), len(prompts))
    tasks = [asyncio.create_task(lane()) for _ in range(lanes)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return results
