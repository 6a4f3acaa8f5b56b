"""`nightshift noise`: what this machine's benchmark can see. Two copies of the baseline's production server
(and one server per given patch, a known slowdown say, and with the audit on the audit's reference, started as a
run's: neither side of any benchmark) start once; then `aa` A/A benchmarks and `repeat`
benchmarks of each patch run back to back, each exactly as a run benchmarks a candidate (fresh prompts, ABBA,
the task's window and stopping rule). The A/As give the false-accept rate and the minimum detectable effect;
the patches, the rate at which a known effect is detected. The study is a run folder without candidates:
its trace holds run_started, one noise_floor per A/A and run_finished; noise.json and noise.md the rest."""
from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from pathlib import Path
from typing import Callable

import numpy as np

from agent.stages import bench

from agent.stages import liveness

from agent.stages import noise
from agent.stages.build import build
from agent.world.environment import environment, hardware
from agent.run.pool import ServerPool, ServerRequest
from agent.run.setup import RunSetup
from agent.stages.stats import accepts
from agent.stages.token_audit import run_audit
from sandbox import make_sandbox
from traces.errors import NightshiftError, end_reason
from traces.schema import RunFinished


class StudyError(NightshiftError):
    stage = "noise"


def patch_name(path: Path) -> str:
    return Path(path).stem


def measure(s: RunSetup, incumbent, other, label: str, index: int) -> dict:
    task = s.task
    seeds = [secrets.randbits(63) for _ in range(task.benchmark.repetitions + 1)]
    result = asyncio.run(bench.compare(task, incumbent, other, s.vocab_size, seeds))
    est, metric = result.estimate, bench.sample_metric(task)
    first = [getattr(x, metric) for x in result.samples if x.role == "incumbent"]
    second = [getattr(x, metric) for x in result.samples if x.role == "candidate"]
    return {"label": label, "index": index, "pairs": len(first), "speedup": est.speedup, "ci_low": est.ci_low,
            "ci_high": est.ci_high, "p_value": est.p_value, "accepted": accepts(est.ci_low, task.acceptance.min_speedup),
            "slower": est.ci_high < 1.0, "faster": est.ci_low > 1.0,
            "log_ratios": [math.log(b / a) for a, b in zip(first, second)],
            "samples": [x.model_dump() for x in result.samples], "result": result}


def audit_calibration(s: RunSetup, reference, production):
    """The run's A/A of the token audit: the baseline copy that every benchmark compares against, its outputs
    under the benchmark load scored on the reference, recorded in the trace; None where the task's audit is off."""
    if reference is None:
        return None
    seeds = [secrets.randbits(63) for _ in range(bench.audit_calibration_passes(s.task) + 1)]
    passes = asyncio.run(bench.calibration_passes(s.task, production, s.vocab_size, seeds))
    event = run_audit(0, reference, [o for p in passes for o in p.requests()], s.task.audit,
                      s.task.benchmark.request_timeout_s, s.task.acceptance.confidence, is_calibration=True)
    s.trace.append(event)
    return event


def audit_row(s: RunSetup, reference, result, calibration, index: int) -> dict:
    """One benchmark's token audit, exactly as a candidate's: the other side's outputs against this side's, both
    scored on the reference."""
    event = run_audit(index, reference, result.outputs("candidate"), s.task.audit, s.task.benchmark.request_timeout_s,
                      s.task.acceptance.confidence, result.outputs("incumbent"), calibration)
    s.trace.append(event)
    v = event.verdict
    return {"passed": v.passed, "test": v.test, "tokens": event.tokens, "non_top1": event.deficits.non_top1,
            "max_deficit": event.deficits.max, "control_tokens": event.control.tokens,
            "control_non_top1": event.control.non_top1, "control_max_deficit": max(event.control.values, default=0.0),
            "reference": v.reference, "rate_p_value": v.rate_p_value, "concentration_p_value": v.concentration_p_value}


def pooled_sd(sds: list[float]) -> float:
    """Benchmarks' per-pair log-ratio SDs pooled (the root of their mean variance); nan for none."""
    return float(np.sqrt(np.mean(np.square(sds)))) if sds else float("nan")


def summarize(task, rows: list[dict], patches: list[str]) -> dict:
    """The study's counts. A benchmark the rules do not count (`not_counted`: a candidate's would be rejected at
    `benchmark`) is counted apart, and left out of the speedups and the spread."""
    a = task.acceptance
    dropped = {label: sum(r["label"] == label for r in rows if "not_counted" in r) for label in ["A/A", *patches]}
    rows = [r for r in rows if "not_counted" not in r]
    aa = [r for r in rows if r["label"] == "A/A"]
    sd = pooled_sd([r["log_ratio_sd"] for r in aa])
    n, known = task.benchmark.repetitions, bool(aa)
    summary = {"a_a": {"benchmarks": len(aa), "false_accepts": sum(r["accepted"] for r in aa),
                       "interval_excludes_one": sum(r["slower"] or r["faster"] for r in aa),
                       "speedups": [round(r["speedup"], 4) for r in aa],
                       "pooled_log_ratio_sd": sd, "pairs_per_benchmark": n,
                       "mde_speedup": math.exp(noise.mde_log(sd, n, a.confidence)) if known else None,
                       "mde_speedup_at_max": (math.exp(noise.mde_log(sd, task.benchmark.max_repetitions, a.confidence))
                                              if known and task.benchmark.max_repetitions else None),
                       "pairs_for_min_speedup": noise.pairs_needed(sd, a.min_speedup, a.confidence) if known else None,
                       "power": noise.POWER, "not_counted": dropped["A/A"]}, "patches": {}}
    audited = [r for r in aa if "audit" in r]
    if audited:
        summary["a_a"]["audit"] = {"benchmarks": len(audited), "false_rejects": sum(not r["audit"]["passed"] for r in audited),
                                   "non_top1": [r["audit"]["non_top1"] for r in audited],
                                   "control_non_top1": [r["audit"]["control_non_top1"] for r in audited],
                                   "tokens": audited[0]["audit"]["tokens"],
                                   "max_deficit": max(r["audit"]["max_deficit"] for r in audited)}
    for name in patches:
        mine = [r for r in rows if r["label"] == name]
        mean = float(np.mean([r["speedup"] for r in mine])) if mine else float("nan")
        direction = "slower" if mean < 1 else "faster"
        summary["patches"][name] = {"audit_rejects": sum("audit" in r and not r["audit"]["passed"] for r in mine),
                                    "benchmarks": len(mine), "mean_speedup": mean, "direction": direction,
                                    "detected": sum(r[direction] for r in mine), "accepted": sum(r["accepted"] for r in mine),
                                    "speedups": [round(r["speedup"], 4) for r in mine],
                                    "not_counted": dropped[name]}
    return summary


def markdown(data: dict) -> str:
    aa = data["summary"]["a_a"]
    lines = [f"# noise study {data['run_id']}: {data['task']}", "",
             f"{hardware(data['environment'])}, vLLM {data['environment']['vllm']}; {aa['pairs_per_benchmark']} paired repetitions per benchmark, metric "
             f"{data['metric']}, acceptance: interval above {data['min_speedup']} at {data['confidence']:.0%}.", "",
             "| benchmark | speedup | interval | pairs | accepted |", "|---|---|---|---|---|"]
    for r in data["benchmarks"]:
        if "not_counted" in r:
            lines.append(f"| {r['label']} #{r['index']} | not counted: {r['not_counted']} | | | no |")
            continue
        lines.append(f"| {r['label']} #{r['index']} | {r['speedup']:.4f} | [{r['ci_low']:.4f}, {r['ci_high']:.4f}] "
                     f"| {r['pairs']} | {'yes' if r['accepted'] else 'no'} |")
    mde = f"{aa['mde_speedup']:.4f}x" if aa["mde_speedup"] else "n/a"
    lines += ["", f"A/A: {aa['benchmarks']} benchmarks, {aa['false_accepts']} false accepts, "
                  f"{aa['interval_excludes_one']} intervals excluding 1, {aa.get('not_counted', 0)} not counted; pooled per-pair log-ratio SD "
                  f"{aa['pooled_log_ratio_sd']:.4f} (net of the order term); minimum detectable effect {mde} at {aa['power']:.0%} power; "
                  f"pairs for {data['min_speedup']}x: {aa['pairs_for_min_speedup']}"]
    if "audit" in aa:
        au = aa["audit"]
        lines.append(f"Token audit of each A/A (the second copy against the first, as a candidate against its "
                     f"control): {au['false_rejects']} of {au['benchmarks']} rejected; non-top-1 tokens per "
                     f"{au['tokens']}: {au['non_top1']} (controls {au['control_non_top1']}), max deficit "
                     f"{au['max_deficit']:.3f} nats")
    for name, p in data["summary"]["patches"].items():
        lines.append(f"{name}: mean {p['mean_speedup']:.4f}x, detected {p['direction']} in {p['detected']} of "
                     f"{p['benchmarks']}, accepted {p['accepted']}, {p.get('not_counted', 0)} not counted"
                     + (f"; NEVER IMPORTED: {p['never_imported']}" if p.get("never_imported") else ""))
    return "\n".join(lines) + "\n"


REVERSED = " reversed"
"""A patch's label with this suffix: benchmarked with the patched server as the incumbent and the baseline's copy
as the candidate, so a known slowdown of x is a known speedup of 1/x."""


def study(s: RunSetup, aa: int, patches: list[Path], repeat: int, sandbox=None,
          on_line: Callable[[str], None] = print, both_ways: bool = False) -> dict:
    if aa < 2 and not patches:
        raise StudyError("a noise study needs at least 2 A/A benchmarks (--aa) or a patch (--patch)")
    texts = {}
    for path in patches:
        if not Path(path).is_file():
            raise StudyError(f"patch file not found: {path}")
        texts[patch_name(path)] = Path(path).read_text()
    began = time.time()
    s.trace.append(s.run_started())
    args, rows, missing = dict(s.task.engine.args), [], {}
    pool = ServerPool(s.task, sandbox or make_sandbox(s.task.sandbox, s.run_dir), s.model.path, s.run_id,
                      s.cache_seed, s.run_dir / "server_starts.jsonl")
    reason = "noise study finished"
    try:
        with pool:
            base = s.baseline_tree()
            pool.trust(base)
            requests = [ServerRequest("baseline", base, args), ServerRequest("baseline-aa", base, args)]
            audited = s.task.audit.enabled
            patched = {}
            for i, (name, text) in enumerate(texts.items(), 1):
                tree = s.workspace.worktree(name)
                patched[name] = (tree, s.workspace.apply(tree, text))
                build(i, tree, patched[name][1], bytecode_from=base, link=s.linked)
                requests.append(ServerRequest(name, tree, args))
            if audited:  # the audit's reference, as a run's: neither side of any benchmark (baseline.py)
                requests.append(ServerRequest("reference", base, args, s.task.parity.dedicated))
            servers = pool.start(requests)
            reference = servers[-1] if audited else None
            calibration = audit_calibration(s, reference, servers[0])
            plan = [("A/A", servers[0], servers[1], k) for k in range(aa)]
            for i, name in enumerate(texts):
                for k in range(repeat):  # both ways: alternately, so that the two directions see the same hours
                    plan.append((name, servers[0], servers[2 + i], k))
                    if both_ways:
                        plan.append((name + REVERSED, servers[2 + i], servers[1], k))
            for label, first, other, k in plan:
                try:
                    row = measure(s, first, other, label, k)
                except bench.NotCounted as exc:  # a candidate's benchmark would be rejected here: recorded, go on
                    rows.append({"label": label, "index": k, "accepted": False, "not_counted": str(exc),
                                 "samples": [x.model_dump() for x in exc.samples]})
                    on_line(f"{label} #{k}: not counted: {exc}")
                    continue
                if calibration is not None:
                    row["audit"] = audit_row(s, reference, row["result"], calibration, len(rows) + 1)
                floor = noise.summarize(s.task, row["result"].samples, row["result"].estimate)
                row["log_ratio_sd"] = floor.log_ratio_sd  # net of the order term
                if label == "A/A":
                    s.trace.append(floor)
                del row["result"]
                rows.append(row)
                on_line(f"{label} #{k}: {row['speedup']:.4f}x [{row['ci_low']:.4f}, {row['ci_high']:.4f}], "
                        f"{row['pairs']} pairs{', accepted' if row['accepted'] else ''}"
                        + (f"; audit {row['audit']['test']}: {row['audit']['non_top1']} of {row['audit']['tokens']} "
                           f"not top-1 against the control's {row['audit']['control_non_top1']}"
                           if "audit" in row else ""))
            for i, (name, (tree, files)) in enumerate(patched.items()):
                proof = liveness.check(servers[2 + i], tree, files)  # an effect never imported is no effect
                missing[name] = proof.missing
    except BaseException as exc:
        reason = end_reason(exc)  # a signal reads as a stop ("stopped by SIGTERM"), anything else as an error
        raise
    finally:
        s.trace.append(RunFinished(reason=reason, candidates=0, kept=0, best_speedup=1.0,
                                   head_commit=s.base_commit, seconds=round(time.time() - began, 1)))
        if rows:
            write(s, rows, [n + suffix for n in texts for suffix in ("", REVERSED) if both_ways or not suffix],
                  missing)
    return json.loads((s.run_dir / "noise.json").read_text())


def write(s: RunSetup, rows: list[dict], patches: list[str], missing: dict[str, list[str]]) -> None:
    t = s.task
    data = {"run_id": s.run_id, "task": t.name, "environment": environment(t, s.model.sha256), "metric": bench.sample_metric(t),
            "min_speedup": t.acceptance.min_speedup, "confidence": t.acceptance.confidence,
            "workload": t.workload.model_dump(), "summary": summarize(t, rows, patches), "benchmarks": rows}
    for name, files in missing.items():
        data["summary"]["patches"][name]["never_imported"] = files
    (s.run_dir / "noise.json").write_text(json.dumps(data, indent=1))
    (s.run_dir / "noise.md").write_text(markdown(data))
