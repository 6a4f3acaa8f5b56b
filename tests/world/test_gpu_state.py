"""GPU state per pass: read through NVML's interface (here a fake NVML with a GPU that throttles and a
neighbour process), and nothing at all on a machine without NVML or a GPU."""
import os
import time
from types import SimpleNamespace

from agent.world.gpu_state import GpuMonitor, flags, load_nvml, process_tree


class FakeNvml:
    """NVML's calls as nvidia-ml-py spells them, for one GPU that starts to throttle (hw thermal) midway."""

    def __init__(self, neighbour_util: int = 0, earlier_util: int = 0):
        self.calls, self.neighbour_util = 0, neighbour_util
        self.buffer = [(int(time.time() * 1e6) - 500_000, earlier_util)]  # NVML keeps recent samples (µs stamps)

    def nvmlDeviceGetHandleByIndex(self, index):
        self.calls += 1
        return index

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return 0x1 if self.calls < 3 else 0x40 | 0x2  # idle, then hw thermal (+ application clocks, not a throttle)

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return (1980 if self.calls < 3 else 1500) if kind == 1 else 3201

    def nvmlDeviceGetTemperature(self, handle, kind):
        return 60 + self.calls

    def nvmlDeviceGetPowerUsage(self, handle):
        return 400_000

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=90, memory=40)

    def nvmlDeviceGetProcessUtilization(self, handle, since):
        """The buffered samples stamped after `since` (as NVML does), one new one per call."""
        self.buffer.append((int(time.time() * 1e6), self.neighbour_util))
        return [SimpleNamespace(pid=os.getpid() + 10**6, smUtil=util, timeStamp=at) for at, util in self.buffer
                if at > since]


def test_a_throttling_gpu_with_a_busy_neighbour_is_recorded_and_flagged():
    with GpuMonitor([0], own_pids={os.getpid()}, interval_s=0.01, nvml=FakeNvml(neighbour_util=35),
                    grace_s=0) as monitor:
        time.sleep(0.1)
    state = monitor.summary()
    assert state.gpus == [0] and state.readings >= 3
    assert (state.sm_clock_mhz_max, state.sm_clock_mhz_min, state.mem_clock_mhz_min) == (1980, 1500, 3201)
    assert state.temperature_c_max > 60 and state.power_w_mean == 400.0 and state.utilization_mean == 90.0
    assert state.throttle_reasons == ["hw_thermal"] and state.neighbour_utilization_max == 35.0
    assert flags(state) == ["throttled: hw_thermal", "neighbour busy: another process used up to 35% of the SMs"]


def test_a_neighbour_busy_only_before_the_pass_is_not_counted():
    """On the H200 every pass right after the other server's pass was flagged with that server at 31-60% of the
    SMs: NVML returned its buffered samples from before the pass began."""
    nvml = FakeNvml(neighbour_util=2, earlier_util=60)
    with GpuMonitor([0], own_pids={os.getpid()}, interval_s=0.01, nvml=nvml, grace_s=0) as monitor:
        time.sleep(0.05)
    assert monitor.summary().neighbour_utilization_max == 2.0
    assert not [f for f in flags(monitor.summary()) if f.startswith("neighbour")]


def test_a_neighbours_first_samples_in_a_pass_are_not_counted():
    """A sample still averages over time before the pass: on the H200 a neighbour idle through a pass, busy
    until it began, read 42-71% in the pass's first second (gpu/nvml_neighbour_probe.py). The pass's clock is the
    test's, and the sampler's own thread never wakes, so a loaded machine cannot move a reading past the grace."""
    nvml, now = FakeNvml(neighbour_util=70), [0.0]
    with GpuMonitor([0], own_pids={os.getpid()}, interval_s=3600, nvml=nvml, grace_s=0.1,
                    clock=lambda: now[0]) as monitor:
        now[0] = 0.05
        monitor.read()  # inside the grace: the neighbour's 70% is not counted
        assert monitor.neighbour is None
        nvml.neighbour_util, now[0] = 3, 0.2
        monitor.read()
    assert monitor.summary().readings == 4 and monitor.summary().neighbour_utilization_max == 3.0


def test_a_quiet_gpu_is_not_flagged_and_unknown_server_processes_skip_the_neighbour_check():
    nvml = FakeNvml(neighbour_util=80)
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons = lambda handle: 0x1
    with GpuMonitor([0], own_pids=None, interval_s=0.01, nvml=nvml) as monitor:
        time.sleep(0.03)
    assert monitor.summary().neighbour_utilization_max is None and flags(monitor.summary()) == []


def test_without_nvml_or_gpus_nothing_is_recorded():
    with GpuMonitor([], own_pids=set()) as monitor:
        pass
    assert monitor.summary() is None and flags(None) == []
    if load_nvml() is None:  # this machine: no nvidia-ml-py or no GPU
        with GpuMonitor([0], own_pids=set()) as monitor:
            pass
        assert monitor.summary() is None


def test_the_server_process_tree_includes_children():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert {os.getpid(), child.pid} <= process_tree(os.getpid())
    finally:
        child.kill()
        child.wait()
