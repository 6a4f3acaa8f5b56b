"""The benchmark: interleaved, repeated passes of the workload; the clock and counts are ours."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import math
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from agent.world import gpu_state
from agent.stages.load import LoadClient, decoding_at_once, steady_window
from agent.stages.completions import ANSWER_ERRORS, RequestError, draw_prompts
from agent.stages.stats import (SpeedupEstimate, idle_work, moved_by_code, off_schedule, plan_looks,
                                sequential_estimate)
from agent.world.task import Task
from agent.stages.token_audit import Output
from sandbox.base import Server
from sandbox import priority
from sandbox.host import cpu_pressure_s, cpu_seconds, machine_cpu, major_faults, server_pid, snapshot
from traces.log import raise_pending
from traces.schema import BenchReport, Sample


IDLE_BUSY_CORES = 0.5
"""A pass during which the other side's (idle) server used more CPU than this is flagged."""
FOREIGN_CORES, STEAL_CORES = 0.25, 0.05
"""A pass during which processes outside the benchmark (not the two servers, not the load client) used more CPU
than FOREIGN_CORES, or the hypervisor stole more than STEAL_CORES, is flagged: its clock measured the machine."""
QUIET_CORES, QUIET_WINDOW_S = 0.1, 0.25
"""Before a pass, both servers are awaited until each used less CPU than this over one window."""


class WorkMismatch(RuntimeError):
    """A server returned other work than was asked for (fewer tokens, or other tokens)."""


class HarnessBound(RuntimeError):
    """The load client was too busy during a pass for its clock to measure the server."""


class NotCounted(RuntimeError):
    """A benchmark whose samples show it does not measure the candidate's change (agent/stages/stats.py's rules);
    the samples ride along, so that whoever records the refusal can show what the rule read."""

    def __init__(self, message: str, samples: list | None = None):
        super().__init__(message)
        self.samples = list(samples or [])


class IdleWork(NotCounted):
    """The candidate's server worked while the incumbent was measured (agent/stages/stats.py idle_work)."""


class MovedByCode(NotCounted):
    """The candidate's server served more requests at once than its max_num_seqs (stats.py moved_by_code)."""


class PassFailed(RequestError):
    """A timed pass's server failed to answer (an error, a dead process, or no token on any stream for
    benchmark.stall_timeout_s): which side it was, so that a hung incumbent is not blamed on the candidate."""

    def __init__(self, role: str, server: str, repetition: int, cause: BaseException, circumstances: str = ""):
        self.role, self.server, self.repetition = role, server, repetition
        detail = str(cause) or type(cause).__name__
        circumstances = f" ({circumstances})" if circumstances else ""
        super().__init__(f"the {role}'s server {server} failed in repetition {repetition}: {detail}{circumstances}")


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


def sample_metric(task: Task) -> str:
    """The Sample field the decision reads: the steady-state figure unless benchmark.window is whole_pass."""
    b = task.benchmark
    return b.metric if b.window == "whole_pass" else f"steady_{b.metric}"


def planned_looks(task: Task) -> list[int]:
    b = task.benchmark
    return plan_looks(b.repetitions, b.max_repetitions, b.look_every)


def planned_repetitions(task: Task) -> int:
    return planned_looks(task)[-1]


def pass_size(task: Task, wave_seconds: float | None = None) -> int:
    """Requests per timed pass: workload.waves waves, or whole waves filling workload.duration_s at the
    measured time of one wave, or workload.num_prompts."""
    w = task.workload
    if w.waves:
        return w.waves * w.concurrency
    if w.duration_s and wave_seconds:
        return max(1, round(w.duration_s / wave_seconds)) * w.concurrency
    return w.num_prompts


async def answered(load: LoadClient, server: Server, role: str, repetition: int, prompts: list[list[int]],
                   output_len: int, concurrency: int | None, timeout_s: float, stall_s: float | None):
    """The load run of one pass (or warm-up, repetition -1); a failure to answer names the side, and what the
    harness and the machine did meanwhile (failure_circumstances)."""
    started, own_cpu, waited = time.perf_counter(), time.process_time(), cpu_pressure_s()
    try:
        return await load.run(server.endpoint, prompts, output_len, concurrency, timeout_s, stall_s)
    except ANSWER_ERRORS as exc:
        raise PassFailed(role, server.name, repetition, exc,
                         failure_circumstances(server, started, own_cpu, waited)) from None


def failure_circumstances(server: Server, started: float, own_cpu: float, waited: float | None) -> str:
    """For a pass that failed: how long it ran, the harness's own CPU seconds in it (near 0 over a long wait: the
    harness did not run, stopped or starved), the share of it in which some task of the machine waited for a CPU
    (near 100%: the machine was oversubscribed), and the states of the server's processes (T: stopped)."""
    wall = time.perf_counter() - started
    parts = [f"after {wall:.1f} s, the harness ran {time.process_time() - own_cpu:.2f} s of CPU"]
    now = cpu_pressure_s()
    if waited is not None and now is not None and wall > 0:
        parts.append(f"a task waited for a CPU {min(1.0, (now - waited) / wall):.0%} of it")
    try:  # a record of the failure, never a second one
        code = server.exit_code()
        if code is not None:
            parts.append(f"the server exited with {code}")
        else:
            states = [p.get("state", "?").split()[0] for p in snapshot(server_pid(server))["processes"]]
            parts.append(f"the server's processes: {' '.join(states) or 'none seen'}")
    except Exception as exc:  # noqa: BLE001
        parts.append(f"the server's processes unknown ({type(exc).__name__})")
    return "; ".join(parts)


async def settle(pids: dict[int, str], max_wait_s: float) -> tuple[float, dict[str, float]]:
    """Wait, at most max_wait_s, until each process tree in `pids` (pid: name) used under QUIET_CORES over one
    window; returns the seconds waited and, for those still busy then, their cores over the last window."""
    started = time.perf_counter()
    if not pids or max_wait_s <= 0:
        return 0.0, {}
    before, clock = {p: cpu_seconds(p) for p in pids}, started
    while True:
        await asyncio.sleep(QUIET_WINDOW_S)
        now = time.perf_counter()
        after = {p: cpu_seconds(p) for p in pids}
        busy = {pids[p]: round((after[p] - before[p]) / (now - clock), 2) for p in pids}
        busy = {name: cores for name, cores in busy.items() if cores >= QUIET_CORES}
        if not busy or now - started >= max_wait_s:
            return round(now - started, 3), busy
        before, clock = after, now


STEP_METRIC = "vllm:iteration_tokens_total"
METRICS_TIMEOUT_S = 5.0
STEP_LINE = re.compile(r"^vllm:iteration_tokens_total_(count|sum)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def parse_steps(text: str) -> tuple[int, int] | None:
    """(engine steps, tokens) from a Prometheus text exposition: STEP_METRIC's _count and _sum, summed over its
    label sets (one per engine); None where the metric is absent."""
    found: dict[str, float] = {}
    for match in STEP_LINE.finditer(text):
        try:
            found[match[1]] = found.get(match[1], 0.0) + float(match[2])
        except ValueError:
            continue
    return (round(found["count"]), round(found["sum"])) if "count" in found and "sum" in found else None


async def engine_counts(server: Server) -> tuple[int, int] | None:
    """The server's engine steps and the tokens they processed so far (its /metrics), read outside the clock;
    None where it serves no such metric or does not answer in METRICS_TIMEOUT_S."""
    try:
        async with server.endpoint.client(METRICS_TIMEOUT_S) as client:
            response = await client.get("/metrics")
    except (httpx.HTTPError, OSError, AttributeError):
        return None
    return parse_steps(response.text) if response.status_code == 200 else None


async def timed_pass(load: LoadClient, server: Server, role: str, repetition: int, prompts: list[list[int]],
                     output_len: int, concurrency: int | None, timeout_s: float, gpus: list[int] = (),
                     stall_s: float | None = None, idle: Server | None = None, settle_s: float = 0.0,
                     restless: set[str] | None = None, hold_idle: bool = False) -> Pass:
    """One pass; with `idle`, the other side's server, whose CPU time during the pass is recorded. With
    `hold_idle`, `idle` is frozen for the pass (first), and `server` let run (then), outside the clock. Not held,
    both servers are first given up to `settle_s` to go quiet (the work left from the last pass ends before the
    clock starts); one that does not is added to `restless` and not awaited again, its work counted in the pass.
    Held, there is no wait (benchmark.settle_s says why)."""
    own_pid = server_pid(server)
    idle_pid = server_pid(idle) if idle is not None else None
    held = hold_idle and idle is not None
    restless = set() if restless is None else restless
    waiting = {pid: who for pid, who in ((own_pid, server.name), (idle_pid, idle and idle.name))
               if pid is not None and who not in restless}
    settled_s, busy = await settle(waiting, 0.0 if held else settle_s)
    restless.update(busy)
    if held:
        idle.hold(True)  # first: a side let run before the other is frozen could be stopped again by it
    try:
        if held:
            server.hold(False)
        counts_before = await engine_counts(server)
        with gpu_state.GpuMonitor(list(gpus), gpu_state.server_pids(server) if gpus else None) as gpu:
            idle_before, own_before = cpu_seconds(idle_pid), cpu_seconds(own_pid)
            faults_before, machine_before = major_faults(own_pid), machine_cpu()
            started = time.perf_counter()
            result = await answered(load, server, role, repetition, prompts, output_len, concurrency, timeout_s,
                                    stall_s)
            seconds, completions = time.perf_counter() - started, result.completions
            idle_after, own_after = cpu_seconds(idle_pid), cpu_seconds(own_pid)
            faults_after, machine_after = major_faults(own_pid), machine_cpu()
        counts_after = await engine_counts(server) if counts_before is not None else None
    finally:
        if held:
            idle.hold(False)
    steps = None if counts_after is None else (counts_after[0] - counts_before[0], counts_after[1] - counts_before[1])
    outputs = [c.tokens for c in completions]
    short = [i for i, tokens in enumerate(outputs) if len(tokens) != output_len]
    if short:
        raise WorkMismatch(f"{role}: {len(short)} of {len(prompts)} requests did not return exactly "
                           f"{output_len} tokens (first: prompt {short[0]}, {len(outputs[short[0]])} tokens)")
    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(t) for t in outputs)
    ttft = [c.ttft_ms for c in completions if c.ttft_ms is not None]
    tpot = [c.tpot_ms for c in completions if c.tpot_ms is not None]
    state = gpu.summary()
    flags = gpu_state.flags(state)
    lanes = min(concurrency or len(prompts), len(prompts))
    window = steady_window(completions, [len(p) for p in prompts], lanes) if concurrency else None
    idle_cpu = None if idle_before is None else round(idle_after - idle_before, 3)
    flags += [f"restless: {name} still used {cores:.2f} CPU cores after {settled_s:.1f} s with no request"
              for name, cores in busy.items()]
    if idle_cpu is not None and idle_cpu / seconds > IDLE_BUSY_CORES:
        flags.append(f"neighbour busy: the other side's server used {idle_cpu / seconds:.2f} CPU cores")
    own_cpu = None if own_before is None or own_after is None else round(own_after - own_before, 3)
    faults = None if faults_before is None or faults_after is None else faults_after - faults_before
    machine = steal = None
    if machine_before is not None and machine_after is not None:
        machine = round(machine_after[0] - machine_before[0], 3)
        steal = round(machine_after[1] - machine_before[1], 3)
        if steal / seconds > STEAL_CORES:
            flags.append(f"host steal: the hypervisor took {steal / seconds:.2f} CPU cores from this machine")
        if own_cpu is not None:
            foreign = machine - own_cpu - (idle_cpu or 0.0) - result.cpu_s
            if foreign / seconds > FOREIGN_CORES:
                flags.append(f"foreign work: processes outside the benchmark used {foreign / seconds:.2f} CPU cores")
    if window is None:
        flags.append("no steady state: " + (f"{lanes} requests were never in flight before the drain" if concurrency
                                            else "no concurrency cap, every request sent at once") + "; whole pass used")
        steady = (seconds, input_tokens, output_tokens)
    else:
        steady = (window.seconds, window.input_tokens, window.output_tokens)
    sample = Sample(role=role, repetition=repetition, seconds=seconds, input_tokens=input_tokens,
                    output_tokens=output_tokens, total_tokens_per_s=(input_tokens + output_tokens) / seconds,
                    output_tokens_per_s=output_tokens / seconds, ttft_ms_p50=_percentile(ttft, 50),
                    ttft_ms_p99=_percentile(ttft, 99), tpot_ms_p50=_percentile(tpot, 50),
                    tpot_ms_p99=_percentile(tpot, 99), client_cpu_s=round(result.cpu_s, 3),
                    client_busy=round(result.busy, 3), outputs_sha256=outputs_sha256(prompts, outputs),
                    steady_seconds=steady[0], steady_total_tokens_per_s=(steady[1] + steady[2]) / steady[0],
                    steady_output_tokens_per_s=steady[2] / steady[0], gpu=state, flags=flags,
                    neighbour_cpu_s=idle_cpu, neighbour_held=held if idle is not None else None,
                    settle_s=settled_s, engine_steps=steps and steps[0],
                    step_tokens=steps and steps[1], server_cpu_s=own_cpu, machine_cpu_s=machine, steal_s=steal,
                    major_faults=faults, server_nice=priority.of(own_pid), client_nice=priority.thread_nice(),
                    max_num_seqs=_declared(server, "max_num_seqs"),
                    decoding_at_once=decoding_at_once(completions))
    return Pass(sample, prompts, outputs)


def _declared(server: Server, name: str) -> int | None:
    """An integer engine argument the server was started with, or None (unset, or a server without a spec)."""
    spec = getattr(server, "spec", None)
    value = getattr(spec, "engine_args", {}).get(name) if spec is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def warm_up(load: LoadClient, server: Server, task: Task, vocab_size: int, seed: int,
                  role: str = "incumbent") -> float | None:
    """The warm-up requests (at least one wave where passes are sized by duration); returns their seconds."""
    w = task.workload
    count = max(task.benchmark.warmup_requests, w.concurrency if w.duration_s else 0)
    if not count:
        return None
    prompts = draw_prompts(seed, count, w.input_len, vocab_size)
    started = time.perf_counter()
    await answered(load, server, role, -1, prompts, w.output_len, w.concurrency, task.benchmark.request_timeout_s,
                   task.benchmark.stall_timeout_s)
    return (time.perf_counter() - started) / math.ceil(count / (w.concurrency or count))


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
    """Interleave incumbent and candidate (ABBA order) over fresh prompts for each repetition, until the
    stopping rule decides (a fixed count where benchmark.max_repetitions is unset)."""
    with priority.raised(client_nice(incumbent, candidate)), LoadClient(task.benchmark.client_processes) as load:
        return await _compare(load, task, incumbent, candidate, vocab_size, seeds, on_sample)


def client_nice(*servers: Server) -> int | None:
    """The niceness the client times these servers at: theirs (sandbox.nice, set at their start), where the
    harness sees every one's; None (the client as it is) where not. Client processes (benchmark.client_processes)
    are started inside the raise and take it too."""
    values = [priority.of(server_pid(server)) for server in servers]
    return None if not values or None in values else max(values)


def audit_calibration_passes(task: Task) -> int:
    """The A/A's passes: audit.calibration_passes, or as many as a candidate's audit covers (its benchmark's
    repetitions, or enough passes for audit.sample requests)."""
    a = task.audit
    if a.calibration_passes:
        return a.calibration_passes
    if a.sample is None:
        return planned_repetitions(task)
    return max(1, math.ceil(a.sample / pass_size(task)))


async def calibration_passes(task: Task, server: Server, vocab_size: int, seeds: list[int]) -> list[Pass]:
    """Timed passes of the workload on one server (the baseline's A/A for the token audit)."""
    w, b = task.workload, task.benchmark
    with priority.raised(client_nice(server)), LoadClient(b.client_processes) as load:
        count = pass_size(task, await warm_up(load, server, task, vocab_size, seeds[0]))
        return [await timed_pass(load, server, "incumbent", repetition,
                                 draw_prompts(seed, count, w.input_len, vocab_size), w.output_len,
                                 w.concurrency, b.request_timeout_s, task.sandbox.gpus, b.stall_timeout_s)
                for repetition, seed in enumerate(seeds[1:])]


async def _compare(load: LoadClient, task: Task, incumbent: Server, candidate: Server, vocab_size: int,
                   seeds: list[int], on_sample: Callable[[Sample], None]) -> Comparison:
    w, b, a = task.workload, task.benchmark, task.acceptance
    wave_s = await warm_up(load, incumbent, task, vocab_size, seeds[0])
    await warm_up(load, candidate, task, vocab_size, seeds[0], "candidate")
    count = pass_size(task, wave_s)
    looks, metric = planned_looks(task), sample_metric(task)
    seeds = list(seeds) + [secrets.randbits(63) for _ in range(looks[-1] + 1 - len(seeds))]
    samples: list[Sample] = []
    kept: list[Pass] = []
    logs: list[float] = []
    signs: list[float] = []
    checked = 0
    estimate = None
    restless: set[str] = set()
    for repetition, seed in enumerate(seeds[1:looks[-1] + 1]):
        prompts = draw_prompts(seed, count, w.input_len, vocab_size)
        order = [("incumbent", incumbent), ("candidate", candidate)]
        if repetition % 2:
            order.reverse()
        passes = {}
        for (role, server), (_, other) in zip(order, order[::-1]):
            passes[role] = await timed_pass(load, server, role, repetition, prompts, w.output_len, w.concurrency,
                                            b.request_timeout_s, task.sandbox.gpus, b.stall_timeout_s, other,
                                            b.settle_s, restless, b.hold_idle)
            sample = passes[role].sample
            samples.append(sample)
            kept.append(passes[role])
            on_sample(sample)
            raise_pending()  # a stop (SIGTERM) that code on its way out swallowed
            if sample.client_busy > b.max_client_busy:
                raise HarnessBound(
                    f"{role} repetition {repetition}: a load client process was busy {sample.client_busy:.0%} of "
                    f"the pass (limit {b.max_client_busy:.0%}), so the client, not the server, may have set the "
                    f"pace; raise benchmark.client_processes (now {b.client_processes})")
        if b.check_tokens:
            if passes["candidate"].outputs != passes["incumbent"].outputs:
                raise WorkMismatch(f"repetition {repetition}: benchmark tokens differ from the incumbent's")
            checked += len(prompts)
        logs.append(math.log(getattr(passes["candidate"].sample, metric) / getattr(passes["incumbent"].sample, metric)))
        signs.append(1.0 if order[0][0] == "incumbent" else -1.0)
        if len(logs) in looks:
            estimate, sequential = sequential_estimate(logs, signs, looks, a.confidence, a.min_speedup, a.estimator)
            if sequential.stopped:
                break
    for (role, repetition), why in off_schedule(samples).items():
        next(s for s in samples if s.role == role and s.repetition == repetition).flags.append(why)
    busy = idle_work(samples, b.max_idle_cpu)
    if busy:
        raise IdleWork(busy, samples)
    moved = moved_by_code(samples)
    if moved:
        raise MovedByCode(moved, samples)
    note = (f"every request returned exactly {w.output_len} tokens"
            + (f"; {checked} outputs identical to the incumbent's" if b.check_tokens else
               "; tokens not compared with the incumbent's (batching is not invariant in this regime)"))
    return Comparison(samples, estimate, note, kept)


def report(candidate: int, task: Task, samples: list[Sample], estimate: SpeedupEstimate, proof, note: str,
           confirmation: int = 0):
    return BenchReport(candidate=candidate, metric=sample_metric(task), samples=samples,
                       speedup=estimate.speedup, ci_low=estimate.ci_low, ci_high=estimate.ci_high,
                       confidence=estimate.confidence, p_value=estimate.p_value,
                       liveness=proof.liveness if proof is not None else None,
                       output_check=note, confirmation=confirmation, sequential=estimate.sequential)
