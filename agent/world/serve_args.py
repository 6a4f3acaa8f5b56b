"""Serving levers beyond plain flags: `env.NAME` keys are environment variables of the server, and dotted keys
(`compilation_config.cudagraph_mode`) are fields of one JSON-valued flag (`--compilation-config '{...}'`).
Every lever a task names is checked against the installed vLLM's `vllm serve --help=all`, its environment
variables and its config fields before a run starts. How they become a server's command line and environment is
sandbox.base (`split_serve_args`, `serve_argv`)."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from agent.world.paths import cache_root
from sandbox.base import ENV
from traces.errors import NightshiftError



SERVE_FILE = "nightshift.serve.yaml"
"""A kept commit's serving flags, in its tree: what `review`, `verify` and a resumed run serve it with."""


class UnknownLever(NightshiftError):
    stage = "preflight"


def help_flags(text: str) -> set[str]:
    """The long options a help text lists, without dashes (`--no-x` spellings included)."""
    return set(re.findall(r"(?<![\w-])--([a-z0-9][a-z0-9-]*)", text))


def levers(task) -> set[str]:
    keys = set(task.engine.args) | set(task.parity.args) | set(task.edit_surface.engine_args)
    space = getattr(task.proposer, "space", None)
    return keys | set(space or {})


def unknown_levers(names: set[str], known: dict) -> list[str]:
    """Each lever the vLLM described by `known` (flags, env, config fields by flag) does not have."""
    problems = []
    for name in sorted(names):
        if name.startswith(ENV):
            if name[len(ENV):] not in known["env"]:
                problems.append(f"{name}: vLLM reads no environment variable {name[len(ENV):]}")
            continue
        top, *path = name.split(".")
        flag = top.replace("_", "-")
        if flag not in known["flags"]:
            problems.append(f"{name}: `vllm serve` has no --{flag}")
        elif path and top in known["fields"] and path[0] not in known["fields"][top]:
            problems.append(f"{name}: --{flag} has no field {path[0]}")
    return problems


PROBE = """
import dataclasses, json, sys
import vllm.config, vllm.envs
fields = {}
for top in sys.argv[1:]:
    cls = getattr(vllm.config, "".join(p.title() for p in top.split("_")), None)
    if cls is not None and dataclasses.is_dataclass(cls):
        fields[top] = [f.name for f in dataclasses.fields(cls)]
print(json.dumps({"env": sorted(vllm.envs.environment_variables), "fields": fields}))
"""


def known_levers(version: str, nested: list[str], timeout_s: float = 300) -> dict:
    """What the installed vLLM offers: its serve flags, environment variables and the fields of the config
    flags in `nested`; cached per version in the nightshift cache."""
    cache = cache_root() / f"levers-{version}.json"
    if cache.is_file():
        known = json.loads(cache.read_text())
        if set(nested) <= set(known["asked"]):
            return {**known, "flags": set(known["flags"])}
    with tempfile.TemporaryDirectory(prefix="nightshift-help-") as cwd:
        dist = Path(cwd) / f"vllm-{version}.dist-info"  # `vllm serve` reads its version from metadata named vllm
        dist.mkdir()
        installed = importlib.metadata.packages_distributions().get("vllm", ["vllm"])
        local = "+cpu" if any(d.endswith(("-cpu", "_cpu")) for d in installed) else ""  # as agent/stages/build.py
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}{local}\n")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [cwd, os.environ.get("PYTHONPATH")]))}
        run = lambda argv: subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd,  # noqa: E731
                                          env=env, timeout=timeout_s, stdin=subprocess.DEVNULL)
        helped = run(["-m", "vllm.entrypoints.cli.main", "serve", "--help=all"])
        probed = run(["-c", PROBE, *nested])
    if helped.returncode or probed.returncode:
        raise UnknownLever(f"could not list vLLM {version}'s serving flags: "
                           f"{(helped.stderr or probed.stderr).strip().splitlines()[-1:]}")
    known = {"version": version, "asked": sorted(nested), "flags": sorted(help_flags(helped.stdout)),
             **json.loads(probed.stdout.strip().splitlines()[-1])}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(known))
    return {**known, "flags": set(known["flags"])}


def check_levers(task, version: str) -> None:
    """Refuses a task that names a flag, field or environment variable this vLLM does not have."""
    names = levers(task)
    nested = sorted({n.split(".")[0] for n in names if "." in n and not n.startswith(ENV)})
    problems = unknown_levers(names, known_levers(version, nested))
    if problems:
        raise UnknownLever(f"the task names serving levers vLLM {version} does not have: " + "; ".join(problems)
                           + " (remove them from engine/parity args, edit_surface.engine_args and proposer.space)")
