"""Ray, all of it: joining or starting the cluster, what a parallel run checks before it writes anything, and the
Ray slots the coordinator (agent/run/loop.py) schedules candidates over: one Worker (agent/run/worker.py) per GPU
as a Ray actor (`sandbox.workers: N`, docs/parallel.md). A worker that dies leaves the pool, its candidate
recorded as a crash at the stage its status file last named (agent/run/phases.py)."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

from agent.run.reaping import reap_workers
from agent.run.setup import RunSetup
from agent.run.worker import Worker, plain_setup
from sandbox.local import reap_servers
from traces.errors import NightshiftError
from traces.schema import Proposal

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


def DEATHS(ray) -> tuple:
    names = ("RayActorError", "ActorDiedError", "WorkerCrashedError", "NodeDiedError", "ActorUnavailableError")
    return tuple(getattr(ray.exceptions, name) for name in names if hasattr(ray.exceptions, name))


class RaySlots:
    """One Ray actor per worker, each on `sandbox.gpus_per_candidate` GPUs (or a custom `sandbox.gpu_resource`)."""

    remote = True

    def __init__(self, setup: RunSetup, sandbox_factory: Callable | None = None):
        self.s, self.sandbox_factory = setup, sandbox_factory
        self.slots: list = []
        self.flight: dict = {}
        """Ray object ref -> (slot, candidate) for every evaluation under way."""
        self.view: tuple[str, Path] | None = None
        """The branch head's tree, which proposers read."""
        self.ray = None

    def start(self, head: str, emit: Callable) -> None:
        """Spawn the workers; each one's baseline phase on its GPU, its records emitted in worker order."""
        from agent.run.loop import Slot

        self.ray = ray = preflight(self.s.task)
        box = self.s.task.sandbox
        options = ({"num_gpus": box.gpus_per_candidate} if box.gpu_resource == "GPU"
                   else {"resources": {box.gpu_resource: box.gpus_per_candidate}})
        remote = ray.remote(max_restarts=0, max_task_retries=0, **options)(RayWorker)
        plain = plain_setup(self.s)
        for index in range(box.workers):
            actor = remote.remote(index, plain, box.gpu_resource, self.sandbox_factory)
            self.slots.append(Slot(index, actor, time.time()))
        starts = [slot.handle.start.remote(head) for slot in self.slots]
        for ref in starts:
            try:
                events = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                raise exc.cause if isinstance(exc.cause, Exception) else exc
            for event in events:
                emit(event)

    def submit(self, slot, proposal: Proposal, head: str) -> None:
        slot.candidate = proposal.candidate
        self.flight[slot.handle.evaluate.remote(proposal, head)] = (slot, proposal.candidate)

    def in_flight(self) -> list:
        return list(self.flight.values())

    def wait(self, timeout: float) -> list:
        ray = self.ray
        ready, _ = ray.wait(list(self.flight), num_returns=1, timeout=timeout)
        done = []
        for ref in ready:
            slot, n = self.flight.pop(ref)
            try:
                done.append((slot, n, ray.get(ref)))
            except DEATHS(ray) as exc:
                done.append((slot, n, exc))
                self.lose(slot)
            except ray.exceptions.RayTaskError as exc:
                raise exc.cause if isinstance(exc.cause, Exception) else exc
        return done

    def lose(self, slot) -> None:
        """A dead worker: its GPU leaves the pool, and the servers it left behind are killed."""
        slot.ended = time.time()
        reap_servers(self.s.run_dir / "workers")

    def adopt(self, slot, candidate: int, commit: str) -> None:
        slot.handle.adopt.remote(candidate, commit)

    def status_of(self, slot) -> dict:
        """What the worker last wrote of itself (agent/run/worker.py): its GPUs, candidate and stage."""
        try:
            return json.loads((self.s.run_dir / "workers" / f"w{slot.index}" / "status.json").read_text())
        except (OSError, ValueError):
            return {"worker": slot.index, "gpus": [], "candidate": 0, "stage": "starting"}

    def rows(self) -> list[dict]:
        return [{**self.status_of(slot), **({"stage": "dead"} if slot.ended is not None else {})}
                for slot in self.slots]

    def checkout(self, head: str) -> Path:
        if self.view is None or self.view[0] != head:
            if self.view is not None:
                self.s.workspace.remove(self.view[1])
            self.view = (head, self.s.workspace.worktree(f"head-{head[:12]}"))
        return self.view[1]

    def incumbent_args(self, head: str) -> dict:
        from agent.run.workspace import serve_args_at

        return dict(serve_args_at(self.s.repo, head) or self.s.task.engine.args)

    def final(self) -> None:
        """No end-of-run audit here: a Ray worker does not take a flagged incumbent back."""

    def close(self) -> None:
        if not self.slots:
            return
        ray = import_ray()
        closing = [slot.handle.close.remote() for slot in self.slots if slot.ended is None]
        if closing:  # ray.wait refuses an empty list; a dead worker's ref is ready, its failure raised only by ray.get
            try:
                ray.wait(closing, num_returns=len(closing), timeout=60)
            except ray.exceptions.RayError:
                pass  # Ray itself failing (its node gone): the workers are killed next, their servers reaped
        for slot in self.slots:
            ray.kill(slot.handle)
            slot.ended = slot.ended or time.time()
        reap_workers(self.s.run_dir)  # ray.kill returns before the actor is gone, and its servers are not Ray's
        if self.view is not None:
            self.s.workspace.remove(self.view[1])


class RayWorker(Worker):
    """A Worker as a Ray actor: its GPUs are the ones Ray gave it."""

    def __init__(self, index: int, plain: dict, resource: str, sandbox_factory=None):
        import ray

        gpus = [int(g) for g in ray.get_gpu_ids()] if resource == "GPU" else []
        super().__init__(*Worker.remote_parts(index, plain, gpus, sandbox_factory))


def Parallel(setup, proposer, **options):
    """The coordinator over Ray slots (agent/run/loop.py's Loop with sandbox.workers > 1)."""
    from agent.run.loop import Loop

    return Loop(setup, proposer, **options)
