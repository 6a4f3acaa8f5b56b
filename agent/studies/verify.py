"""`nightshift verify`: the baseline tree against the run branch's head, each with its own serving flags,
over a grid of input lengths x output lengths x concurrency. Every cell is the run's benchmark (paired,
interleaved passes on fresh prompts), its parity check in the task's regime, and its token audit."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import git
import numpy as np

from agent.stages import bench
from agent.replay.chain import BranchUnreadable, _open_repo, checkout_of
from agent.stages.build import build
from agent.world.checkpoint import prepare_model
from agent.world.environment import environment, hardware
from agent.studies.grid import GIB, Cell, GridPlan, context_limit, cpu_kv_space_gib, kv_bytes_per_token, plan_grid, text_config
from agent.stages.parity import ReferenceFailed, check_parity
from agent.world.paths import cache_root
from agent.run.pool import ServerPool, ServerRequest
from agent.run.preflight import check_model_fits
from agent.stages.completions import ANSWER_ERRORS, draw_prompts
from agent.stages.stats import estimate_speedup
from agent.run.relaxed import describe as describe_relaxed, relaxed
from agent.world.task import Task, Workload, Benchmark, parse_task, with_overrides, with_settings
from agent.stages.token_audit import audit_passed, describe, run_audit
from agent.run.workspace import Workspace, serve_args_at
from sandbox import make_sandbox
from sandbox.base import Server
from traces import read_trace
from traces.errors import NightshiftError

FORMAT = 1
METRICS = {"total_token_throughput": "total_tokens_per_s", "output_throughput": "output_tokens_per_s",
           "request_throughput": None}
LATENCIES = {"median_ttft_ms": "ttft_ms_p50", "p99_ttft_ms": "ttft_ms_p99", "median_tpot_ms": "tpot_ms_p50",
             "p99_tpot_ms": "tpot_ms_p99"}
DEFAULT_MAX_NUM_SEQS = 256


class VerifyError(NightshiftError):
    stage = "verify"


@dataclass
class Target:
    task: Task
    repo: git.Repo
    base: str
    head: str
    base_ref: str
    head_ref: str
    run_dir: Path
    """Where report.html goes; verify.json and verify.md go to its verify/ folder."""
    run_id: str
    model_sha256: str | None = None
    """The run's model, which the checkpoint prepared now must match."""
    settings: list[str] = field(default_factory=list)
    """`--set` overrides applied to the task for this verify."""
    relaxed: list[dict] = field(default_factory=list)
    """The checks those overrides loosen (agent/run/relaxed.py), against the task's defaults and the task before."""

    def set(self, settings: list[str]) -> None:
        """Apply `--set` overrides to the task, and note the checks they loosen."""
        before, self.task = self.task, with_settings(self.task, list(settings))
        self.settings, self.relaxed = list(settings), relaxed(self.task, before)

    @property
    def out_dir(self) -> Path:
        return self.run_dir / "verify"


def _commit(repo: git.Repo, ref: str, what: str) -> str:
    try:
        return repo.git.rev_parse("--verify", "--quiet", f"{ref}^{{commit}}")
    except git.GitCommandError:
        raise VerifyError(f"{what} {ref!r} is not a commit in {repo.working_dir or repo.git_dir}") from None


def _check_moved(repo: git.Repo, base: str, head: str, head_ref: str) -> None:
    if base == head or not repo.git.rev_list(f"{base}..{head}"):
        raise VerifyError(f"{head_ref} has no commits over its base {base[:12]}: nothing to verify")


def run_target(run_dir: Path, base: str | None = None, head: str | None = None) -> Target:
    """A run's baseline (its base commit) and its branch's head, from the run's checkout or packed bundle."""
    run_dir = Path(run_dir).resolve()  # the worktrees go under it, and git runs in the checkout
    records = read_trace(run_dir / "trace.jsonl")
    started = records[0].event
    task = parse_task(started.task, f"{run_dir}/trace.jsonl (run_started.task)")
    try:
        repo = _open_repo(Path(run_dir), records)
        repo.git.rev_parse("--git-dir")
    except (git.GitError, git.NoSuchPathError) as exc:
        raise BranchUnreadable(f"cannot read branch {started.branch} in {checkout_of(records)}: {exc}") from None
    base_ref, head_ref = base or started.base_commit, head or started.branch
    base_sha, head_sha = _commit(repo, base_ref, "base"), _commit(repo, head_ref, "head")
    _check_moved(repo, base_sha, head_sha, f"branch {head_ref}")
    return Target(task, repo, base_sha, head_sha, base_ref, head_ref, run_dir, started.run_id,
                  started.model_sha256)


def checkout_target(checkout: Path, base: str, head: str, task: Task, runs_dir: Path) -> Target:
    """Two refs of a vLLM checkout, outside any run: the results go to RUNS_DIR/verify-<time>/."""
    try:
        repo = git.Repo(checkout)
    except (git.GitError, git.NoSuchPathError):
        raise VerifyError(f"{checkout} is not a git checkout") from None
    base_sha, head_sha = _commit(repo, base, "--base"), _commit(repo, head, "--head")
    _check_moved(repo, base_sha, head_sha, head)
    run_id = "verify-" + time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
    return Target(task, repo, base_sha, head_sha, base, head, Path(runs_dir).resolve() / run_id, run_id)


@contextmanager
def tree_at(repo: git.Repo, commit: str, path: Path, changed: list[str] = (),
            bytecode_from: Path | None = None, link: bool = True) -> Iterator[Path]:
    """A built worktree of `commit`, removed on exit."""
    workspace = Workspace(repo, "verify", path.parent)  # the checkout ignores linked compiled parts
    path.parent.mkdir(parents=True, exist_ok=True)
    workspace.add(path, commit)
    try:
        build(0, path, list(changed), bytecode_from=bytecode_from, link=link)
        yield path
    finally:
        workspace.remove(path)


def kv_budget(task: Task) -> int | None:
    """The most KV cache a verify server gets: verify.kv_cache_gib, else what the task itself sets."""
    if task.verify.kv_cache_gib:
        return int(task.verify.kv_cache_gib * GIB)
    if task.engine.args.get("kv_cache_memory_bytes"):
        return int(task.engine.args["kv_cache_memory_bytes"])
    if task.engine.env.get("VLLM_CPU_KVCACHE_SPACE"):
        return int(float(task.engine.env["VLLM_CPU_KVCACHE_SPACE"]) * GIB)
    return None


def sized(task: Task, plan: GridPlan, args: dict) -> tuple[dict, dict]:
    """(engine args, env) of a verify server: the plan's context length and KV cache."""
    args, env = {**args, "max_model_len": plan.max_model_len}, dict(task.engine.env)
    if plan.kv_cache_bytes is not None:
        if "kv_cache_memory_bytes" in args:
            args["kv_cache_memory_bytes"] = max(int(args["kv_cache_memory_bytes"]), plan.kv_cache_bytes)
        elif not task.sandbox.gpus:
            configured = float(env.get("VLLM_CPU_KVCACHE_SPACE") or 0)
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv_space_gib(plan, configured))
    return args, env


def cell_task(task: Task, cell: Cell, repetitions: int) -> Task:
    """The task's benchmark with the cell's workload and a fixed number of paired repetitions."""
    v = task.verify
    workload = {"num_prompts": max(v.min_prompts, v.waves * cell.concurrency), "input_len": cell.input_len,
                "output_len": cell.output_len, "concurrency": cell.concurrency, "waves": None, "duration_s": None}
    benchmark = {"repetitions": repetitions, "max_repetitions": None, "window": "whole_pass"}
    return with_overrides(task, workload={k: x for k, x in workload.items() if k in Workload.model_fields},
                          benchmark={k: x for k, x in benchmark.items() if k in Benchmark.model_fields})


def side(samples: list, prompts: int) -> dict:
    """One server's passes in `vllm bench serve` terms (medians over the passes)."""
    med = lambda values: float(np.median(values)) if values else None  # noqa: E731
    out = {"completed": prompts, "passes": len(samples), "duration": med([s.seconds for s in samples]),
           "total_input_tokens": samples[0].input_tokens, "total_output_tokens": samples[0].output_tokens,
           "request_throughput": med([prompts / s.seconds for s in samples])}
    for key, attr in METRICS.items():
        if attr:
            out[key] = med([getattr(s, attr) for s in samples])
    for key, attr in LATENCIES.items():
        out[key] = med([getattr(s, attr) for s in samples if getattr(s, attr) is not None])
    return out


def speedups(samples: list, prompts: int, confidence: float) -> dict:
    base = [s for s in samples if s.role == "incumbent"]
    head = [s for s in samples if s.role == "candidate"]
    out = {}
    for key, attr in METRICS.items():
        value = (lambda s: prompts / s.seconds) if attr is None else (lambda s, f=attr: getattr(s, f))
        e = estimate_speedup([value(s) for s in head], [value(s) for s in base], 1.0, confidence)
        out[key] = {"speedup": e.speedup, "ci_low": e.ci_low, "ci_high": e.ci_high, "p_value": e.p_value}
    for key, attr in LATENCIES.items():
        b = [getattr(s, attr) for s in base if getattr(s, attr)]
        h = [getattr(s, attr) for s in head if getattr(s, attr)]
        out[key] = {"ratio": float(np.median(h) / np.median(b))} if b and h else None
    return out


class Servers:
    """The verify servers, started through the pool (which owns their end), with a progress bar."""

    def __init__(self, pool: ServerPool, progress):
        self.pool, self.progress = pool, progress

    def start(self, requests: list[ServerRequest]) -> dict[str, Server]:
        self.progress.servers(len(requests))
        started: dict[str, Server] = {}
        if not self.pool.task.sandbox.parallel_starts:
            for request in requests:
                started[request.name] = self.pool.start([request])[0]
                self.progress.server_up(request.name)
            return started
        failure = None
        with ThreadPoolExecutor(len(requests)) as threads:
            futures = {threads.submit(self.pool.start, [r]): r.name for r in requests}
            for future in as_completed(futures):
                try:
                    started[futures[future]] = future.result()[0]
                    self.progress.server_up(futures[future])
                except Exception as exc:
                    failure = failure or exc
        if failure:
            raise failure
        return started


class Cells:
    def __init__(self, target: Target, plan: GridPlan, servers: dict[str, Server], vocab_size: int,
                 repetitions: int):
        self.t, self.plan, self.vocab, self.repetitions = target, plan, vocab_size, repetitions
        self.baseline, self.head = servers["baseline"], servers["head"]
        self.reference = servers.get("reference", self.baseline)
        self.head_parity = servers.get("head-parity", self.head)
        self.parities: dict[tuple[int, int], dict] = {}

    def parity(self, cell: Cell) -> dict:
        """Exact greedy parity at the cell's lengths in the task's regime (once per input/output pair)."""
        key = (cell.input_len, cell.output_len)
        if key not in self.parities:
            p, timeout = self.t.task.parity, self.t.task.benchmark.request_timeout_s
            prompts = draw_prompts(secrets.randbits(63), p.num_prompts, cell.input_len, self.vocab)
            report = asyncio.run(check_parity(0, self.reference, self.head_parity, prompts, cell.output_len,
                                              p.regime, timeout))
            self.parities[key] = report.model_dump()
        return self.parities[key]

    def measure(self, cell: Cell) -> dict:
        task = self.t.task
        result = {"input_len": cell.input_len, "output_len": cell.output_len, "concurrency": cell.concurrency,
                  "key": cell.key}
        if cell.skipped:
            return skipped(cell)
        run = cell_task(task, cell, self.repetitions)
        prompts = run.workload.num_prompts
        seeds = [secrets.randbits(63) for _ in range(self.repetitions + 1)]
        try:
            comparison = asyncio.run(bench.compare(run, self.baseline, self.head, self.vocab, seeds))
            parity = self.parity(cell)
            a = task.audit
            token_audit = run_audit(0, self.reference, comparison.outputs("candidate"), a,
                                    task.benchmark.request_timeout_s, task.acceptance.confidence,
                                    comparison.outputs("incumbent"))
        except (bench.WorkMismatch, bench.HarnessBound, ReferenceFailed, RuntimeError, *ANSWER_ERRORS) as exc:
            return {**result, "status": "failed", "reason": f"{type(exc).__name__}: {exc}", "regression": False}
        samples = comparison.samples
        gains = speedups(samples, prompts, task.acceptance.confidence)
        primary = gains["total_token_throughput"]
        audit_ok = audit_passed(token_audit)
        status = "ok" if parity["ok"] and audit_ok else "failed"
        reasons = ([] if parity["ok"] else [f"parity: {_divergence(parity)}"]) + \
            ([] if audit_ok else [f"audit: {describe(token_audit)}"])
        return {**result, "status": status, "reason": "; ".join(reasons), "num_prompts": prompts,
                "regression": primary["ci_high"] < 1.0, "improvement": primary["ci_low"] > 1.0,
                "relative": primary["speedup"], "baseline": side([s for s in samples if s.role == "incumbent"], prompts),
                "head": side([s for s in samples if s.role == "candidate"], prompts), "speedup": gains,
                "parity": parity, "audit": token_audit.model_dump(exclude={"violations", "side", "control"})
                | {"passed": audit_ok, "first_violation": describe(token_audit) if not audit_ok else ""},
                "samples": [s.model_dump(include={"role", "repetition", "seconds", "input_tokens", "output_tokens",
                                                  "total_tokens_per_s", "output_tokens_per_s", "ttft_ms_p50",
                                                  "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "client_busy"})
                            for s in samples]}


def skipped(cell: Cell) -> dict:
    return {"input_len": cell.input_len, "output_len": cell.output_len, "concurrency": cell.concurrency,
            "key": cell.key, "status": "skipped", "reason": cell.skipped, "regression": False}


def _divergence(parity: dict) -> str:
    d = parity["divergence"]
    return (f"prompt {d['prompt_index']} diverges at token {d['position']}: expected {d['expected']}, "
            f"got {d['got']}")


def plan_for(task: Task, config: dict, arg_sets: list[dict], input_lens, output_lens, concurrency) -> GridPlan:
    seqs = max(int(args.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS) for args in arg_sets)
    return plan_grid(input_lens, output_lens, concurrency, model_limit=context_limit(config),
                     kv_per_token=kv_bytes_per_token(config, task.model.dtype), kv_budget_bytes=kv_budget(task),
                     max_num_seqs=seqs)


def verify(target: Target, input_lens: list[int], output_lens: list[int], concurrency: list[int],
           repetitions: int | None, progress, sandbox=None, link: bool = True) -> dict:
    """Measure the grid, write verify.json and verify.md; returns what verify.json holds. `sandbox` and
    `link` stand in for the task's backend and the installed vLLM's compiled parts (a test's stand-in)."""
    task = target.task
    model = prepare_model(task)
    if target.model_sha256 and model.sha256 != target.model_sha256:
        raise VerifyError(f"the model prepared now (sha256 {model.sha256[:12]}) is not the run's "
                          f"({target.model_sha256[:12]})")
    config = json.loads((model.path / "config.json").read_text())
    vocab = int(text_config(config).get("vocab_size") or config["vocab_size"])
    base_args = serve_args_at(target.repo, target.base) or dict(task.engine.args)
    head_args = serve_args_at(target.repo, target.head) or dict(task.engine.args)
    plan = plan_for(task, config, [base_args, head_args], input_lens, output_lens, concurrency)
    repetitions = repetitions or task.verify.repetitions or task.benchmark.repetitions
    started = time.time()
    results = (_measure(target, plan, model.path, base_args, head_args, vocab, repetitions, progress, sandbox, link)
               if plan.runnable else [skipped(c) for c in plan.cells])
    data = {"format": FORMAT, "run_id": target.run_id, "task": task.name,
            "settings": target.settings, "relaxed": target.relaxed,
            "base": {"ref": target.base_ref, "commit": target.base, "engine_args": base_args},
            "head": {"ref": target.head_ref, "commit": target.head, "engine_args": head_args},
            "environment": environment(task, model.sha256, plan.max_model_len or None),
            "grid": {"input_lens": sorted(set(input_lens)), "output_lens": sorted(set(output_lens)),
                     "concurrency": sorted(set(concurrency)), "repetitions": repetitions,
                     "max_model_len": plan.max_model_len, "kv_cache_bytes": plan.kv_cache_bytes,
                     "kv_bytes_per_token": plan.kv_bytes_per_token, "notes": plan.notes},
            "metric": "total_token_throughput", "confidence": task.acceptance.confidence,
            "min_speedup": task.acceptance.min_speedup,
            "parity_regime": task.parity.regime, "audit_tolerance_nats": task.audit.hard_bound_nats,
            "audit_rate_ratio": task.audit.rate_ratio,
            "seconds": round(time.time() - started, 1), "cells": results}
    data["regressions"] = [c["key"] for c in results if c.get("regression")]
    data["failed"] = [c["key"] for c in results if c["status"] == "failed"]
    data["skipped"] = [c["key"] for c in results if c["status"] == "skipped"]
    target.out_dir.mkdir(parents=True, exist_ok=True)
    (target.out_dir / "verify.json").write_text(json.dumps(data, indent=2))
    (target.out_dir / "verify.md").write_text(markdown(data))
    return data


def _measure(target: Target, plan: GridPlan, model_dir: Path, base_args: dict, head_args: dict, vocab: int,
             repetitions: int, progress, sandbox, link: bool) -> list[dict]:
    task = target.task
    base_args, env = sized(task, plan, base_args)
    head_args, _ = sized(task, plan, head_args)
    serving = with_overrides(task, model={"max_model_len": plan.max_model_len}, engine={"env": env})
    changed = [p for p in target.repo.git.diff("--name-only", target.base, target.head).splitlines() if p]
    trees = target.out_dir / "worktrees"
    dedicated = task.parity.dedicated
    with ExitStack() as stack:
        base_tree = stack.enter_context(tree_at(target.repo, target.base, trees / "baseline", link=link))
        head_tree = stack.enter_context(tree_at(target.repo, target.head, trees / "head", changed, base_tree, link))
        sandbox = sandbox or make_sandbox(task.sandbox, target.out_dir)
        pool = stack.enter_context(ServerPool(serving, sandbox, model_dir,
                                              target.run_id, cache_root() / "compile-caches" /
                                              f"vllm-{task.target.vllm_version}"))
        pool.trust(base_tree)
        requests = [ServerRequest("baseline", base_tree, base_args), ServerRequest("head", head_tree, head_args)]
        if dedicated:
            requests += [ServerRequest("reference", base_tree, base_args, parity=True),
                         ServerRequest("head-parity", head_tree, head_args, parity=True)]
        else:  # the audit scores both sides on a server that is neither, as a run's does: a GPU server scores its
            # own outputs closest (near ties ranked by the kernels it picked), so the baseline would favour itself
            requests.append(ServerRequest("reference", base_tree, base_args))
        check_model_fits(task, model_dir, [(r.name, pool.spec(r).engine_args) for r in requests])  # as started
        servers = Servers(pool, progress).start(requests)
        cells = Cells(target, plan, servers, vocab, repetitions)
        progress.cells(len(plan.cells))
        results = []
        for cell in plan.cells:
            progress.cell_started(cell)
            results.append(cells.measure(cell))
            progress.cell_done(results[-1])
    return results


def relative_text(cell: dict) -> str:
    if cell["status"] == "skipped":
        return f"skipped: {cell['reason']}"
    if "speedup" not in cell:
        return f"failed: {cell['reason']}"
    s = cell["speedup"]["total_token_throughput"]
    text = f"{s['speedup']:.3f}x [{s['ci_low']:.3f}, {s['ci_high']:.3f}]"
    if cell["regression"]:
        text = f"**REGRESSION** {text}"
    if cell["status"] == "failed":
        text += f" FAILED ({cell['reason']})"
    return text


def markdown(data: dict) -> str:
    env, grid = data["environment"], data["grid"]
    lines = [f"# verify {data['run_id']}: {data['task']}", "",
             f"head {data['head']['ref']} ({data['head']['commit'][:12]}) against base {data['base']['ref']} "
             f"({data['base']['commit'][:12]}); relative total token throughput (head / base), "
             f"{data['confidence']:.0%} interval, {grid['repetitions']} paired passes per cell.", "",
             f"{hardware(env)}; vLLM {env['vllm']}, torch {env['torch']}, {env['dtype']}, max_model_len "
             f"{env['max_model_len']}, nightshift {env['nightshift']}, model {env['model_sha256'][:12]}"
             + (f"; task overrides: {', '.join(data['settings'])}" if data.get("settings") else "")
             + (f"; relaxed: {'; '.join(map(describe_relaxed, data['relaxed']))}" if data.get("relaxed") else ""), "",
             "| input | output | " + " | ".join(f"c={c}" for c in grid["concurrency"]) + " |",
             "|---|---|" + "---|" * len(grid["concurrency"])]
    by_key = {(c["input_len"], c["output_len"], c["concurrency"]): c for c in data["cells"]}
    for i in grid["input_lens"]:
        for o in grid["output_lens"]:
            row = [relative_text(by_key[(i, o, c)]) for c in grid["concurrency"]]
            lines.append(f"| {i} | {o} | " + " | ".join(row) + " |")
    lines += ["", f"regressions: {', '.join(data['regressions']) or 'none'}",
              f"failed: {', '.join(data['failed']) or 'none'}",
              f"skipped: {', '.join(data['skipped']) or 'none'}", ""]
    return "\n".join(lines)
