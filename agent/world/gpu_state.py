"""The GPU's state over a timed pass, read with NVML (the optional `gpu` extra, nvidia-ml-py): clocks,
temperature, power, throttle reasons, utilisation, and how busy processes other than the measured server
were. Without NVML or a GPU it records nothing (None), without error."""
from __future__ import annotations

import os
import threading
import time

from sandbox.host import process_tree, server_pid
from traces.schema import GpuPass

CLOCK_SM, CLOCK_MEM, TEMPERATURE_GPU = 1, 2, 0
THROTTLES = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}
"""NVML clock-event reasons that slow a busy GPU down (idle, application clocks and sync boost are not)."""
NEIGHBOUR_BUSY = 10.0
"""SM utilisation (%) of another process on the GPU above which a pass is flagged."""
NEIGHBOUR_GRACE_S = 1.5
"""A process's first samples in a pass still average over the time before it (on the H200 a neighbour idle
through the pass, busy until it began, read 42% then): they are not counted."""


def load_nvml():
    """The pynvml module, initialised, or None where it is not installed or no GPU answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
    except Exception:
        return None


def server_pids(server) -> set[int] | None:
    """The server's processes where the harness sees them (a local process group); None where it does not."""
    pid = server_pid(server)
    return process_tree(pid) if pid is not None else None


class GpuMonitor:
    """Samples the GPUs every `interval_s` while the pass runs (a context manager)."""

    def __init__(self, gpus: list[int], own_pids: set[int] | None = None, interval_s: float = 0.25, nvml=None,
                 grace_s: float = NEIGHBOUR_GRACE_S, clock=time.monotonic):
        self.gpus, self.own, self.clock = list(gpus), own_pids, clock
        self.interval_s = interval_s
        self.nvml = (nvml if nvml is not None else load_nvml()) if gpus else None
        self.readings: list[dict] = []
        self.neighbour: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen = 0
        self.grace_s, self._began = grace_s, 0.0

    def __enter__(self) -> GpuMonitor:
        self._began = self.clock()
        if self.nvml is not None:
            self._skip_buffered()
            self.read()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.read()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.read()

    def read(self) -> None:
        n = self.nvml
        for index in self.gpus:
            try:
                h = n.nvmlDeviceGetHandleByIndex(index)
                reasons = n.nvmlDeviceGetCurrentClocksThrottleReasons(h)
                self.readings.append({
                    "sm": n.nvmlDeviceGetClockInfo(h, CLOCK_SM), "mem": n.nvmlDeviceGetClockInfo(h, CLOCK_MEM),
                    "temp": n.nvmlDeviceGetTemperature(h, TEMPERATURE_GPU), "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000,
                    "util": n.nvmlDeviceGetUtilizationRates(h).gpu,
                    "throttles": [name for bit, name in THROTTLES.items() if reasons & bit]})
            except Exception:
                continue
            if self.own is not None:
                self._neighbours(h)

    def _skip_buffered(self) -> None:
        """NVML's buffer also holds samples from before the pass (the other server's pass that just ended):
        only samples stamped after the newest one now count."""
        if self.own is None:
            return
        for index in self.gpus:
            try:
                samples = self.nvml.nvmlDeviceGetProcessUtilization(self.nvml.nvmlDeviceGetHandleByIndex(index), 0)
            except Exception:
                continue
            self._seen = max([self._seen, *(s.timeStamp for s in samples)])

    def _neighbours(self, handle) -> None:
        try:
            samples = self.nvml.nvmlDeviceGetProcessUtilization(handle, self._seen)
        except Exception:  # NVML answers "not found" when no process sampled since `_seen`
            return
        early = self.clock() - self._began < self.grace_s
        for s in samples:
            self._seen = max(self._seen, s.timeStamp)
            if not early and s.pid not in self.own and s.pid != os.getpid():
                self.neighbour = max(self.neighbour or 0.0, float(s.smUtil))

    def summary(self) -> GpuPass | None:
        r = self.readings
        if not r:
            return None
        return GpuPass(gpus=self.gpus, readings=len(r), sm_clock_mhz_min=min(x["sm"] for x in r),
                       sm_clock_mhz_max=max(x["sm"] for x in r), mem_clock_mhz_min=min(x["mem"] for x in r),
                       temperature_c_max=max(x["temp"] for x in r),
                       power_w_mean=round(sum(x["power_w"] for x in r) / len(r), 1),
                       utilization_mean=round(sum(x["util"] for x in r) / len(r), 1),
                       throttle_reasons=sorted({t for x in r for t in x["throttles"]}),
                       neighbour_utilization_max=self.neighbour)


def flags(state: GpuPass | None) -> list[str]:
    """Why a pass may not have measured the server alone."""
    if state is None:
        return []
    out = [f"throttled: {', '.join(state.throttle_reasons)}"] if state.throttle_reasons else []
    if state.neighbour_utilization_max is not None and state.neighbour_utilization_max > NEIGHBOUR_BUSY:
        out.append(f"neighbour busy: another process used up to {state.neighbour_utilization_max:.0f}% of the SMs")
    return out
