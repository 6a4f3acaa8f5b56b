"""Where the baseline's time goes: a short profiled run of the task's model, summarized.

One offline vLLM engine (in-process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, the task's engine
args) generates a small slice of the task's workload twice: once under cProfile (the Python
functions of vLLM by self and cumulative time: what the LLM proposer can edit) and once under
torch.profiler (the top CPU ops). It runs in a child process with a timeout, once per
(vLLM version, model, engine args, workload), and is cached as JSON under the nightshift cache.

    python -m agent.proposers.profile --task tasks/gemma4-tiny-cpu.yaml      # prints the summary
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from agent.world.checkpoint import prepare_model
from agent.world.paths import cache_root
from traces.errors import NightshiftError


class HotFunction(BaseModel):
    file: str
    """Relative to the checkout root: vllm/..."""
    line: int
    name: str
    calls: int
    self_s: float
    cum_s: float


class HotOp(BaseModel):
    name: str
    calls: int
    self_ms: float
    total_ms: float


class Profile(BaseModel):
    source: str
    seconds: float = 0.0
    prompts: int = 0
    output_tokens: int = 0
    functions: list[HotFunction] = Field(default_factory=list)
    """By self time, vLLM's own files only."""
    cumulative: list[HotFunction] = Field(default_factory=list)
    """By cumulative time, vLLM's own files only."""
    ops: list[HotOp] = Field(default_factory=list)
    note: str = ""

    def hot_files(self) -> list[str]:
        """vLLM files in order of the time spent in them (self time first, then cumulative)."""
        seen: dict[str, None] = {}
        for fn in [*self.functions, *self.cumulative]:
            seen.setdefault(fn.file, None)
        return list(seen)

    def hot_lines(self, file: str) -> list[int]:
        """The first lines of the file's profiled functions, hottest (by self time) first."""
        return list(dict.fromkeys(fn.line for fn in [*self.functions, *self.cumulative] if fn.file == file))

    def summary(self, max_functions: int = 15, max_ops: int = 10) -> str:
        lines = [f"{self.source}: {self.prompts} prompts, {self.output_tokens} output tokens in "
                 f"{self.seconds:.2f}s (profiled)."]
        if self.note:
            lines.append(self.note)
        if self.functions:
            lines.append("vLLM Python functions by self time (file:line function  calls  self_s  cum_s):")
            lines += [f"  {f.file}:{f.line} {f.name}  {f.calls}  {f.self_s:.3f}  {f.cum_s:.3f}"
                      for f in self.functions[:max_functions]]
        if self.cumulative:
            lines.append("vLLM Python functions by cumulative time:")
            lines += [f"  {f.file}:{f.line} {f.name}  {f.calls}  {f.self_s:.3f}  {f.cum_s:.3f}"
                      for f in self.cumulative[:max_functions]]
        if self.ops:
            lines.append("torch ops by self CPU time (op  calls  self_ms  total_ms):")
            lines += [f"  {o.name}  {o.calls}  {o.self_ms:.1f}  {o.total_ms:.1f}" for o in self.ops[:max_ops]]
        return "\n".join(lines)


class ProfileError(NightshiftError, RuntimeError):
    stage = "profile"


def _key(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def profile_request(task, model_path: Path) -> dict[str, Any]:
    from agent.world.checkout import installed_vllm

    _, version = installed_vllm()
    return {
        "vllm_version": version,
        "model": str(model_path),
        "dtype": task.model.dtype,
        "max_model_len": task.model.max_model_len,
        "engine_args": dict(task.engine.args),
        "env": dict(task.engine.env),
        "num_prompts": min(task.workload.num_prompts, 16),
        "input_len": task.workload.input_len,
        "output_len": min(task.workload.output_len, 64),
    }


def load_or_run(task, model_path: Path | None = None, timeout_s: float = 900,
                cache_dir: Path | None = None) -> Profile:
    """The cached profile for this task's baseline, made now if there is none. Raises ProfileError."""
    if model_path is None:
        model_path = prepare_model(task).path
    request = profile_request(task, Path(model_path))
    cache = Path(cache_dir or cache_root() / "profiles") / f"{_key(request)}.json"
    if cache.is_file():
        try:
            return Profile.model_validate_json(cache.read_text())
        except ValueError:
            cache.unlink()
    profile = run_profile(request, timeout_s)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".partial")
    tmp.write_text(profile.model_dump_json(indent=1))
    tmp.rename(cache)
    return profile


def run_profile(request: dict[str, Any], timeout_s: float = 900) -> Profile:
    env = {**os.environ, **request["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        proc = subprocess.run([sys.executable, "-m", "agent.proposers.profile", "--child"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout_s, env=env,
                              cwd=str(Path(__file__).resolve().parents[2]))
    except subprocess.TimeoutExpired:
        raise ProfileError(f"the profiling run took longer than {timeout_s:g}s") from None
    marker = "NIGHTSHIFT_PROFILE "
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return Profile.model_validate_json(line[len(marker):])
    tail = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in tail if "Error" in line or "error:" in line]
    raise ProfileError(f"the profiling run failed (exit {proc.returncode}): {(errors or tail or [''])[-1][:400]}")


def _rel(filename: str) -> str | None:
    parts = Path(filename).parts
    if "vllm" not in parts:
        return None
    index = len(parts) - 1 - parts[::-1].index("vllm")
    return "/".join(parts[index:])


def _child(request: dict[str, Any]) -> Profile:
    import cProfile
    import pstats
    import random

    import torch
    from vllm import LLM, SamplingParams

    args = {k.replace("-", "_"): v for k, v in request["engine_args"].items()}
    llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"],
              seed=0, **args)
    vocab = llm.get_tokenizer().vocab_size if hasattr(llm.get_tokenizer(), "vocab_size") else 1000
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, max(11, vocab - 1)) for _ in range(request["input_len"])]}
               for _ in range(request["num_prompts"])]
    params = SamplingParams(temperature=0.0, max_tokens=request["output_len"], ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up

    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        rel = _rel(filename)
        if rel and "/vllm/" in "/" + rel and rel.endswith(".py"):
            rows.append(HotFunction(file=rel, line=line, name=name, calls=calls, self_s=round(tottime, 4),
                                    cum_s=round(cumtime, 4)))
    functions = sorted(rows, key=lambda f: -f.self_s)[:30]
    skip = {"generate", "_run_engine", "step", "__call__", "_call_impl", "_wrapped_call_impl", "decorate_context"}
    cumulative = [f for f in sorted(rows, key=lambda f: -f.cum_s) if f.name not in skip][:30]

    ops: list[HotOp] = []
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        for avg in sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:20]:
            ops.append(HotOp(name=avg.key, calls=avg.count, self_ms=round(avg.self_cpu_time_total / 1000, 2),
                             total_ms=round(avg.cpu_time_total / 1000, 2)))
    except Exception as exc:  # the op table is a bonus
        print(f"torch.profiler failed: {exc}", file=sys.stderr)
    return Profile(source=f"vLLM {request['vllm_version']} offline engine, engine args {request['engine_args']}",
                   seconds=round(seconds, 3), prompts=len(prompts),
                   output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                   functions=functions, cumulative=cumulative, ops=ops)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Profile a task's baseline (cached).")
    ap.add_argument("--task", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.child:
        profile = _child(json.loads(sys.stdin.read()))
        print("NIGHTSHIFT_PROFILE " + profile.model_dump_json(), flush=True)
        os._exit(0)  # do not wait for the engine's threads
    if not args.task:
        ap.error("--task is required")
    from agent.world.task import load_task

    print(load_or_run(load_task(args.task), timeout_s=args.timeout).summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
