"""Engine arguments moved by code: a code change must serve the engine configuration its parent serves.

vLLM's engine core logs its whole configuration once at start ("Initializing a V1 LLM engine (vX) with config:
model=..., enforce_eager=..., enable_prefix_caching=..., compilation_config={...}, ..."). A candidate that changes
code and no engine argument must log the same configuration as the incumbent: a field that differs (prefix caching
turned off, a compile mode, a KV-cache dtype) is an engine argument moved by code, which the task judges as a flag
(`edit_surface.engine_args`), not as code. What the log cannot show is judged from the candidate's behaviour
(agent/stages/stats.py `moved_by_code`: more requests at once than its max_num_seqs). A candidate whose server
logs no configuration where the incumbent's did hides it, and is refused for that.

The scheduling limits are in no line vLLM logs: the sandbox's recorder prints them from the engine core's scheduler
once it is built ("NIGHTSHIFT engine limits: max_num_seqs=4, max_num_active_seqs=4, max_num_scheduled_tokens=2048,
async_scheduling=False, batch_queue_size=1"), and they are compared as fields of the configuration: a code change
that lets a step hold more tokens, or turns on the overlap of scheduling with the forward that the CPU platform
turns off, moves them. Both lines come from the candidate's own process, so they find honest code that moves an
engine argument; a candidate that forges its log is left to what the harness sees itself (its behaviour, parity,
the audit).

A candidate that changes flags and code together may differ from the incumbent only in the fields its flags move,
and there only to the values its flags give. Which fields and values those are, the trusted tree's own vLLM says,
without starting an engine: its `EngineArgs`, parsed from the `vllm serve` arguments of each side as the server parses
them, builds each side's configuration in a child process (`predicted_sides`); the fields where the two differ are
the flags' to move. Any other field the candidate's server logs differently was moved by its code, and so was a
flags' field it logs at another value than predicted, where the prediction holds for the incumbent (its server
logged what its own flags predict; a field the engine rewrites at start, beyond what the arguments say, cannot be
held to a prediction and is left to the flags). Where the prediction fails, the candidate is refused: what its code
moved cannot be told from what its flags moved.

    python -m agent.stages.engine_config --tree TREE --model DIR -- --max-num-seqs 8   # prints the line"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from sandbox.base import ServerSpec, serve_argv

CONFIG_LINE = re.compile(r"Initializing a V1 LLM engine \(([^)]*)\) with config: (.*)$", re.M)
LIMITS = "NIGHTSHIFT engine limits: "
LIMITS_LINE = re.compile(re.escape(LIMITS) + r"(.*)$", re.M)
"""The scheduling limits the engine core runs with, which vLLM logs nowhere: the sandbox's recorder prints them from
the engine core's own scheduler once it is built (sandbox/recorder/sitecustomize.py), as `key=value` pairs."""
PAIRS = {"(": ")", "[": "]", "{": "}"}
ABSENT = "(absent)"


def config_fields(log: str) -> dict[str, str] | None:
    """The engine configuration the first start in `log` reported, field by field (values as logged); None where
    the log has no such line (a stand-in server, or a log cut before it)."""
    match = CONFIG_LINE.search(log)
    if match is None:
        return None
    fields, depth, quote, start, text = {}, [], "", 0, match.group(2).rstrip()
    for i, ch in enumerate(text + ","):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in PAIRS:
            depth.append(PAIRS[ch])
        elif depth and ch == depth[-1]:
            depth.pop()
        elif ch == "," and not depth:
            key, _, value = text[start:i].strip().partition("=")
            if key:
                fields[key.strip()] = value.strip()
            start = i + 1
    limits = LIMITS_LINE.search(log)
    if limits is not None:
        for pair in limits.group(1).split(","):
            key, _, value = pair.strip().partition("=")
            if key:
                fields[key] = value.strip()
    return {"version": match.group(1), **fields}


def moved_by_code(incumbent_log: str, candidate_log: str,
                  predicted: tuple[dict[str, str], dict[str, str]] | None = None) -> str | None:
    """Why a code change's server does not serve its parent's engine configuration, or None where it does (or
    where the incumbent's server logs none to compare with). `predicted`: for a candidate that changes flags too,
    the configuration the trusted tree predicts for the incumbent's flags and for the candidate's (predicted_sides):
    the fields where they differ may differ, to the candidate's predicted value where the incumbent's own is as
    predicted."""
    theirs = config_fields(incumbent_log)
    if theirs is None:
        return None
    ours = config_fields(candidate_log)
    if ours is None:
        return ("its server logged no engine configuration at start, where the incumbent's did (vLLM's engine core "
                "reports it once: 'Initializing a V1 LLM engine ... with config:'): engine arguments it may have "
                "moved by code cannot be checked")
    before, after = predicted or ({}, {})
    by_flags = differing(before, after)
    moved = [f"{k} {clip(theirs.get(k, ABSENT))} -> {clip(ours.get(k, ABSENT))}"
             for k in sorted(differing(theirs, ours) - by_flags)]
    moved += [f"{k} {clip(ours.get(k, ABSENT))} where its flags give {clip(after.get(k, ABSENT))}"
              for k in sorted(by_flags) if theirs.get(k, ABSENT) == before.get(k, ABSENT)
              and ours.get(k, ABSENT) != after.get(k, ABSENT)]
    if not moved:
        return None
    beside = "" if predicted is None else (
        f" beside its flags, which move {', '.join(sorted(by_flags))} only" if by_flags else
        " beside flags that move none of the logged fields")
    return (f"engine arguments moved by code{beside}: {'; '.join(moved[:6])}{' ...' if len(moved) > 6 else ''} (a "
            f"code change serves its parent's engine configuration; a change of engine arguments is proposed as "
            f"flags and judged against the task's levers)")


class PredictionError(RuntimeError):
    """The trusted tree's vLLM could not build an engine configuration for a side's arguments."""


MARKER = "NIGHTSHIFT_ENGINE_CONFIG "


def serve_flags(spec: ServerSpec) -> list[str]:
    """The `vllm serve` flags after the model that a server of `spec` is given (sandbox.base.serve_argv)."""
    return serve_argv(spec)[2:]


def predict_config(tree: Path | None, model_dir: Path, flags: list[str], env: dict[str, str],
                   timeout_s: float = 300) -> dict[str, str]:
    """The configuration fields vLLM's engine core would log for a server of `flags` on `tree` (None: the installed
    vLLM), built by that tree's EngineArgs in a child process; no engine is started."""
    from sandbox.base import clean_env

    child_env = {**clean_env(os.environ), **env}
    if tree is not None:
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.run([sys.executable, "-m", "agent.stages.engine_config", "--child"],
                              input=json.dumps({"model": str(model_dir), "flags": flags}), capture_output=True,
                              text=True, timeout=timeout_s, env=child_env, cwd=str(Path(__file__).resolve().parents[2]))
    except subprocess.TimeoutExpired:
        raise PredictionError(f"building the configuration took longer than {timeout_s:g} s") from None
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            fields = config_fields(json.loads(line[len(MARKER):]))
            if fields:
                return fields
    tail = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in tail if "Error" in line or "error:" in line]
    raise PredictionError(f"exit {proc.returncode}: {(errors or tail or ['no output'])[-1][:300]}")


def predicted_sides(tree: Path | None, before: ServerSpec, after: ServerSpec) -> tuple[dict[str, str], dict[str, str]]:
    """The logged configuration fields of servers of the `before` and `after` specs (the pool's own, agent/run/pool.py
    `spec`: the task's dtype, length and variables, the levers' variables), as the trusted `tree`'s vLLM builds them.
    Raises PredictionError."""
    return tuple(_predicted(tree, Path(spec.model_dir), tuple(serve_flags(spec)), tuple(sorted(spec.env.items())))
                 for spec in (before, after))


def differing(before: dict[str, str], after: dict[str, str]) -> set[str]:
    """The fields whose values differ between two configurations (a field one lacks differs)."""
    return {k for k in set(before) | set(after) if before.get(k) != after.get(k)}


@functools.lru_cache(maxsize=32)
def _predicted(tree: Path | None, model_dir: Path, flags: tuple[str, ...], env: tuple[tuple[str, str], ...]):
    """predict_config, once per trusted tree and arguments in a run (the incumbent's side is asked again and again;
    a tree's vLLM does not change under a path: a trusted tree is the baseline's, never edited)."""
    return predict_config(tree, model_dir, list(flags), dict(env))


def _child(request: dict[str, Any]) -> str:
    """In the child: the line the engine core would log, from the tree's own argument parser and EngineArgs."""
    from vllm import __version__
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older vLLM
        from vllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    namespace, _ = parser.parse_known_args(["--model", request["model"], *request["flags"]])  # server options aside
    try:
        from vllm.usage.usage_lib import UsageContext
        context = {"usage_context": UsageContext.OPENAI_API_SERVER}  # as `vllm serve` builds it
    except ImportError:
        context = {}
    config = EngineArgs.from_cli_args(namespace).create_engine_config(**context)
    return f"Initializing a V1 LLM engine (v{__version__}) with config: {config}\n{predicted_limits(config)}"


def predicted_limits(config) -> str:
    """The recorder's limits line (sandbox/recorder/sitecustomize.py) for an engine of `config`, as vLLM's scheduler
    and engine core derive their limits from it."""
    sched = config.scheduler_config
    seqs = sched.max_num_seqs
    active = getattr(sched, "max_num_active_seqs", None)
    tokens = getattr(sched, "max_num_scheduled_tokens", None)
    values = {"max_num_seqs": seqs, "max_num_active_seqs": seqs if active is None else active,
              "max_num_scheduled_tokens": sched.max_num_batched_tokens if tokens is None else tokens,
              "async_scheduling": sched.async_scheduling,
              "batch_queue_size": getattr(config, "max_concurrent_batches", 1)}
    return LIMITS + ", ".join(f"{k}={v}" for k, v in values.items())


def clip(value: str, width: int = 80) -> str:
    return value if len(value) <= width else value[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The engine configuration a vLLM server of these flags would log.")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", type=Path, help="the vLLM tree (default: the installed vLLM)")
    ap.add_argument("--model", type=Path, help="the model folder")
    ap.add_argument("flags", nargs="*", help="`vllm serve` flags after --")
    args = ap.parse_args(argv)
    if args.child:
        print(MARKER + json.dumps(_child(json.loads(sys.stdin.read()))), flush=True)
        return 0
    if not args.model:
        ap.error("--model is required")
    try:
        fields = predict_config(args.tree, args.model, args.flags, {})
    except PredictionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, value in fields.items():
        print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
