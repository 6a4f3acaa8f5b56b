"""The container a candidate runs in, as keyword arguments for `docker.containers.create`.

A pure function of the candidate's spec and the task's sandbox settings, so that the GPU variant
can be checked without an engine (tests/sandbox/test_docker_spec.py). What goes in: the candidate tree,
the model and the import recorder, all read-only; a Unix-socket folder read-write; a tmpfs with
a size cap for HOME, TMPDIR and caches. What never goes in: the run folder (reference outputs,
trace), and any variable that looks like a secret.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping


from sandbox.base import CACHE_DIRS, ServerSpec, build_env, runtime_env, serve_argv

TREE, MODEL, RECORDER, IO = "/sandbox/tree", "/sandbox/model", "/sandbox/recorder", "/sandbox/io"
SEED = "/sandbox/seed"
SCRATCH = "/tmp"
SEEDING = ("import os, shutil, sys\n"
           f"for name in {CACHE_DIRS!r}:\n"
           f"    if os.path.isdir('{SEED}/' + name):\n"
           "        try:\n"
           f"            shutil.copytree('{SEED}/' + name, '{SCRATCH}/' + name, symlinks=True, dirs_exist_ok=True)\n"
           "        except (OSError, shutil.Error):\n"
           "            pass\n"
           "os.execvp(sys.argv[1], sys.argv[1:])")
"""The container's first process where a seed is mounted: copies its caches into the tmpfs (the only place a
server writes; a file it cannot read is left out: a cache miss, not a failed start), then becomes the server (exec:
the same process, so the init and the signals are unchanged)."""
EXPORTING = ("import os, sys, tarfile\n"
             "with tarfile.open(fileobj=sys.stdout.buffer, mode='w|') as tar:\n"
             f"    for name in {CACHE_DIRS!r}:\n"
             f"        if os.path.isdir('{SCRATCH}/' + name):\n"
             f"            tar.add('{SCRATCH}/' + name, arcname=name)")
"""Run in a trusted server's container: its caches as a tar on standard output (DockerSandbox.export_cache)."""
SOCKET_NAME, IMPORT_LOG_NAME = "server.sock", "imports.txt"
SANDBOX_UID = 10001
LABEL = "nightshift"
PASSED_HOST_ENV = ("LANG", "LC_ALL", "TZ", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
PASSED_HOST_PREFIXES = ("VLLM_",)


def slug(text: str, limit: int = 60) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]+", "-", text).strip("-.")[:limit] or "x"


def container_name(run: str, candidate: str) -> str:
    return f"nightshift-{slug(run)}-{slug(candidate)}"


def container_env(spec: ServerSpec, host_env: Mapping[str, str]) -> dict[str, str]:
    return build_env(host_env, PASSED_HOST_ENV, PASSED_HOST_PREFIXES,
                     runtime_env(SCRATCH, TREE, RECORDER, f"{IO}/{IMPORT_LOG_NAME}", user="nightshift"), spec)


def container_command(spec: ServerSpec, seeded: bool = False) -> list[str]:
    inside = spec.model_copy(update={"model_dir": Path(MODEL)})
    serve = ["python3", "-m", "vllm.entrypoints.cli.main", *serve_argv(inside), "--uds", f"{IO}/{SOCKET_NAME}"]
    return ["python3", "-c", SEEDING, *serve] if seeded else serve


def check_not_exposed(mounted: list[Path], private: list[Path]) -> None:
    """Refuse a mount that is, or contains, a private path (the run folder, reference outputs)."""
    for source in mounted:
        for secret in private:
            if secret == source or secret.is_relative_to(source):
                raise ValueError(f"refusing to mount {source}: it exposes {secret}")


def container_spec(spec: ServerSpec, *, image: str, run: str, io_dir: Path, recorder: Path,
                   owner: str, user: str, memory_gb: float, cpus: float | None, pids_limit: int,
                   tmpfs_mb: int, gpus: list[int], private: list[Path] = (),
                   host_env: Mapping[str, str] = {}) -> dict[str, Any]:
    """Keyword arguments for `client.containers.create` (all paths on the host are absolute)."""
    tree, model = Path(spec.source_tree).resolve(), Path(spec.model_dir).resolve()
    io_dir, recorder = Path(io_dir).resolve(), Path(recorder).resolve()
    seed = Path(spec.cache_seed).resolve() if spec.cache_seed and Path(spec.cache_seed).is_dir() else None
    check_not_exposed([tree, model, recorder, io_dir, *([seed] if seed else [])], [Path(p).resolve() for p in private])
    labels = {k if k.startswith(f"{LABEL}.") else f"{LABEL}.{slug(k, 40)}": str(v) for k, v in spec.labels.items()}
    labels.setdefault(f"{LABEL}.candidate", spec.name)
    labels.update({LABEL: "sandbox", f"{LABEL}.run": run, f"{LABEL}.server": spec.name, f"{LABEL}.owner": owner,
                   f"{LABEL}.io": str(io_dir)})
    memory = f"{int(memory_gb * 1024)}m"
    kwargs: dict[str, Any] = dict(
        image=image, command=container_command(spec, seeded=seed is not None), name=container_name(run, spec.name),
        labels=labels, environment=container_env(spec, host_env), user=user, working_dir=SCRATCH,
        detach=True, init=True, read_only=True, network_mode="none",
        cap_drop=["ALL"], security_opt=["no-new-privileges"], ipc_mode="private",
        pids_limit=pids_limit, mem_limit=memory, memswap_limit=memory, shm_size=f"{tmpfs_mb}m",
        tmpfs={SCRATCH: f"rw,nosuid,nodev,size={tmpfs_mb}m,mode=1777"},
        volumes={
            str(tree): {"bind": TREE, "mode": "ro"},
            str(model): {"bind": MODEL, "mode": "ro"},
            str(recorder): {"bind": RECORDER, "mode": "ro"},
            str(io_dir): {"bind": IO, "mode": "rw"},
        },
    )
    if seed is not None:  # the baseline's compile and model-inspection caches, read-only (copied in at start)
        kwargs["volumes"][str(seed)] = {"bind": SEED, "mode": "ro"}
    if cpus:
        kwargs["nano_cpus"] = int(cpus * 1e9)
    if gpus:
        from docker.types import DeviceRequest  # only the docker backend needs the docker package
        kwargs["device_requests"] = [DeviceRequest(device_ids=[str(g) for g in gpus], capabilities=[["gpu"]])]
    return kwargs
