"""Checks that run before any server starts, so a broken environment fails in seconds, not per server."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sandbox.base import last_error_line
from traces.errors import NightshiftError

IMPORT_CHECK = """
import importlib.util
if importlib.util.find_spec("torchvision"):
    import torchvision
import vllm.entrypoints.cli.main, vllm.config
"""
"""What `vllm serve` imports before it reads its arguments; vllm.config pulls in transformers, which
imports torchvision whenever it is installed."""
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
FIX = ("PyPI's torchvision/torchaudio/torchcodec do not load against vLLM's CPU torch: "
       "`pip uninstall torchvision torchaudio torchcodec`, or install with scripts/install.sh")


class PreflightError(NightshiftError):
    stage = "preflight"


def check_vllm_install(timeout_s: float = 300) -> None:
    """Import what every server imports at start, in a child of this Python; raises PreflightError."""
    from agent.world.checkout import installed_vllm

    installed_vllm()
    try:
        with tempfile.TemporaryDirectory(prefix="nightshift-preflight-") as cwd:  # no stray vllm/ on sys.path
            proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise PreflightError(f"importing vLLM took longer than {timeout_s:g}s; every server would too") from None
    if proc.returncode:
        cause = last_error_line(proc.stderr) or (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        fix = f"; {FIX}" if any(name in proc.stderr for name in TORCH_EXTRAS) else ""
        raise PreflightError(f"the vLLM install is broken, every server would die at start: {cause}{fix}")


def check_sandbox(config) -> None:
    """The backend's probe (sandbox/registry.py): a Docker engine that answers, namespaces that unshare can make."""
    from sandbox.registry import BACKENDS

    BACKENDS.get(config.backend).probe(config)


def check_checkout(task) -> None:
    """The installed vLLM is the task's, and its checkout (if there is one yet) is clean and tagged."""
    from agent.world.checkout import default_checkout_path, installed_vllm, open_checkout

    _, installed = installed_vllm()
    if installed != task.target.vllm_version:
        raise PreflightError(f"the task targets vLLM {task.target.vllm_version}, but {installed} is installed")
    path = task.target.checkout or default_checkout_path(installed)
    if task.target.checkout is not None or path.exists():
        open_checkout(path, installed)


def check_run(task) -> None:
    """What a run checks before it writes anything, cheapest first (RunSetup checks again, later)."""
    check_sandbox(task.sandbox)
    check_checkout(task)
    check_vllm_install()
    from agent.world.checkout import installed_vllm
    from agent.world.serve_args import check_levers

    check_levers(task, installed_vllm()[1])


def check_proposer(task, repo) -> list[str]:
    """The check the task's proposer kind registered (agent/extensions.py), if any: its warnings."""
    from agent.extensions import PROPOSERS

    return PROPOSERS.get(task.proposer.kind).run_check(task, repo)


def check_patches(task, repo) -> list[str]:
    """Each queued patch `git apply --check`ed against the run's base (the version tag), in a scratch index:
    raises PreflightError if none applies; returns a warning for each that does not (a patch may build on
    an earlier one, which applies to the branch only once that one is kept)."""
    if task.proposer.kind != "queue":
        return []
    from agent.world.checkout import version_tag
    from agent.proposers.queue import QueueProposer, has_diff

    base = version_tag(task.target.vllm_version)
    failed: dict[str, str] = {}
    pending = QueueProposer(task.proposer.patches).pending
    with tempfile.TemporaryDirectory(prefix="nightshift-patches-") as scratch:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(scratch) / "index")}
        repo.git.read_tree(base, env=env)
        for path in pending:
            text = path.read_text()
            if not has_diff(text):
                continue  # serving flags only
            proc = subprocess.run(["git", "apply", "--check", "--cached", "--whitespace=nowarn", "-"],
                                  input=text if text.endswith("\n") else text + "\n", capture_output=True,
                                  text=True, cwd=repo.working_dir, env=env)
            if proc.returncode:
                errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
                cause = errors[0][len("error: "):].replace(" in index", "") if errors else f"exit {proc.returncode}"
                failed[path.name] = cause
    if failed and len(failed) == len(pending):
        first = next(iter(failed.items()))
        raise PreflightError(f"no queued patch applies to {base} in {repo.working_dir} ({len(failed)} checked; "
                             f"{first[0]}: {first[1]})")
    return [f"{name} does not apply to {base} ({cause}); it is still proposed, after the patches before it"
            for name, cause in failed.items()]


GIB = 1 << 30
RUNTIME_BYTES = 2 * GIB
"""A GPU server's memory beside its weights and KV cache (CUDA context, activations, graph pools): an E2B production
server on an H100 held 10.74 GiB before it allocated its KV cache, 8.86 GiB of it weights
(benchmarks/results/h200-window-5.md)."""
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def step_servers(task) -> list[tuple[str, dict]]:
    """The servers one GPU holds at once at the busiest step of a run, each with its engine arguments: with parity
    servers of their own, the reference and the incumbent's production server beside a candidate's parity and
    production servers (the baseline phase holds as many at most: two parity servers, the production baseline and
    the noise floor's second one); without, the reference, the incumbent and the candidate."""
    engine, reference = dict(task.engine.args), reference_args(task)
    if not task.parity.dedicated:
        return [("reference", reference), ("incumbent", engine), ("candidate", engine)]
    return [("reference", reference), ("incumbent", engine), ("candidate's parity server", reference),
            ("candidate", engine)]


def reference_args(task) -> dict:
    """The engine arguments of the reference (and of every parity server): the task's parity.args on top where it
    has parity servers of their own, the production ones where not."""
    engine = dict(task.engine.args)
    return {**engine, **task.parity.args} if task.parity.dedicated else engine


def study_servers(task, copies: int) -> list[tuple[str, dict]]:
    """The servers a study (`nightshift noise`) holds at once, all started together: the audit's reference (a parity
    server where the task has them, as in a run; none with the audit off) and `copies` production servers."""
    return ([("reference", reference_args(task))] if task.audit.enabled else []) + \
        [(f"production server {i + 1}", dict(task.engine.args)) for i in range(copies)]


def server_bytes(args: dict, weights_bytes: int, total_bytes: int) -> int:
    """What one server takes: its weights, its fixed KV cache (kv_cache_memory_bytes) and its runtime; without a
    fixed KV cache, vLLM takes gpu_memory_utilization of the whole GPU for all of it."""
    if args.get("kv_cache_memory_bytes"):
        return weights_bytes + int(args["kv_cache_memory_bytes"]) + RUNTIME_BYTES
    return int(float(args.get("gpu_memory_utilization", DEFAULT_GPU_MEMORY_UTILIZATION)) * total_bytes)


def check_gpu_memory(task, weights_bytes: int, total_bytes: int, device: str, servers: list | None = None) -> None:
    """The servers of the busiest step (`servers`, a run's step_servers by default) fit on the GPU together; else
    PreflightError, since every candidate's start would then fail for want of memory that the run's own servers
    hold, and be recorded as the candidate's crash."""
    consequence = "every candidate's start would fail" if servers is None else "some would fail to start"
    servers = [(name, server_bytes(args, weights_bytes, total_bytes))
               for name, args in (step_servers(task) if servers is None else servers)]
    need = sum(size for _, size in servers)
    if need <= total_bytes:
        return
    each = ", ".join(f"{name} {size / GIB:.1f}" for name, size in servers)
    raise PreflightError(
        f"the servers of one step do not fit on this GPU together: {each} GiB, about {need / GIB:.1f} GiB "
        f"(weights {weights_bytes / GIB:.2f} GiB each, KV caches as engine.args and parity.args set them, "
        f"{RUNTIME_BYTES / GIB:.0f} GiB of runtime each), and the {device} has {total_bytes / GIB:.1f} GiB: "
        f"{consequence} for want of memory. Lower kv_cache_memory_bytes or gpu_memory_utilization "
        f"(engine.args, parity.args), or run on a larger GPU")


def weights_bytes(model_dir: Path) -> int:
    """The bytes of a model folder's weight files."""
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt") for p in Path(model_dir).glob(pattern))


def check_model_fits(task, model_dir: Path, servers: list | None = None) -> None:
    """check_gpu_memory on the task's first GPU, where NVML can say what it holds; nothing for a CPU task."""
    if not task.sandbox.gpus:
        return
    from agent.world.environment import gpu_memory

    found = gpu_memory(task.sandbox.gpus[0])
    if found is not None:
        device, total = found
        check_gpu_memory(task, weights_bytes(model_dir), total, device, servers)
