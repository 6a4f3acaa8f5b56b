"""Where the incumbent's time goes: a profiled run of the task's model on the target device, summarized.

One offline vLLM engine, in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), imported from the profiled tree (first on
PYTHONPATH, as its servers have it), with the incumbent's engine args (those that are vLLM engine arguments: a server
option such as `api_server_count` is left out, and named), generates one wave of the benchmark: `workload.concurrency`
requests (every prompt where the task sets no concurrency) of the workload's input and output lengths. It does so
four times: unprofiled to warm every batch shape, under cProfile (vLLM's Python functions by self and cumulative
time: what the proposer can edit), under torch.profiler (on a GPU with its CUDA activity, for the kernel table: each
kernel's device time and share of it; on the CPU for the CPU op table), and unprofiled again, timed. It
runs in a child process with a timeout, and is cached as JSON under the nightshift cache, keyed by everything that
decides it: the tree's content (its git tree and uncommitted diff), the engine args and environment, the model, the
workload and the GPUs.

    python -m agent.proposers.profile --task tasks/gemma4-tiny-cpu.yaml [--tree PATH]   # prints the summary
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

from agent.world.paths import cache_root
from sandbox.base import clean_env, nest_serve_args
from traces.errors import NightshiftError

FUNCTIONS = 30
"""Rows kept of each table."""
MARKER = "NIGHTSHIFT_PROFILE "
METHOD = 2
"""How the profile is taken, in its cache key: 2 times the unprofiled wave last, on a warm engine."""
SKIP = {"generate", "_run_engine", "step", "__call__", "_call_impl", "_wrapped_call_impl", "decorate_context"}
"""Wrappers left out of the cumulative table: every function is under them."""


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


class HotKernel(BaseModel):
    """One GPU kernel (or copy) of the torch profiler's CUDA activity, its calls summed."""

    name: str
    calls: int
    total_ms: float
    share: float
    """Of all device time in the profiled pass."""


class Profile(BaseModel):
    source: str
    device: str = "cpu"
    """`cpu`, or the GPU's name."""
    tree: str = ""
    """The profiled tree's identity (tree_id), or the installed vLLM."""
    seconds: float = 0.0
    """The wave under cProfile."""
    plain_s: float = 0.0
    """The same wave unprofiled, on the warm engine after the profiled ones: what the profilers add."""
    prompts: int = 0
    output_tokens: int = 0
    functions: list[HotFunction] = Field(default_factory=list)
    """By self time, vLLM's own files only."""
    cumulative: list[HotFunction] = Field(default_factory=list)
    """By cumulative time, vLLM's own files only."""
    ops: list[HotOp] = Field(default_factory=list)
    kernels: list[HotKernel] = Field(default_factory=list)
    device_ms: float = 0.0
    """The device time of every kernel and copy in the profiled pass."""
    profiled_ms: float = 0.0
    """The wall time of that pass."""
    left_out: list[str] = Field(default_factory=list)
    """The incumbent's args that are not vLLM engine arguments (server options), left out of the offline engine."""
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

    def summary(self, max_functions: int = 15, max_rows: int = 12) -> str:
        lines = [f"{self.source} on {self.device}: {self.prompts} requests at once, {self.output_tokens} output "
                 f"tokens in {self.seconds:.2f}s (profiled)."]
        if self.plain_s:
            torch_part = f", {self.profiled_ms / 1000:.2f}s under torch.profiler" if self.profiled_ms else ""
            lines.append(f"The same wave unprofiled: {self.plain_s:.2f}s ({self.output_tokens / self.plain_s:,.0f} "
                         f"output tokens/s); {self.seconds:.2f}s under cProfile{torch_part}. Read the tables' "
                         f"shares, not their seconds.")
        if self.left_out:
            lines.append(f"Left out of the offline engine (server options, not engine arguments): "
                         f"{', '.join(self.left_out)}.")
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
        if self.kernels:
            busy = f" of {self.profiled_ms:.0f} ms wall ({self.device_ms / self.profiled_ms:.0%} busy)" \
                if self.profiled_ms else ""
            if self.plain_s:  # the profiler stretches the wall, not the kernels: the unprofiled wave is the real share
                busy += f"; {self.device_ms / (self.plain_s * 1000):.0%} of the unprofiled wave's wall"
            lines.append(f"GPU kernels by device time ({self.device_ms:.1f} ms in all{busy}; kernel  calls  ms  share):")
            lines += [f"  {k.name}  {k.calls}  {k.total_ms:.2f}  {k.share:.1%}" for k in self.kernels[:max_rows]]
        if self.ops:
            lines.append("torch ops by self CPU time (op  calls  self_ms  total_ms):")
            lines += [f"  {o.name}  {o.calls}  {o.self_ms:.1f}  {o.total_ms:.1f}" for o in self.ops[:max_rows]]
        return "\n".join(lines)


class ProfileError(NightshiftError, RuntimeError):
    stage = "profile"


def tree_id(tree: Path) -> str:
    """What a tree holds: its git tree object and the digest of its uncommitted changes to tracked files (or, outside
    git, the digest of its Python files)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD^{tree}"], cwd=tree, capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "--binary", "HEAD"], cwd=tree, capture_output=True, timeout=120,
                              check=True).stdout
        return f"git tree {head}" + (f" + diff {hashlib.sha256(diff).hexdigest()[:16]}" if diff else "")
    except (OSError, subprocess.SubprocessError):
        digest = hashlib.sha256()
        for path in sorted(Path(tree).rglob("*.py")):
            digest.update(path.relative_to(tree).as_posix().encode() + b"\0" + path.read_bytes())
        return f"files {digest.hexdigest()[:16]}"


def profile_request(task, model_path: Path, tree: Path | None, args: dict[str, Any]) -> dict[str, Any]:
    """Everything the profile of `tree` (None: the installed vLLM) with the incumbent's `args` depends on."""
    from agent.world.checkout import installed_vllm

    _, version = installed_vllm()
    engine_args, lever_env = nest_serve_args(args)
    workload = task.workload
    return {
        "method": METHOD,
        "vllm_version": version,
        "tree": str(tree) if tree is not None else None,
        "tree_id": tree_id(tree) if tree is not None else f"installed vLLM {version}",
        "model": str(model_path),
        "dtype": task.model.dtype,
        "max_model_len": task.model.max_model_len,
        "engine_args": engine_args,
        "env": {**task.engine.env, **lever_env},
        "gpus": list(task.sandbox.gpus),
        "num_prompts": workload.concurrency or workload.num_prompts,
        "input_len": workload.input_len,
        "output_len": workload.output_len,
    }


def request_key(request: dict[str, Any]) -> str:
    """The cache key: the request without the tree's path (the same content at another path is the same profile)."""
    payload = {k: v for k, v in request.items() if k != "tree"}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_or_run(request: dict[str, Any], timeout_s: float = 900, cache_dir: Path | None = None) -> Profile:
    """The cached profile for this request, made now if there is none. Raises ProfileError."""
    cache = Path(cache_dir or cache_root() / "profiles") / f"{request_key(request)}.json"
    if cache.is_file():
        try:
            return Profile.model_validate_json(cache.read_text())
        except ValueError:
            cache.unlink()
    profile = run_profile(request, timeout_s)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.partial")
    tmp.write_text(profile.model_dump_json(indent=1))
    tmp.rename(cache)
    return profile


def child_env(request: dict[str, Any]) -> dict[str, str]:
    """The profiling child's environment: the host's without anything that looks like a secret (the tree may hold an
    LLM's changes), the task's and the levers' variables, the engine in-process, the tree first on PYTHONPATH, and the
    task's GPUs."""
    env = {**clean_env(os.environ), **request["env"], "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if request["tree"]:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (request["tree"], os.environ.get("PYTHONPATH", "")) if p)
    if request["gpus"]:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in request["gpus"])
    return env


def run_profile(request: dict[str, Any], timeout_s: float = 900) -> Profile:
    """The profile, made in a child process; a tree not built yet (a parallel run's view of the branch head) first
    gets the installed vLLM's compiled parts, as a build links them."""
    from agent.stages.build import link_compiled_parts, linked

    if request["tree"] and not linked(Path(request["tree"])):
        link_compiled_parts(Path(request["tree"]))
    try:
        proc = subprocess.run([sys.executable, "-m", "agent.proposers.profile", "--child"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout_s, env=child_env(request),
                              cwd=str(Path(__file__).resolve().parents[2]))
    except subprocess.TimeoutExpired:
        raise ProfileError(f"the profiling run took longer than {timeout_s:g}s") from None
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return Profile.model_validate_json(line[len(MARKER):])
    tail = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in tail if "Error" in line or "error:" in line]
    raise ProfileError(f"the profiling run failed (exit {proc.returncode}): {(errors or tail or [''])[-1][:400]}")


def engine_kwargs(args: dict[str, Any], fields: set[str]) -> tuple[dict[str, Any], list[str]]:
    """(the args an offline engine takes: vLLM's engine arguments, the names left out): `vllm serve` takes server
    options too (`api_server_count`), which `LLM(...)` refuses."""
    kept = {k.replace("-", "_"): v for k, v in args.items() if k.replace("-", "_") in fields}
    return kept, sorted(k for k in args if k.replace("-", "_") not in fields)


def kernel_table(averages: Any, limit: int = FUNCTIONS) -> tuple[list[HotKernel], float]:
    """(the kernels by device time, the device time of all, in ms) from torch.profiler's `key_averages()`: its rows of
    a device (kernels and copies the CUDA activity recorded), not the CPU ops that launched them."""
    from torch.autograd import DeviceType

    rows = [a for a in averages if a.device_type != DeviceType.CPU and a.self_device_time_total > 0]
    total = sum(a.self_device_time_total for a in rows)
    rows.sort(key=lambda a: -a.self_device_time_total)
    return ([HotKernel(name=a.key[:200], calls=a.count, total_ms=round(a.self_device_time_total / 1000, 3),
                       share=round(a.self_device_time_total / total, 4)) for a in rows[:limit]],
            round(total / 1000, 3))


def op_table(averages: Any, limit: int = FUNCTIONS) -> list[HotOp]:
    """The CPU ops by self CPU time from torch.profiler's `key_averages()`."""
    from torch.autograd import DeviceType

    rows = sorted((a for a in averages if a.device_type == DeviceType.CPU), key=lambda a: -a.self_cpu_time_total)
    return [HotOp(name=a.key, calls=a.count, self_ms=round(a.self_cpu_time_total / 1000, 2),
                  total_ms=round(a.cpu_time_total / 1000, 2)) for a in rows[:limit]]


def _rel(filename: str) -> str | None:
    parts = Path(filename).parts
    if "vllm" not in parts:
        return None
    index = len(parts) - 1 - parts[::-1].index("vllm")
    return "/".join(parts[index:])


def function_tables(stats: Any) -> tuple[list[HotFunction], list[HotFunction]]:
    """(by self time, by cumulative time) of vLLM's own Python functions in a `pstats.Stats`."""
    rows = []
    for (filename, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():
        rel = _rel(filename)
        if rel and rel.endswith(".py"):
            rows.append(HotFunction(file=rel, line=line, name=name, calls=calls, self_s=round(tottime, 4),
                                    cum_s=round(cumtime, 4)))
    by_self = sorted(rows, key=lambda f: -f.self_s)[:FUNCTIONS]
    by_cum = [f for f in sorted(rows, key=lambda f: -f.cum_s) if f.name not in SKIP][:FUNCTIONS]
    return by_self, by_cum


def _child(request: dict[str, Any]) -> Profile:
    import cProfile
    import dataclasses
    import pstats
    import random

    import torch
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    kwargs, left_out = engine_kwargs(request["engine_args"], {f.name for f in dataclasses.fields(EngineArgs)})
    llm = LLM(model=request["model"], dtype=request["dtype"], max_model_len=request["max_model_len"], seed=0,
              **kwargs)
    tokenizer = llm.get_tokenizer()
    vocab = getattr(tokenizer, "vocab_size", 1000)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, max(11, vocab - 1)) for _ in range(request["input_len"])]}
               for _ in range(request["num_prompts"])]
    params = SamplingParams(temperature=0.0, max_tokens=request["output_len"], ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    llm.generate(prompts, params, use_tqdm=False)  # every batch shape of the wave (its first is slower, below)

    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - started
    functions, cumulative = function_tables(pstats.Stats(profiler))

    gpu = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    started = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        if gpu:
            torch.cuda.synchronize()
    profiled_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()  # the same wave unprofiled, last: an H100's first wave of 256 took 4.96 s, a
    llm.generate(prompts, params, use_tqdm=False)  # later one under torch.profiler 4.00 s (gpu-profile-e2b.md)
    if gpu:
        torch.cuda.synchronize()
    plain_s = time.perf_counter() - started
    averages = prof.key_averages()
    kernels, device_ms = kernel_table(averages) if gpu else ([], 0.0)
    return Profile(source=f"vLLM {request['vllm_version']} offline engine of {request['tree_id']}, engine args "
                          f"{json.dumps(kwargs, sort_keys=True)}",
                   device=torch.cuda.get_device_name(0) if gpu else "cpu", tree=request["tree_id"],
                   seconds=round(seconds, 3), plain_s=round(plain_s, 6), prompts=len(prompts),
                   output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                   functions=functions, cumulative=cumulative, ops=op_table(averages), kernels=kernels,
                   device_ms=device_ms, profiled_ms=round(profiled_ms, 1), left_out=left_out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Profile a task's incumbent (cached).")
    ap.add_argument("--task", type=Path)
    ap.add_argument("--tree", type=Path, help="the tree to profile (default: the installed vLLM)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args(argv)
    if args.child:
        profile = _child(json.loads(sys.stdin.read()))
        print(MARKER + profile.model_dump_json(), flush=True)
        os._exit(0)  # do not wait for the engine's threads
    if not args.task:
        ap.error("--task is required")
    from agent.world.checkpoint import prepare_model
    from agent.world.task import load_task

    task = load_task(args.task)
    request = profile_request(task, prepare_model(task).path, args.tree, dict(task.engine.args))
    print(load_or_run(request, timeout_s=args.timeout).summary())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
