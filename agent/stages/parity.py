"""The parity gate: greedy token ids must equal the reference's, position for position."""
from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import threading

import numpy as np

from agent.stages.completions import ANSWER_ERRORS, Completion, complete_all, completion_body, draw_prompts, \
    first_choice
from sandbox.base import Server
from traces.errors import NightshiftError
from traces.schema import Divergence, LongRequest, ParityReport


class ReferenceFailed(NightshiftError, RuntimeError):
    """The reference server stopped answering: no candidate can be judged, so the run stops."""

    stage = "parity"


class CalledOff(NightshiftError, RuntimeError):
    """The check was stopped because a start beside it failed (a candidate's production server, while its parity
    server was checked): its result would decide nothing."""

    stage = "parity"


CALLED_OFF_POLL_S = 0.25


def run_unless(coro, stop: threading.Event | None):
    """asyncio.run(coro); with `stop`, the coroutine is cancelled and CalledOff raised as soon as stop is set."""
    if stop is None:
        return asyncio.run(coro)

    async def watched():
        work = asyncio.ensure_future(coro)
        while not work.done():
            if stop.is_set():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                raise CalledOff("a start beside the parity check failed")
            await asyncio.wait({work}, timeout=CALLED_OFF_POLL_S)
        return work.result()
    return asyncio.run(watched())


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


def long_reach(task) -> int:
    """How far (prompt plus output, in positions) the long requests reach: the benchmark's longest request plus its
    output and the verify grid's longest, capped at the model's max_model_len (and parity.long_reach if set)."""
    w, v = task.workload, task.verify
    want = max(w.input_len + w.output_len, max(v.input_lens) + max(v.output_lens))
    reach = min(want, task.model.max_model_len)
    return min(reach, task.parity.long_reach) if task.parity.long_reach else reach


def long_shapes(seed: int, count: int, floor: int, reach: int, production_share: float) -> list[LongRequest]:
    """`count` request shapes drawn with `seed`: the first reaches exactly `reach` positions with EOS ignored, the
    second is a production request (EOS and a stop token honoured) where count > 1; the rest reach a length drawn
    uniformly from [floor, reach], production with probability `production_share`. Each output is a quarter to a
    half of its length, so the generated positions cover the far end."""
    rng = np.random.default_rng(seed)
    shapes = []
    for i in range(count):
        total = reach if i == 0 else int(rng.integers(min(floor, reach), reach + 1))
        out = min(total - 1, int(rng.integers(max(1, total // 4), max(1, total // 2) + 1)))
        production = i == 1 or (i > 1 and bool(rng.random() < production_share))
        shapes.append(LongRequest(input_len=total - out, max_tokens=out, production=production))
    return shapes


async def _whole(server: Server, body: dict, timeout_s: float) -> tuple[list[int], str]:
    async with server.client(timeout_s) as client:
        choice = await first_choice(client, body)
    return [int(t) for t in choice.get("token_ids") or []], str(choice.get("finish_reason") or "")


async def check_long(reference: Server, subject: Server, seed: int, shapes: list[LongRequest], vocab_size: int,
                     timeout_s: float) -> tuple[list[LongRequest], Divergence | None]:
    """Each long request, one at a time, on the reference then on the subject; a production request first asks the
    reference with EOS ignored and stops at a token it drew from the second half of that answer, so the stop is
    reached. Returns the shapes as sent (with their stop tokens) and the first divergence."""
    rng = np.random.default_rng(seed ^ 0x5EED)
    sent, found = [], None
    for index, shape in enumerate(shapes):
        prompt = draw_prompts(int(rng.integers(1 << 62)), 1, shape.input_len, vocab_size)[0]
        body = completion_body(prompt, shape.max_tokens)
        if shape.production:
            try:
                plain, _ = await _whole(reference, body, timeout_s)
            except ANSWER_ERRORS as exc:
                raise ReferenceFailed(f"the reference server failed to answer: {type(exc).__name__}: {exc}") from None
            stop = plain[int(rng.integers(len(plain) // 2, len(plain)))] if plain else 0
            shape = shape.model_copy(update={"stop_token_ids": [stop]})
            body = completion_body(prompt, shape.max_tokens, ignore_eos=False, stop_token_ids=[stop])
        try:
            expected, want_finish = await _whole(reference, body, timeout_s)
        except ANSWER_ERRORS as exc:
            raise ReferenceFailed(f"the reference server failed to answer: {type(exc).__name__}: {exc}") from None
        sent.append(shape)
        got, finish = await _whole(subject, body, timeout_s)
        if found is None and (got != expected or finish != want_finish):
            position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                            min(len(expected), len(got)))
            found = Divergence(prompt_index=index, position=shape.input_len + position,
                               expected=expected[position] if position < len(expected) else None,
                               got=got[position] if position < len(got) else None,
                               expected_len=len(expected), got_len=len(got))
    return sent, found


def fresh_parity(task, vocab_size: int, reference: Server, candidate: int, subject: Server,
                 stop: threading.Event | None = None) -> ParityReport:
    """The parity gate on freshly drawn prompts: `subject` against the reference, in the task's regime; then the
    long requests (parity.long_prompts), of shapes drawn per check from a seed the trace records. CalledOff as soon
    as `stop` is set."""
    p = task.parity
    prompts = draw_prompts(secrets.randbits(63), p.num_prompts, p.input_len, vocab_size)
    report = run_unless(check_parity(candidate, reference, subject, prompts, p.max_tokens, p.regime,
                                     task.benchmark.request_timeout_s), stop)
    if not report.ok or not p.long_prompts:
        return report
    seed, reach = secrets.randbits(63), long_reach(task)
    shapes = long_shapes(seed, p.long_prompts, p.input_len + p.max_tokens, reach, p.long_production_share)
    sent, divergence = run_unless(check_long(reference, subject, seed, shapes, vocab_size,
                                             task.benchmark.request_timeout_s), stop)
    return report.model_copy(update={"ok": divergence is None, "long_seed": seed, "long_reach": reach,
                                     "long_requests": sent, "long_divergence": divergence,
                                     "divergence": divergence})
