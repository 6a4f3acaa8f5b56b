"""A task's `sandbox` section: which backend runs the servers, and the limits it sets."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backend: Literal["local", "docker", "namespace"] = "local"
    image: str = "nightshift-sandbox:cpu"
    gpus: list[int] = Field(default_factory=list)
    memory_gb: float = Field(8, gt=0)
    cpus: float | None = Field(None, gt=0)
    pids_limit: int = Field(4096, gt=0)
    tmpfs_mb: int = Field(2048, gt=0)
    parallel_starts: bool = True
    """Start the servers that a step needs at once (the two baselines; a candidate's parity and
    performance servers) instead of one after another."""
