"""The isolation boundary: a candidate vLLM runs as a server behind one of these backends.

The harness only ever talks to a `Server` over HTTP (TCP on loopback, or a Unix socket); the
clock, the prompts and the reference outputs stay on the harness side.
"""
from __future__ import annotations

import functools
import json
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

from traces.errors import NightshiftError

Outcome = Literal["ok", "timeout", "oom", "crash", "cancelled"]
"""How a server ended; `cancelled`: its start was called off by the harness (another start or check failed)."""

UNLIMITED = httpx.Limits(max_connections=None, max_keepalive_connections=None)
"""httpx pools 100 connections by default, which would silently cap the workload's concurrency."""


@functools.cache
def tls_context() -> ssl.SSLContext:
    """Built once: every client (a health probe every half second, one per benchmark lane) would otherwise
    load the CA bundle again (~35 ms each), though the servers speak plain HTTP."""
    return ssl.create_default_context()


@dataclass(frozen=True)
class Endpoint:
    """Where a server's HTTP API is: plain data, so load-generating processes can reach it too."""

    base_url: str
    uds: str | None = None

    def client(self, timeout: float) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(uds=self.uds, limits=UNLIMITED, verify=tls_context())
        return httpx.AsyncClient(transport=transport, base_url=self.base_url, timeout=timeout)

    def sync_client(self, timeout: float) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.uds, verify=tls_context())
        return httpx.Client(transport=transport, base_url=self.base_url, timeout=timeout)


SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "AUTH")


CACHE_DIRS = ("cache", ".triton")
"""Per-server compile caches under the server's HOME (vLLM, its model inspection and inductor under cache/, Triton
under .triton/): what a seed (`ServerSpec.cache_seed`) holds and every backend copies in before a start."""


class ServerSpec(BaseModel):
    """What to run: `vllm serve` from `source_tree`, with the model and engine args given."""

    model_config = ConfigDict(extra="forbid")
    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    source_tree: Path
    """A vLLM source tree whose compiled parts are linked in (see agent.stages.build); put first on PYTHONPATH."""
    model_dir: Path
    served_model_name: str = "model"
    engine_args: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = 600
    gpus: list[int] = Field(default_factory=list)
    nice: int | None = None
    """The niceness the server's processes start at (sandbox/priority.py); None: the harness's own."""
    cache_seed: Path | None = None
    """Compile caches exported by servers of the unmodified baseline, copied in before start; a
    server never writes to another server's caches, and a candidate's are never exported."""


class SandboxError(NightshiftError, RuntimeError):
    stage = "start"

    def __init__(self, outcome: Outcome, message: str, logs: str = ""):
        super().__init__(f"{outcome}: {message}")
        self.outcome = outcome
        self.logs = logs


ERROR_LINE = re.compile(r"Error|Exception|error:")


def last_error_line(logs: str, limit: int = 300) -> str:
    """The log's last line that names an error (e.g. `RuntimeError: operator torchvision::nms does not
    exist`), or "" if none does."""
    line = next((l.strip() for l in reversed(logs.splitlines()) if ERROR_LINE.search(l)), "")
    return line if len(line) <= limit else line[:limit] + "..."


def startup_failure(message: str, logs: str) -> str:
    """`message: <the log's last error line>`, the message a server that died at start raises."""
    cause = last_error_line(logs)
    return f"{message}: {cause}" if cause else message


class Server(Protocol):
    name: str
    spec: ServerSpec
    endpoint: Endpoint

    def client(self, timeout: float) -> httpx.AsyncClient:
        """An HTTP client whose base URL reaches the server's OpenAI-compatible API."""

    def sync_client(self, timeout: float) -> httpx.Client: ...

    def imported_files(self) -> list[str]:
        """Source files (paths relative to the source tree) that the server's processes imported."""

    def logs(self, limit: int = 20_000) -> str: ...

    def alive(self) -> bool: ...

    def exit_code(self) -> int | None:
        """None while the server runs (or is still being created); else its exit status."""

    def stop(self) -> Outcome:
        """Stop and clean up; returns how the server ended."""

    def kill(self, outcome: Outcome | None = None) -> Outcome:
        """Stop at once, without a grace period, and clean up; returns `outcome`, or how it ended."""

    def hold(self, frozen: bool) -> None:
        """Freeze every process of the server (frozen), or let them all run on; the harness freezes the idle side
        of a benchmark while the other side's pass runs (benchmark.hold_idle), and lets the measured side run
        first. Idempotent; a server that is gone is left alone."""


class Sandbox(Protocol):
    """A backend; registered by name in sandbox/registry.py, made as Backend(config, run_dir)."""

    @classmethod
    def probe(cls, config) -> None:
        """Raises (a NightshiftError) where this host cannot run the backend; called before a run writes anything."""

    def start(self, spec: ServerSpec, cancel: threading.Event | None = None) -> Server:
        """Start a server and wait until it answers; raises SandboxError(timeout|oom|crash), or
        SandboxError(cancelled) once `cancel` is set while it waits (the server killed and removed)."""

    def export_cache(self, server: Server, dest: Path) -> None:
        """Copy a (trusted) server's compile caches into `dest`, the seed for later servers."""

    def reap(self) -> int:
        """Remove what a dead run left behind; returns how many leftovers were removed."""


class Reachable:
    """A server's HTTP clients, from its `endpoint`."""

    endpoint: Endpoint

    def client(self, timeout: float) -> httpx.AsyncClient:
        return self.endpoint.client(timeout)

    def sync_client(self, timeout: float) -> httpx.Client:
        return self.endpoint.sync_client(timeout)

    def answers_itself(self) -> bool:
        """Whether what answers at `endpoint` is this server's own process (a backend whose endpoint no other
        process can take, a socket in the server's own folder or namespace, says yes)."""
        return True


def read_imports(path: Path) -> list[str]:
    """The import recorder's log (sandbox/recorder): the source files imported, once each."""
    return sorted(set(path.read_text().split())) if path.exists() else []


def answers_health(server: "Server") -> bool:
    """True once the server's /health answers 200."""
    try:
        with server.sync_client(5) as client:
            return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


HEALTH_POLL_S = 0.5


def wait_healthy(server: Server, timeout_s: float, cancel: threading.Event | None = None) -> None:
    """Until /health answers 200 from the server's own process (on a port another process holds, the answer is
    that process's, and the server is not healthy: it will exit when it cannot bind). A server that exits first, is not healthy within `timeout_s`, or whose
    start is called off (`cancel` set), is killed and cleaned up, and SandboxError raised with its logs."""
    deadline, cancel = time.monotonic() + timeout_s, cancel or threading.Event()
    while time.monotonic() < deadline:
        if cancel.is_set():
            logs = server.logs()
            server.kill("cancelled")
            raise SandboxError("cancelled", "start called off by the harness; killed and removed", logs)
        code = server.exit_code()
        if code is not None:
            logs = server.logs()
            outcome = server.kill()
            message = startup_failure(f"server exited during startup (exit code {code})", logs)
            raise SandboxError(outcome if outcome != "ok" else "crash", message, logs)
        if answers_health(server) and server.answers_itself():
            return
        cancel.wait(HEALTH_POLL_S)
    logs = server.logs()
    server.kill("timeout")
    raise SandboxError("timeout", f"server not healthy after {timeout_s:.0f}s; killed and removed", logs)


def clean_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment minus anything that looks like a secret."""
    return {k: v for k, v in env.items() if not any(m in k.upper() for m in SECRET_MARKERS)}


def runtime_env(home: str, tree: str, recorder: str, import_log: str, pythonpath: list[str] = (),
                tmp: str | None = None, user: str | None = None, write_bytecode: bool = False) -> dict[str, str]:
    """The variables every backend gives a server, with one cache layout under its HOME: vLLM, Hugging Face and
    inductor under cache/, Triton under .triton/ (what the backends' compile-cache seeding copies), offline,
    unbuffered, and the import recorder (recorder and tree first on PYTHONPATH)."""
    env = {
        "HOME": home, "TMPDIR": tmp or home, "XDG_CACHE_HOME": f"{home}/cache", "VLLM_CACHE_ROOT": f"{home}/cache/vllm",
        "HF_HOME": f"{home}/cache/huggingface", "TORCHINDUCTOR_CACHE_DIR": f"{home}/cache/torchinductor",
        "TRITON_CACHE_DIR": f"{home}/.triton/cache",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([recorder, tree, *pythonpath]), "PYTHONUNBUFFERED": "1",
        "NIGHTSHIFT_IMPORT_LOG": import_log, "NIGHTSHIFT_SOURCE_TREE": tree,
    }
    if user:
        env.update(USER=user, LOGNAME=user)
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def build_env(host_env: Mapping[str, str], passed: tuple[str, ...], prefixes: tuple[str, ...],
              fixed: Mapping[str, str], spec: ServerSpec) -> dict[str, str]:
    """What a server's processes see: the host variables named in `passed` or starting with one of
    `prefixes`, then `fixed`, then the spec's own; never a variable that looks like a secret."""
    inherited = clean_env({k: v for k, v in host_env.items() if k in passed or k.startswith(prefixes)})
    return {**inherited, **fixed, **clean_env(spec.env)}


ENV = "env."
"""A serving arg named `env.NAME` is the server's environment variable NAME."""


def nest_serve_args(args: dict) -> tuple[dict, dict[str, str]]:
    """(engine args, environment variables) for a server's args: `env.NAME` keys become variables, and dotted keys
    (`compilation_config.cudagraph_mode`) values inside their top-level argument, a dict (merged with a value given
    for that argument whole, as a dict or its JSON)."""
    plain, env, nested = {}, {}, {}
    for key, value in args.items():
        if key.startswith(ENV):
            if value is not None:
                env[key[len(ENV):]] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        elif "." in key:
            if value is not None:
                top, *path = key.split(".")
                node = nested.setdefault(top, {})
                for part in path[:-1]:
                    node = node.setdefault(part, {})
                node[path[-1]] = value
        else:
            plain[key] = value
    for top, values in nested.items():
        base = plain.get(top)
        plain[top] = {**(json.loads(base) if isinstance(base, str) else base or {}), **values}
    return plain, env


def split_serve_args(args: dict) -> tuple[dict, dict[str, str]]:
    """(`vllm serve` engine args, environment variables) for a server's args: a nested argument as its JSON."""
    plain, env = nest_serve_args(args)
    return {k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for k, v in plain.items()}, env


def serve_argv(spec: ServerSpec) -> list[str]:
    """`vllm serve` arguments for a spec; engine args are given without dashes (max_num_seqs: 8)."""
    argv = ["serve", str(spec.model_dir), "--served-model-name", spec.served_model_name]
    for key, value in spec.engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False:
            argv.append("--no-" + key.replace("_", "-"))
        elif value is not None:
            argv += [flag, str(value)]
    return argv
