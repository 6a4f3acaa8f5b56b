"""The pass monitor's neighbour check (agent/world/gpu_state.py) against real NVML: a process that kept the GPU
busy only before a pass must not count, one busy during the pass must. Each case runs with the monitor as
it is and with NVML's buffered samples not skipped (as before 2026-12-02).

    python3 gpu/nvml_neighbour_probe.py [out.json]
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time


def burn(seconds: float, busy, done=None) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    busy.set()
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    if done is not None:  # then idle but alive, as a server between its passes
        done.set()
        time.sleep(6)


def neighbour(ctx, seconds: float, idle_after: bool = False):
    busy, done = ctx.Event(), ctx.Event()
    process = ctx.Process(target=burn, args=(seconds, busy, done if idle_after else None))
    process.start()
    busy.wait(120)
    if idle_after:
        done.wait(120)
    return process


def measure(skip_buffered: bool, pass_s: float = 3.0, grace_s: float = 1.5) -> float | None:
    from agent.world.gpu_state import GpuMonitor

    monitor = GpuMonitor([0], own_pids={os.getpid()}, interval_s=0.25, grace_s=grace_s)
    if not skip_buffered:
        monitor._skip_buffered = lambda: None
    with monitor:
        time.sleep(pass_s)
    return monitor.summary().neighbour_utilization_max


def main() -> None:
    ctx = mp.get_context("spawn")
    rows = []
    for skip, grace in ((True, 1.5), (True, 0.0), (False, 0.0)):
        measure_ = lambda s: measure(s, grace_s=grace)  # noqa: E731
        neighbour(ctx, 3.0).join()  # busy for 3 s, then gone before the pass begins
        rows.append({"case": "busy before the pass, then exited", "skip_buffered": skip,
                     "grace_s": grace, "neighbour_max": measure_(skip)})
        process = neighbour(ctx, 3.0, idle_after=True)  # busy for 3 s, then alive and idle through the pass
        rows.append({"case": "busy before the pass, idle during it", "skip_buffered": skip,
                     "grace_s": grace, "neighbour_max": measure_(skip)})
        process.join()
        process = neighbour(ctx, 4.0)  # busy through the pass
        rows.append({"case": "busy during the pass", "skip_buffered": skip, "grace_s": grace, "neighbour_max": measure_(skip)})
        process.join()
    for row in rows:
        print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
