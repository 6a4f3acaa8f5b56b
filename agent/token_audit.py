"""The token audit: every token a benchmark measured, scored teacher-forced on the trusted reference.

A timed pass keeps the token ids each request returned. Afterwards the harness picks the requests
to audit (all, or `audit.sample`) with a seed the candidate never sees, and sends each
`prompt + output` to the reference with `prompt_logprobs`: at every generated position vLLM gives
the returned token's log-prob and the reference's top-1 token and log-prob. A position whose token
is not the top-1 and lies more than `audit.tolerance_nats` below it is a violation."""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import numpy as np

from agent.requests import ANSWER_ERRORS, RequestError, completion_body
from sandbox.base import Server
from agent.parity import ReferenceFailed
from traces.schema import Deficits, TokenAudit, Violation

MAX_RECORDED_VIOLATIONS = 20


@dataclass
class Output:
    """One request of a timed pass: what was asked and what came back."""

    repetition: int
    request: int
    prompt: list[int]
    tokens: list[int]


@dataclass
class Position:
    token: int
    logprob: float
    top1: int
    top1_logprob: float

    @property
    def deficit(self) -> float:
        return 0.0 if self.token == self.top1 else max(0.0, self.top1_logprob - self.logprob)


def parse_prompt_logprobs(entries: list, prompt_len: int, tokens: list[int]) -> list[Position]:
    """The generated positions of a `prompt_logprobs: 1` answer (one dict per prompt position)."""
    if len(entries) != prompt_len + len(tokens):
        raise RequestError(f"expected prompt logprobs for {prompt_len + len(tokens)} positions, got {len(entries)}")
    positions = []
    for token, entry in zip(tokens, entries[prompt_len:]):
        if not entry or str(token) not in entry:
            raise RequestError(f"prompt logprobs lack the returned token {token}")
        mine = entry[str(token)]
        top = next(((int(k), v) for k, v in entry.items() if v.get("rank") == 1), (token, mine))
        positions.append(Position(token, float(mine["logprob"]), top[0], float(top[1]["logprob"])))
    return positions


async def score(client, prompt: list[int], tokens: list[int]) -> list[Position]:
    body = completion_body(prompt + tokens, 1, prompt_logprobs=1)
    response = await client.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise RequestError(f"HTTP {response.status_code}: {response.text[:500]}")
    return parse_prompt_logprobs(response.json()["choices"][0].get("prompt_logprobs") or [], len(prompt), tokens)


async def score_all(reference: Server, outputs: list[Output], concurrency: int, timeout_s: float) -> list[list[Position]]:
    results: list = [None] * len(outputs)
    queue = iter(range(len(outputs)))

    async def lane() -> None:
        async with reference.client(timeout_s) as client:
            for index in queue:
                results[index] = await score(client, outputs[index].prompt, outputs[index].tokens)

    await asyncio.gather(*(lane() for _ in range(min(concurrency, len(outputs)) or 1)))
    return results


def pick(outputs: list[Output], sample: int | None, seed: int) -> list[Output]:
    """All outputs, or `sample` of them drawn with `seed` (drawn after the passes ran)."""
    if sample is None or sample >= len(outputs):
        return list(outputs)
    chosen = np.random.default_rng(seed).choice(len(outputs), size=sample, replace=False)
    return [outputs[i] for i in sorted(chosen)]


def deficits_of(values: list[float], positions: int) -> Deficits:
    q = (lambda p: float(np.quantile(values, p))) if values else (lambda p: 0.0)
    return Deficits(positions=positions, non_top1=len(values), max=max(values, default=0.0),
                    p50=q(0.5), p90=q(0.9), p99=q(0.99))


def run_audit(candidate: int, reference: Server, outputs: list[Output], tolerance_nats: float, sample: int | None,
              concurrency: int, timeout_s: float, confirmation: int = 0, calibration: bool = False) -> TokenAudit:
    """Score the chosen outputs on the reference; raises ReferenceFailed if the reference cannot answer."""
    started, seed = time.perf_counter(), secrets.randbits(63)
    chosen = pick(outputs, sample, seed)
    try:
        scored = asyncio.run(score_all(reference, chosen, concurrency, timeout_s))
    except (*ANSWER_ERRORS, KeyError, ValueError) as exc:
        raise ReferenceFailed(f"the reference server failed while auditing tokens: {type(exc).__name__}: {exc}") \
            from None
    values, violations, positions = [], [], 0
    for output, scores in zip(chosen, scored):
        for index, p in enumerate(scores):
            positions += 1
            if p.token == p.top1:
                continue
            values.append(p.deficit)
            if p.deficit > tolerance_nats:
                violations.append(Violation(repetition=output.repetition, request=output.request, position=index,
                                            returned=p.token, expected=p.top1, deficit_nats=round(p.deficit, 6)))
    return TokenAudit(candidate=candidate, confirmation=confirmation, calibration=calibration,
                      requests=len(chosen), of_requests=len(outputs), tokens=positions, tolerance_nats=tolerance_nats,
                      deficits=deficits_of(values, positions), violation_count=len(violations),
                      violations=violations[:MAX_RECORDED_VIOLATIONS], sample_seed=seed,
                      seconds=round(time.perf_counter() - started, 3))


def audit_passed(audit: TokenAudit) -> bool:
    """The rule, in one place: no position more than tolerance_nats below the reference's top-1."""
    return audit.violation_count == 0 and audit.deficits.max <= audit.tolerance_nats


def describe(audit: TokenAudit) -> str:
    if audit_passed(audit):
        return (f"{audit.tokens} tokens under load, 0 violations, max deficit {audit.deficits.max:.3f} nats, "
                f"tol {audit.tolerance_nats:g}")
    v = audit.violations[0]
    return (f"{audit.violation_count} of {audit.tokens} audited tokens violate tol {audit.tolerance_nats:g} nats; "
            f"first: pass {v.repetition}, request {v.request}, position {v.position}: returned {v.returned}, "
            f"reference top-1 {v.expected}, {v.deficit_nats:.3f} nats below")


def trailer(audits: list[TokenAudit]) -> str:
    """The `Nightshift-Audit` trailer of a kept commit: every audit of the candidate together."""
    return (f"{sum(a.tokens for a in audits)} tokens under load, {sum(a.violation_count for a in audits)} violations, "
            f"max deficit {max(a.deficits.max for a in audits):.3f} nats, tol {audits[-1].tolerance_nats:g}")
