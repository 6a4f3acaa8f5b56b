"""Top-1 minus top-2 log-probability margins of the served model's greedy steps, as vLLM computes them.

Small margins mean any change in reduction order can flip a token, so parity on such a model says
little; the run records them next to the self-parity check."""
from __future__ import annotations

import asyncio
import secrets

from agent.world.numerics import Margins
from agent.stages.parity import ReferenceFailed
from agent.stages.completions import ANSWER_ERRORS, RequestError, completion_body, draw_prompts, first_choice
from agent.world.task import Parity
from sandbox.base import Server, answers_health


def margins_of(step_logprobs: list[dict[str, float]]) -> list[float]:
    """One margin per generated position, from vLLM's `top_logprobs` (at least two entries each)."""
    margins = []
    for entries in step_logprobs:
        values = sorted(entries.values(), reverse=True)
        if len(values) < 2:
            raise RequestError(f"expected two top logprobs per position, got {len(values)}")
        margins.append(values[0] - values[1])
    return margins


async def greedy_margins(server: Server, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> Margins:
    """Greedy completions with the two most likely tokens per step; all prompts in flight at once."""
    async def one(client, prompt: list[int]) -> list[float]:
        body = completion_body(prompt, max_tokens, logprobs=2, return_tokens_as_token_ids=True)
        logprobs = (await first_choice(client, body)).get("logprobs") or {}
        steps = logprobs.get("top_logprobs") or []
        if len(steps) != max_tokens:
            raise RequestError(f"expected top logprobs for {max_tokens} positions, got {len(steps)}")
        return margins_of(steps)

    async with server.client(timeout_s) as client:
        per_prompt = await asyncio.gather(*(one(client, prompt) for prompt in prompts))
    return Margins.of([m for margins in per_prompt for m in margins])


def served_margins(server: Server, parity: Parity, vocab_size: int, timeout_s: float) -> tuple[dict | None, str]:
    """The task's margin measurement on `server`: (summary, "") or (None, why it could not be measured)."""
    if not parity.margin_prompts:
        return None, ""
    prompts = draw_prompts(secrets.randbits(63), parity.margin_prompts, parity.input_len, vocab_size)
    try:
        margins = asyncio.run(greedy_margins(server, prompts, parity.max_tokens, timeout_s))
    except (*ANSWER_ERRORS, KeyError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        if not answers_health(server):
            raise ReferenceFailed(f"the reference server died while its margins were measured: {error}") from None
        return None, error
    return margins.model_dump(), ""
