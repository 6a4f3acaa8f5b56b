"""After a candidate: is the memory of its GPUs back to idle? Read with nvidia-smi, where present."""
from __future__ import annotations

import logging
import shutil
import subprocess
import time

log = logging.getLogger(__name__)

IDLE_MARGIN_MIB = 512


def gpu_memory_used_mib(gpus: list[int]) -> dict[int, int] | None:
    """Memory in use on each GPU, in MiB; None where nvidia-smi is absent or fails."""
    if not gpus or shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
             "-i", ",".join(str(g) for g in gpus)],
            capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError) as exc:
        log.warning("nvidia-smi failed: %s", exc)
        return None
    used = {}
    for line in out.strip().splitlines():
        index, mib = (field.strip() for field in line.split(","))
        used[int(index)] = int(float(mib))
    return used


def wait_until_idle(gpus: list[int], idle_mib: dict[int, int], timeout_s: float = 60,
                    margin_mib: int = IDLE_MARGIN_MIB) -> tuple[bool, str]:
    """Wait until every GPU uses no more than its idle level plus a margin; (idle?, why)."""
    if not gpus:
        return True, "no GPUs requested"
    deadline = time.monotonic() + timeout_s
    while True:
        used = gpu_memory_used_mib(gpus)
        if used is None:
            reason = "nvidia-smi not available on this host; GPU idle check skipped"
            log.info(reason)
            return True, reason
        busy = {g: mib for g, mib in used.items() if mib > idle_mib.get(g, 0) + margin_mib}
        if not busy:
            return True, f"GPUs {gpus} back to idle ({used} MiB used)"
        if time.monotonic() >= deadline:
            reason = f"GPU memory not back to idle after {timeout_s:.0f}s: {busy} MiB used, idle {idle_mib}"
            log.warning(reason)
            return False, reason
        time.sleep(1)
