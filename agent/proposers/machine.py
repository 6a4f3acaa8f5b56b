"""What the LLM proposer's opening says of the machine: the incumbent's measured numbers, the task's roofline ceiling,
how the production server runs (the lines of its start log that say so) and where parity runs.

The numbers are the latest benchmark of the incumbent in the run's trace: the noise floor's (the baseline's A/A) before
any candidate, then the incumbent's side of each candidate's benchmark, and a kept candidate's own side once it is the
incumbent. The start log is the baseline production server's, saved by the baseline phase (base.START_LOG); of its
lines only those naming the attention backend, the compile mode and CUDA graphs, the KV cache, the scheduler and the
start's durations are shown, and the engine's config line is reduced to the fields that decide speed.
"""
from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from agent.proposers.base import START_LOG
from agent.stages.bench import sample_metric
from agent.world.task import Task
from traces.schema import AnyEvent, BenchReport, Decision, IncumbentReverted, NoiseFloor, Sample

LOG_LINES = 30
"""The most start-log lines shown."""
LINE_CHARS = 400

RELEVANT = re.compile("|".join((
    r"\bUsing \S+ (?:attention )?backend", r"attention backend", r"forcing \S+ backend", r"Cannot use \S+ backend",
    r"KV cache layout", r"torch\.compile took", r"Compiling a graph", r"Dynamo bytecode transform", r"Enforce eager",
    r"disabling torch\.compile", r"Cudagraph is disabled", r"Graph capturing finished", r"Capturing CUDA graphs",
    r"KV cache size", r"Maximum concurrency", r"Available KV cache memory", r"for KV cache", r"Chunked prefill",
    r"[Aa]synchronous scheduling", r"Model loading took", r"init engine", r"non-default args", r"[Mm]odel [Rr]unner V2",
    r"FlashInfer", r"custom fusions")))
PREFIX = re.compile(r"^\([^)]+ pid=\d+\) (INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d (\[[^\]]+\]) ")
CONFIG_LINE = "with config: "
CONFIG_FIELDS = ("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill", "kv_cache_dtype",
                 "async_scheduling")
ENUM = re.compile(r"<\w+\.(\w+): [^>]*>")
"""An enum as Python prints it (`<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>`): its name is what counts."""
COMPILATION_FIELDS = ("mode", "level", "cudagraph_mode", "max_cudagraph_capture_size", "max_capture_size")


@dataclass
class Measured:
    """One benchmark's passes of the incumbent, and which benchmark they come from."""

    source: str
    samples: list[Sample]

    def text(self, task: Task) -> str:
        metric = sample_metric(task)

        def median(field: str) -> float | None:
            values = [getattr(s, field) for s in self.samples if getattr(s, field) is not None]
            return statistics.median(values) if values else None

        value = median(metric) or median(task.benchmark.metric)
        parts = [f"{task.benchmark.metric} {value:,.0f}" + (" (steady state)" if metric.startswith("steady_") else ""),
                 f"output {median('output_tokens_per_s'):,.0f} tokens/s"]
        for name, p50, p99 in (("TTFT", "ttft_ms_p50", "ttft_ms_p99"), ("TPOT", "tpot_ms_p50", "tpot_ms_p99")):
            if median(p50) is not None and median(p99) is not None:
                parts.append(f"{name} p50 {median(p50):.1f} ms, p99 {median(p99):.1f} ms")
        line = (f"The incumbent, measured ({self.source}; medians of {len(self.samples)} timed passes): "
                + "; ".join(parts) + ".")
        ceiling = task.benchmark.ceiling_tokens_per_s
        if ceiling:
            line += (f"\nRoofline ceiling (benchmark.ceiling_tokens_per_s): {ceiling:,.0f} tokens/s; the incumbent is at "
                     f"{value / ceiling:.0%} of it.")
        return line


def incumbent_measured(events: Iterable[AnyEvent]) -> Measured | None:
    """The incumbent's latest benchmark in a run's events, or None before any (or after a kept change was taken
    back, until the next)."""
    current: Measured | None = None
    benchmarks: dict[int, BenchReport] = {}
    for event in events:
        if isinstance(event, NoiseFloor):
            current = Measured("the baseline's A/A before any candidate", _side(event.samples, "incumbent"))
        elif isinstance(event, BenchReport):
            benchmarks[event.candidate] = event
            current = Measured(f"candidate {event.candidate}'s benchmark, the incumbent's side",
                               _side(event.samples, "incumbent"))
        elif isinstance(event, Decision) and event.verdict == "keep" and event.candidate in benchmarks:
            current = Measured(f"candidate {event.candidate}'s benchmark, its own side: kept, it is the incumbent",
                               _side(benchmarks[event.candidate].samples, "candidate"))
        elif isinstance(event, IncumbentReverted):
            current = None
    return current if current is not None and current.samples else None


def _side(samples: list[Sample], role: str) -> list[Sample]:
    return [s for s in samples if s.role == role]


def start_log_lines(log: str) -> list[str]:
    """The lines of a vLLM server's start log that say how it runs, without their process and time prefix, each once
    (the API server and the engine print some twice), a progress bar at its last state; the engine's config line as
    its speed-deciding fields."""
    out: dict[str, str] = {}
    for raw in log.splitlines():
        line = raw.rsplit("\r", 1)[-1].strip()
        if CONFIG_LINE in line:
            out.setdefault("config", config_digest(line))
            continue
        if not RELEVANT.search(line):
            continue
        line = PREFIX.sub(r"\1 \2 ", line)
        key = line.split(":", 1)[0] if "%|" in line else line  # a progress bar: its last state
        out[key] = line[:LINE_CHARS]
    lines = list(out.values())
    return lines[:LOG_LINES] + ([f"... {len(lines) - LOG_LINES} more lines"] if len(lines) > LOG_LINES else [])


def config_digest(line: str) -> str:
    """The engine's config line as the fields that decide speed: eager or not, prefix caching, chunked prefill, the KV
    cache dtype, and its compilation config's mode, CUDA-graph mode and capture sizes."""
    fields = [f"{name}={m.group(1)}" for name in CONFIG_FIELDS if (m := re.search(rf"\b{name}=([^,\s]+)", line))]
    compilation = line.split("compilation_config=", 1)[-1] if "compilation_config=" in line else ""
    for name in COMPILATION_FIELDS:
        if m := re.search(rf"['\"]{name}['\"]\s*:\s*(<[^>]*>|[^,}}]+)", compilation):
            fields.append(f"{name}={ENUM.sub(lambda e: e.group(1), m.group(1)).strip()}")
    if m := re.search(r"['\"]cudagraph_capture_sizes['\"]\s*:\s*\[([^\]]*)\]", compilation):
        sizes = sorted(int(x) for x in re.findall(r"\d+", m.group(1)))
        fields.append(f"cudagraph_capture_sizes={_sizes(sizes)}")
    return "engine config: " + (", ".join(fields) or "(no field recognized)")


def _sizes(sizes: list[int]) -> str:
    if not sizes:
        return "none"
    shown = sizes if len(sizes) <= 12 else [*sizes[:8], "...", *sizes[-3:]]
    return f"{len(sizes)} sizes: " + " ".join(map(str, shown))


def parity_text(task: Task) -> str:
    """Where and how parity runs, and what checks the production servers' tokens (the task's parity section)."""
    p = task.parity
    regime = {"sequential": "one request at a time on both sides, so every batch is identical",
              "one_batch": "all prompts at once"}[p.regime]
    lines = [f"Parity: {p.num_prompts} prompts of {p.input_len} tokens, {p.max_tokens} greedy tokens each"
             + (f", then {p.long_prompts} long requests" if p.long_prompts else "")
             + f", must be identical to the baseline's, in the {p.regime} regime ({regime})."]
    audit = (" The benchmark's own outputs under load are scored token by token against the reference (the token "
             "audit)." if task.audit.enabled else "")
    if p.dedicated:
        invariant = " (vLLM's batch-invariant mode)" if p.env.get("VLLM_BATCH_INVARIANT") == "1" else ""
        lines.append(f"It runs on servers of its own, not the production ones: the incumbent's engine args with "
                     f"parity.args {json.dumps(p.args, sort_keys=True)} and parity.env "
                     f"{json.dumps(p.env, sort_keys=True)}{invariant}. The benchmark measures the production servers "
                     f"(the start log below), whose tokens parity does not see.{audit} A change to a path that only "
                     f"the production configuration takes (its attention backend, compiled graphs, CUDA graphs) is "
                     f"checked there, not by parity.")
    else:
        lines.append(f"It runs on the production configuration (the incumbent's engine args).{audit}")
    return "\n".join(lines)


def machine_text(task: Task, run_dir: Path | None, device: str = "") -> str:
    """The opening's section on the machine: the device, the incumbent's numbers and the ceiling, parity, and the
    production server's start."""
    lines = [f"Device: {device}." if device else ""]
    measured = _measured(run_dir)
    lines.append(measured.text(task) if measured is not None else
                 "The incumbent has not been benchmarked yet in this run.")
    if measured is None and task.benchmark.ceiling_tokens_per_s:
        lines.append(f"Roofline ceiling (benchmark.ceiling_tokens_per_s): {task.benchmark.ceiling_tokens_per_s:,.0f} "
                     f"tokens/s.")
    lines.append(parity_text(task))
    log = Path(run_dir) / START_LOG if run_dir is not None else None
    if log is not None and log.is_file():
        shown = start_log_lines(log.read_text(errors="replace"))
        lines.append("The production server's start log, the lines that say how it runs:\n"
                     + ("\n".join(f"  {x}" for x in shown) or "  (none recognized)"))
    return "\n".join(x for x in lines if x)


def _measured(run_dir: Path | None) -> Measured | None:
    from traces.log import read_trace_so_far

    trace = Path(run_dir) / "trace.jsonl" if run_dir is not None else None
    if trace is None or not trace.is_file():
        return None
    records, _ = read_trace_so_far(trace)
    return incumbent_measured(r.event for r in records)
