"""The isolation boundary: a candidate vLLM runs as a server behind one of these backends.

The harness only ever talks to a `Server` over HTTP (TCP on loopback, or a Unix socket); the
clock, the prompts and the reference outputs stay on the harness side.
"""
from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field

Outcome = Literal["ok", "timeout", "oom", "crash"]

UNLIMITED = httpx.Limits(max_connections=None, max_keepalive_connections=None)
"""httpx pools 100 connections by default, which would silently cap the workload's concurrency."""


@functools.cache
def tls_context() -> ssl.SSLContext:
    """Built once: every client (a health probe each second, one per benchmark lane) would otherwise
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


class ServerSpec(BaseModel):
    """What to run: `vllm serve` from `source_tree`, with the model and engine args given."""

    model_config = ConfigDict(extra="forbid")
    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    source_tree: Path
    """A vLLM source tree whose compiled parts are linked in (see agent.build); put first on PYTHONPATH."""
    model_dir: Path
    served_model_name: str = "model"
    engine_args: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float = 600
    gpus: list[int] = Field(default_factory=list)
    cache_seed: Path | None = None
    """Compile caches exported by servers of the unmodified baseline, copied in before start; a
    server never writes to another server's caches, and a candidate's are never exported."""


class SandboxError(RuntimeError):
    def __init__(self, outcome: Outcome, message: str, logs: str = ""):
        super().__init__(f"{outcome}: {message}")
        self.outcome = outcome
        self.logs = logs


class Server(Protocol):
    name: str
    endpoint: Endpoint

    def client(self, timeout: float) -> httpx.AsyncClient:
        """An HTTP client whose base URL reaches the server's OpenAI-compatible API."""

    def sync_client(self, timeout: float) -> httpx.Client: ...

    def imported_files(self) -> list[str]:
        """Source files (paths relative to the source tree) that the server's processes imported."""

    def logs(self, limit: int = 20_000) -> str: ...

    def alive(self) -> bool: ...

    def stop(self) -> Outcome:
        """Stop and clean up; returns how the server ended."""


class Sandbox(Protocol):
    def start(self, spec: ServerSpec) -> Server:
        """Start a server and wait until it answers; raises SandboxError(timeout|oom|crash)."""

    def reap(self) -> int:
        """Remove what a dead run left behind; returns how many leftovers were removed."""


def answers_health(server: "Server") -> bool:
    """True once the server's /health answers 200."""
    try:
        with server.sync_client(5) as client:
            return client.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def clean_env(env: dict[str, str]) -> dict[str, str]:
    """The environment minus anything that looks like a secret."""
    return {k: v for k, v in env.items() if not any(m in k.upper() for m in SECRET_MARKERS)}


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
