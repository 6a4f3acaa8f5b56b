"""The benchmark: interleaved, repeated passes of the workload; the clock and counts are ours."""
from __future__ import annotations

import gzip
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from agent.load import LoadClient
from agent.requests import draw_prompts
from agent.stats import SpeedupEstimate, estimate_speedup
from agent.task import Task
from agent.token_audit import Output
from sandbox.base import Server
from traces.schema import BenchReport, Sample


class WorkMismatch(RuntimeError):
    """A server returned other work than was asked for (fewer tokens, or other tokens)."""


class HarnessBound(RuntimeError):
    """The load client was too busy during a pass for its clock to measure the server."""


@dataclass
class Pass:
    sample: Sample
    prompts: list[list[int]]
    outputs: list[list[int]]

    def requests(self) -> list[Output]:
        return [Output(self.sample.repetition, i, p, o) for i, (p, o) in enumerate(zip(self.prompts, self.outputs))]


def outputs_sha256(prompts: list[list[int]], outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps([prompts, outputs], separators=(",", ":")).encode()).hexdigest()


def save_passes(folder: Path, name: str, passes: list[Pass]) -> Path:
    """Every pass's prompts and returned token ids, gzipped JSON (each sample records their sha256)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json.gz"
    records = [{"role": p.sample.role, "repetition": p.sample.repetition, "sha256": p.sample.outputs_sha256,
                "prompts": p.prompts, "outputs": p.outputs} for p in passes]
    with gzip.open(path, "wt") as f:
        json.dump(records, f, separators=(",", ":"))
    return path


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def timed_pass(load: LoadClient, server: Server, role: str, repetition: int, prompts: list[list[int]],
                     output_len: int, concurrency: int | None, timeout_s: float) -> Pass:
    started = time.perf_counter()
    result = await load.run(server.endpoint, prompts, output_len, concurrency, timeout_s)
    seconds, completions = time.perf_counter() - started, result.completions
    outputs = [c.tokens for c in completions]
    short = [i for i, tokens in enumerate(outputs) if len(tokens) != output_len]
    if short:
        raise WorkMismatch(f"{role}: {len(short)} of {len(prompts)} requests did not return exactly "
                           f"{output_len} tokens (first: prompt {short[0]}, {len(outputs[short[0]])} tokens)")
    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(t) for t in outputs)
    ttft = [c.ttft_ms for c in completions if c.ttft_ms is not None]
    tpot = [c.tpot_ms for c in completions if c.tpot_ms is not None]
    sample = Sample(role=role, repetition=repetition, seconds=seconds, input_tokens=input_tokens,
                    output_tokens=output_tokens, total_tokens_per_s=(input_tokens + output_tokens) / seconds,
                    output_tokens_per_s=output_tokens / seconds, ttft_ms_p50=_percentile(ttft, 50),
                    ttft_ms_p99=_percentile(ttft, 99), tpot_ms_p50=_percentile(tpot, 50),
                    tpot_ms_p99=_percentile(tpot, 99), client_cpu_s=round(result.cpu_s, 3),
                    client_busy=round(result.busy, 3), outputs_sha256=outputs_sha256(prompts, outputs))
    return Pass(sample, prompts, outputs)


async def warm_up(load: LoadClient, server: Server, task: Task, vocab_size: int, seed: int) -> None:
    if task.benchmark.warmup_requests:
        prompts = draw_prompts(seed, task.benchmark.warmup_requests, task.workload.input_len, vocab_size)
        await load.run(server.endpoint, prompts, task.workload.output_len, task.workload.concurrency,
                       task.benchmark.request_timeout_s)


@dataclass
class Comparison:
    samples: list[Sample]
    estimate: SpeedupEstimate
    note: str
    passes: list[Pass]

    def outputs(self, role: str) -> list[Output]:
        return [o for p in self.passes if p.sample.role == role for o in p.requests()]


async def compare(task: Task, incumbent: Server, candidate: Server, vocab_size: int, seeds: list[int],
                  on_sample: Callable[[Sample], None] = lambda s: None) -> Comparison:
    """Interleave incumbent and candidate (ABBA order) over fresh prompts for each repetition."""
    with LoadClient(task.benchmark.client_processes) as load:
        return await _compare(load, task, incumbent, candidate, vocab_size, seeds, on_sample)


async def calibration_passes(task: Task, server: Server, vocab_size: int, seeds: list[int]) -> list[Pass]:
    """Timed passes of the workload on one server (the baseline's A/A for the token audit)."""
    w, b = task.workload, task.benchmark
    with LoadClient(b.client_processes) as load:
        await warm_up(load, server, task, vocab_size, seeds[0])
        return [await timed_pass(load, server, "incumbent", repetition,
                                 draw_prompts(seed, w.num_prompts, w.input_len, vocab_size), w.output_len,
                                 w.concurrency, b.request_timeout_s)
                for repetition, seed in enumerate(seeds[1:])]


async def _compare(load: LoadClient, task: Task, incumbent: Server, candidate: Server, vocab_size: int,
                   seeds: list[int], on_sample: Callable[[Sample], None]) -> Comparison:
    w, b = task.workload, task.benchmark
    await warm_up(load, incumbent, task, vocab_size, seeds[0])
    await warm_up(load, candidate, task, vocab_size, seeds[0])
    samples: list[Sample] = []
    kept: list[Pass] = []
    checked = 0
    for repetition, seed in enumerate(seeds[1:]):
        prompts = draw_prompts(seed, w.num_prompts, w.input_len, vocab_size)
        order = [("incumbent", incumbent), ("candidate", candidate)]
        if repetition % 2:
            order.reverse()
        passes = {}
        for role, server in order:
            passes[role] = await timed_pass(load, server, role, repetition, prompts, w.output_len, w.concurrency,
                                            b.request_timeout_s)
            sample = passes[role].sample
            samples.append(sample)
            kept.append(passes[role])
            on_sample(sample)
            if sample.client_busy > b.max_client_busy:
                raise HarnessBound(
                    f"{role} repetition {repetition}: a load client process was busy {sample.client_busy:.0%} of "
                    f"the pass (limit {b.max_client_busy:.0%}), so the client, not the server, may have set the "
                    f"pace; raise benchmark.client_processes (now {b.client_processes})")
        if b.check_tokens:
            if passes["candidate"].outputs != passes["incumbent"].outputs:
                raise WorkMismatch(f"repetition {repetition}: benchmark tokens differ from the incumbent's")
            checked += len(prompts)
    metric = b.metric
    cand = [getattr(s, metric) for s in samples if s.role == "candidate"]
    inc = [getattr(s, metric) for s in samples if s.role == "incumbent"]
    estimate = estimate_speedup(cand, inc, task.acceptance.min_speedup, task.acceptance.confidence)
    note = (f"every request returned exactly {w.output_len} tokens"
            + (f"; {checked} outputs identical to the incumbent's" if b.check_tokens else
               "; tokens not compared with the incumbent's (batching is not invariant in this regime)"))
    return Comparison(samples, estimate, note, kept)


def report(candidate: int, task: Task, samples: list[Sample], estimate: SpeedupEstimate, proof, note: str,
           confirmation: int = 0):
    return BenchReport(candidate=candidate, metric=task.benchmark.metric, samples=samples,
                       speedup=estimate.speedup, ci_low=estimate.ci_low, ci_high=estimate.ci_high,
                       confidence=estimate.confidence, p_value=estimate.p_value, liveness=proof.liveness,
                       output_check=note, confirmation=confirmation)
