"""The parity gate: greedy token ids must equal the reference's, position for position."""
from __future__ import annotations

import asyncio
import hashlib
import json
import secrets

from agent.stages.completions import ANSWER_ERRORS, Completion, complete_all, draw_prompts
from sandbox.base import Server
from traces.errors import NightshiftError
from traces.schema import Divergence, ParityReport


class ReferenceFailed(NightshiftError, RuntimeError):
    """The reference server stopped answering: no candidate can be judged, so the run stops."""

    stage = "parity"


def first_divergence(reference: list[list[int]], candidate: list[list[int]], expected_len: int) -> Divergence | None:
    """The first prompt (and position) where the candidate's tokens differ or its length is wrong."""
    for index, (ref, got) in enumerate(zip(reference, candidate, strict=True)):
        if ref == got and len(got) == expected_len:
            continue
        position = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        return Divergence(prompt_index=index, position=position,
                          expected=ref[position] if position < len(ref) else None,
                          got=got[position] if position < len(got) else None,
                          expected_len=len(ref), got_len=len(got))
    return None


def digest(prompts: list[list[int]], outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps([prompts, outputs], separators=(",", ":")).encode()).hexdigest()


async def generate(server: Server, prompts: list[list[int]], max_tokens: int, regime: str,
                   timeout_s: float) -> list[list[int]]:
    completions: list[Completion] = await complete_all(
        server, prompts, max_tokens, 1 if regime == "sequential" else None, timeout_s)
    return [c.tokens for c in completions]


async def check_parity(candidate: int, reference: Server, subject: Server, prompts: list[list[int]],
                       max_tokens: int, regime: str, timeout_s: float) -> ParityReport:
    try:
        expected = await generate(reference, prompts, max_tokens, regime, timeout_s)
    except ANSWER_ERRORS as exc:
        raise ReferenceFailed(f"the reference server failed to answer: {type(exc).__name__}: {exc}") from None
    wrong = next((len(tokens) for tokens in expected if len(tokens) != max_tokens), None)
    if wrong is not None:
        raise RuntimeError(f"reference server returned {wrong} tokens, not {max_tokens}")
    got = await generate(subject, prompts, max_tokens, regime, timeout_s)
    divergence = first_divergence(expected, got, max_tokens)
    return ParityReport(candidate=candidate, ok=divergence is None, regime=regime, prompts=len(prompts),
                        tokens_per_prompt=max_tokens, digest=digest(prompts, got), divergence=divergence)


def fresh_parity(task, vocab_size: int, reference: Server, candidate: int, subject: Server) -> ParityReport:
    """The parity gate on freshly drawn prompts: `subject` against the reference, in the task's regime."""
    p = task.parity
    prompts = draw_prompts(secrets.randbits(63), p.num_prompts, p.input_len, vocab_size)
    return asyncio.run(check_parity(candidate, reference, subject, prompts, p.max_tokens, p.regime,
                                    task.benchmark.request_timeout_s))
