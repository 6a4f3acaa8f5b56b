"""Ray for a parallel run: importing it, joining or starting the cluster, and what a run checks before it
writes anything (docs/parallel.md)."""
from __future__ import annotations

import os
import socket

from traces.errors import NightshiftError


class ParallelError(NightshiftError):
    stage = "workers"


def import_ray():
    try:
        import ray
    except ImportError:
        raise ParallelError("parallel mode (sandbox.workers > 1) needs Ray: pip install 'nightshift[ray]'") from None
    return ray


def connect(task) -> None:
    """Join the cluster at sandbox.ray_address or RAY_ADDRESS, else start Ray on this host (or use one started):
    with the GPUs of sandbox.gpus if set, and a custom sandbox.gpu_resource declared once per worker's GPU."""
    ray = import_ray()
    if ray.is_initialized():
        return
    box = task.sandbox
    address = box.ray_address or os.environ.get("RAY_ADDRESS")
    options: dict = {"include_dashboard": False, "log_to_driver": False}
    if address:
        probe(address)
        options["address"] = address
    elif box.gpu_resource != "GPU":
        options["resources"] = {box.gpu_resource: box.workers * box.gpus_per_candidate}
    elif box.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, box.gpus))
        options["num_gpus"] = len(box.gpus)
    try:
        ray.init(**options)
    except Exception as exc:
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        raise ParallelError(f"cannot start or join {where}: {type(exc).__name__}: "
                            f"{(str(exc).strip().splitlines() or [''])[0]}") from None


def probe(address: str, timeout_s: float = 5) -> None:
    """A host:port that nothing answers on fails here in seconds (Ray itself retries for many minutes)."""
    host, _, port = address.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ParallelError(f"no Ray cluster answers at {address} (sandbox.ray_address or RAY_ADDRESS): "
                            f"{exc.strerror or exc}") from None


def preflight(task):
    """What a parallel run checks before it writes anything: enough GPUs in sandbox.gpus, Ray, the cluster and its
    GPU resource. Raises ParallelError."""
    box = task.sandbox
    need = box.workers * box.gpus_per_candidate
    if box.gpus and len(box.gpus) < need:
        raise ParallelError(f"sandbox.workers {box.workers} x gpus_per_candidate {box.gpus_per_candidate} needs "
                            f"{need} GPUs, sandbox.gpus lists {len(box.gpus)}: {box.gpus}")
    ray = import_ray()
    connect(task)
    have = ray.cluster_resources().get(box.gpu_resource, 0)
    if have < need:
        hint = ("; without GPUs, a custom sandbox.gpu_resource (any name) gives a local Ray instance one slot per "
                "worker" if box.gpu_resource == "GPU" and not have else "")
        raise ParallelError(f"sandbox.workers {box.workers} x gpus_per_candidate {box.gpus_per_candidate} needs "
                            f"{need} {box.gpu_resource}, the Ray cluster has {have:g}{hint}")
    return ray
