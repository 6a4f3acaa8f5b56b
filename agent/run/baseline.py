"""The baseline phase, before the first candidate: two baseline servers must agree (self-parity), the reference's
margins are measured, the token audit's A/A is taken on the production server under the benchmark load, and the
noise floor (an A/A benchmark) says what speedup the run can see. Its result is the reference every candidate is
checked against and the first incumbent."""
from __future__ import annotations

import asyncio
import os
import secrets
from dataclasses import dataclass
from typing import Callable

from agent.proposers.base import START_LOG
from agent.run.incumbent import Incumbent
from agent.run.pool import ServerPool, ServerRequest
from agent.run.setup import RunSetup
from agent.stages import bench, noise
from agent.stages.noise import NoiseFloorFailed
from agent.stages.margins import served_margins
from agent.stages.parity import fresh_parity
from agent.stages.token_audit import calibration_refusal, run_audit
from sandbox.base import Server
from traces.errors import NightshiftError
from traces.schema import NoiseFloor, SelfParity, TokenAudit


class SetupNotDeterministic(NightshiftError):
    stage = "self_parity"


class AuditNotCalibrated(NightshiftError):
    stage = "audit"


@dataclass
class Baseline:
    reference: Server
    incumbent: Incumbent
    calibration: TokenAudit | None
    """The audit's A/A: the floor of the rate every candidate's audit is compared with (None: the audit is off)."""
    noise_floor: NoiseFloor | None


def dedicated_parity(setup: RunSetup) -> bool:
    """Parity on servers of their own (batch-invariant settings, say) beside the production ones."""
    return setup.task.parity.dedicated


def measure_baseline(setup: RunSetup, pool: ServerPool, emit: Callable) -> Baseline:
    """Self-parity, margins, the audit's A/A and the noise floor; the first incumbent is the baseline's production
    server (a parallel worker runs this on its own GPU)."""
    task, tree = setup.task, setup.baseline_tree()
    pool.trust(tree)
    args, dedicated = task.engine.args, dedicated_parity(setup)
    requests = [ServerRequest("reference", tree, args, dedicated), ServerRequest("baseline-2", tree, args, dedicated)]
    if dedicated:
        requests.append(ServerRequest("baseline-perf", tree, args))
    # The A/A's second production server, started beside the baseline's. Without dedicated parity servers the
    # reference is one already (a production baseline started independently of the incumbent).
    peers = [ServerRequest("baseline-aa", tree, args)] if task.benchmark.noise_floor and dedicated else []
    requests[-1:-1] = peers
    servers = pool.start(requests)
    save_start_log(setup, pool.start_log(servers[-1]))
    reference, second = servers[0], servers[1]
    report = fresh_parity(task, setup.vocab_size, reference, 0, second)
    margins, margins_error = (served_margins(reference, task.parity, setup.vocab_size, task.benchmark.request_timeout_s)
                              if report.ok else (None, ""))
    emit(SelfParity(ok=report.ok, prompts=report.prompts, regime=report.regime,
                    identical=report.prompts if report.ok else report.divergence.prompt_index,
                    detail="" if report.ok else report.divergence.model_dump_json(),
                    margins=margins, margins_error=margins_error))
    if not report.ok:
        raise SetupNotDeterministic(
            f"two baseline servers disagree on prompt {report.divergence.prompt_index} at token "
            f"{report.divergence.position}: greedy output is not reproducible in this setup; "
            "use a batch-invariant parity regime (parity.env / parity.args) or the sequential regime")
    if dedicated:
        pool.release(second)
    incumbent = Incumbent(setup, pool, reference, servers[-1], args, tree, emit)
    calibration = calibrate_audit(setup, reference, incumbent.server, emit)
    floor = noise_floor(setup, pool, reference, incumbent.server, servers[2:2 + len(peers)], emit)
    return Baseline(reference, incumbent, calibration, floor)


def save_start_log(setup: RunSetup, start_log: str) -> None:
    """The production server's log as it started (START_LOG, ServerPool.start_log), for the LLM proposer's opening."""
    part = setup.run_dir / f".{START_LOG}.{os.getpid()}.part"  # a parallel run's workers each write it
    part.write_text(start_log)
    part.replace(setup.run_dir / START_LOG)


def calibrate_audit(setup: RunSetup, reference: Server, production: Server, emit: Callable) -> TokenAudit | None:
    """The A/A: the baseline production server's own outputs under the benchmark load, audited on the reference
    over at least as many tokens as a candidate's audit. It refuses to start only for a disagreement far beyond
    numerics (a position past the hard bound); honest numerics are recorded and become the floor of the rate
    every candidate is compared with."""
    task, a = setup.task, setup.task.audit
    if not a.enabled:
        return None
    seeds = [secrets.randbits(63) for _ in range(bench.audit_calibration_passes(task) + 1)]
    passes = asyncio.run(bench.calibration_passes(task, production, setup.vocab_size, seeds))
    bench.save_passes(setup.run_dir / "outputs", "calibration", passes)
    calibration = run_audit(0, reference, [o for p in passes for o in p.requests()], a,
                            task.benchmark.request_timeout_s, task.acceptance.confidence, None, None, 0, True)
    emit(calibration)
    if refusal := calibration_refusal(calibration, a):
        raise AuditNotCalibrated(
            f"the reference and the production configuration disagree far beyond numerics: the baseline's own "
            f"outputs under the benchmark load fail the token audit ({refusal}); honest numerics measured stay "
            f"under 1.5 nats and 6% of tokens, so this is a wrong kernel, another model or a chaotic checkpoint, "
            f"not noise")
    return calibration


def noise_floor(setup: RunSetup, pool: ServerPool, reference: Server, production: Server, peers: list[Server],
                emit: Callable) -> NoiseFloor | None:
    """The A/A benchmark: the production server against the peer started for it, or the reference; the peer is
    released afterwards."""
    task = setup.task
    if not task.benchmark.noise_floor:
        return None
    fixed = task.model_copy(deep=True)
    fixed.benchmark.max_repetitions = None
    seeds = [secrets.randbits(63) for _ in range(task.benchmark.repetitions + 1)]
    try:
        result = asyncio.run(bench.compare(fixed, production, peers[0] if peers else reference, setup.vocab_size,
                                           seeds))
    except (bench.WorkMismatch, bench.HarnessBound, bench.NotCounted) as exc:
        raise NoiseFloorFailed(f"the baseline's A/A benchmark failed: {exc}") from None
    finally:
        for server in peers:
            pool.release(server)
    event = noise.summarize(task, result.samples, result.estimate)
    emit(event)
    return event
