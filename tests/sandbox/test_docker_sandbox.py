"""Containment tests against the real Docker engine and the sandbox image.

Each plants a hostile candidate (tests/hostile/acts) and checks that the expected outcome is
recorded, then that the next candidate runs normally. Needs a running engine and the image
(scripts/docker-engine.sh; scripts/docker-image.sh); skipped only when no engine answers.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from agent.world.task import Sandbox as SandboxConfig
from sandbox.base import SandboxError, ServerSpec
from sandbox.docker_backend import DockerSandbox
from sandbox.docker_spec import SANDBOX_UID
from sandbox.host import cpu_seconds, process_tree, server_pid
from tests.conftest import SANDBOX_IMAGE
from tests.hostile.plant import assert_held_work_stops, hostile_spec, observed, try_the_neighbours
from tests.real_vllm import MODEL_INSPECTION, SEED_MARK, greedy_tokens, real_vllm_spec, seeded


def hostile(tmp_path: Path, act: str, name: str | None = None, **fields) -> ServerSpec:
    return hostile_spec(tmp_path, act, name, fields.pop("startup_timeout_s", 120), **fields)

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

IMAGE = SANDBOX_IMAGE
ROOT = Path(__file__).resolve().parents[2]


def config(**overrides) -> SandboxConfig:
    fields = dict(backend="docker", image=IMAGE, memory_gb=1, pids_limit=128, tmpfs_mb=64)
    return SandboxConfig(**{**fields, **overrides})


def containers_of(engine, run_dir: Path) -> list:
    return engine.containers.list(all=True, filters={"label": f"nightshift.run={run_dir.name}"})


def assert_next_candidate_runs(engine, sandbox: DockerSandbox, tmp_path: Path) -> None:
    server = sandbox.start(hostile(tmp_path, "benign", name=f"next-{uuid.uuid4().hex[:6]}"))
    try:
        with server.sync_client(30) as client:
            assert client.get("/health").status_code == 200
            reply = client.post("/v1/completions", json={"model": "model", "prompt": "hi", "max_tokens": 3})
            assert reply.json()["choices"][0]["token_ids"] == [5, 6, 7]
        assert observed(server)["uid"] == (SANDBOX_UID if os.getuid() == 0 else os.getuid())
    finally:
        assert server.stop() == "ok"
    assert not containers_of(engine, sandbox.run_dir)


def test_benign_candidate_is_hardened_and_records_imports(engine, tmp_path, run_dir):
    sandbox = DockerSandbox(config(cpus=1), run_dir)
    server = sandbox.start(hostile(tmp_path, "benign"))
    try:
        attrs = engine.containers.get(server.container.id).attrs
        host = attrs["HostConfig"]
        assert host["ReadonlyRootfs"] and host["Init"] and host["NetworkMode"] == "none"
        assert host["CapDrop"] == ["ALL"] and host["SecurityOpt"] == ["no-new-privileges"]
        assert host["PidsLimit"] == 128 and host["Memory"] == 1 << 30 and host["NanoCpus"] == 10**9
        assert attrs["Config"]["User"] != "" and not attrs["Config"]["User"].startswith("0")
        assert attrs["Config"]["Labels"]["nightshift.candidate"] == "benign"
        mounts = {m["Destination"]: m["RW"] for m in attrs["Mounts"]}
        assert mounts == {"/sandbox/tree": False, "/sandbox/model": False, "/sandbox/recorder": False,
                          "/sandbox/io": True}
        with server.sync_client(30) as client:
            assert client.get("/health").status_code == 200
        with_async = _async_health(server)
        assert with_async == 200
        imports = server.imported_files()
        assert "vllm/entrypoints/cli/main.py" in imports and "vllm/entrypoints/cli/stub_server.py" in imports
        assert server.alive()
        pid = server_pid(server)  # the container's init as this host sees it: the benchmark counts its CPU
        assert pid == attrs["State"]["Pid"] and any("vllm.entrypoints.cli.main" in open(f"/proc/{p}/cmdline").read()
                                                    for p in process_tree(pid))
        assert cpu_seconds(pid) > 0
    finally:
        assert server.stop() == "ok"
    assert not server.alive() and not server.io_dir.exists()
    assert "vllm/entrypoints/cli/main.py" in server.imported_files()  # kept after the container is gone
    assert "serving on" in server.logs()
    assert not containers_of(engine, run_dir)


def _async_health(server) -> int:
    import asyncio

    async def probe():
        async with server.client(30) as client:
            return (await client.get("/health")).status_code

    return asyncio.run(probe())


def test_network_egress_fails(engine, tmp_path, run_dir):
    sandbox = DockerSandbox(config(), run_dir)
    server = sandbox.start(hostile(tmp_path, "network"))
    try:
        seen = observed(server)
    finally:
        assert server.stop() == "ok"
    assert seen["tcp"] and all(result != "connected" for result in seen["tcp"].values()), seen
    assert seen["dns"] and all(not result.startswith("resolved") for result in seen["dns"].values()), seen
    assert seen["interfaces"] == ["lo"]
    assert_next_candidate_runs(engine, sandbox, tmp_path)


def test_writes_fail_outside_the_capped_tmpfs(engine, tmp_path, run_dir):
    sandbox = DockerSandbox(config(tmpfs_mb=32), run_dir)
    spec = hostile(tmp_path, "writes")
    for path in [spec.source_tree, *spec.source_tree.rglob("*")]:  # so that only the read-only mount stops writes
        path.chmod(0o777 if path.is_dir() else 0o666)
    server = sandbox.start(spec)
    try:
        seen = observed(server)
    finally:
        assert server.stop() == "ok"
    writes = seen["writes"]
    for path in ("/nightshift-probe", "/etc/nightshift-probe", "/usr/nightshift-probe", "/var/nightshift-probe",
                 "/root/nightshift-probe", "/sandbox/nightshift-probe"):
        assert writes[path] in ("EROFS", "EACCES"), (path, writes[path])
    for path in ("/sandbox/tree/nightshift-probe", "/sandbox/tree/vllm/__init__.py",
                 "/sandbox/model/nightshift-probe", "/sandbox/recorder/nightshift-probe"):
        assert writes[path] == "EROFS", (path, writes[path])
    assert writes["/sandbox/recorder/sitecustomize.py"] in ("EROFS", "EACCES")
    assert writes["/tmp/nightshift-probe"] == "written" and writes["/dev/shm/nightshift-probe"] == "written"
    assert seen["fill_tmp"]["result"] == "ENOSPC" and seen["fill_tmp"]["written_mb"] <= 32, seen["fill_tmp"]
    assert not (spec.source_tree / "nightshift-probe").exists()
    assert (spec.source_tree / "vllm" / "__init__.py").read_text() == ""
    assert_next_candidate_runs(engine, sandbox, tmp_path)


def test_fork_bomb_is_contained_by_the_pids_limit(engine, tmp_path, run_dir):
    sandbox = DockerSandbox(config(pids_limit=64), run_dir)
    server = sandbox.start(hostile(tmp_path, "fork_bomb"))
    try:
        seen = observed(server)
    finally:
        assert server.stop() == "ok"
    assert seen["own_fork_during_bomb"] == "EAGAIN", seen
    assert seen["processes_during_bomb"] <= 64, seen
    assert_next_candidate_runs(engine, sandbox, tmp_path)


def test_memory_hog_is_killed_and_reported_as_oom(engine, tmp_path, run_dir):
    sandbox = DockerSandbox(config(memory_gb=0.25), run_dir)
    with pytest.raises(SandboxError) as caught:
        sandbox.start(hostile(tmp_path, "memory_hog"))
    assert caught.value.outcome == "oom", caught.value
    assert "memory_hog:" in caught.value.logs
    assert not containers_of(engine, run_dir)
    assert_next_candidate_runs(engine, sandbox, tmp_path)


def test_hang_is_killed_at_the_timeout(engine, tmp_path, run_dir):
    sandbox = DockerSandbox(config(), run_dir)
    started = time.monotonic()
    with pytest.raises(SandboxError) as caught:
        sandbox.start(hostile(tmp_path, "hang", startup_timeout_s=8))
    elapsed = time.monotonic() - started
    assert caught.value.outcome == "timeout", caught.value
    assert 8 <= elapsed < 30, elapsed
    assert "ignoring SIGTERM" in caught.value.logs
    assert not containers_of(engine, run_dir)
    assert_next_candidate_runs(engine, sandbox, tmp_path)


def test_secrets_are_out_of_reach(engine, tmp_path, run_dir, monkeypatch):
    marker = "NIGHTSHIFT" + "-PLANTED-" + uuid.uuid4().hex
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HF_TOKEN", "VLLM_API_KEY", "NIGHTSHIFT_SECRET"):
        monkeypatch.setenv(name, marker)
    (run_dir / f"references-{marker}.jsonl").write_text(f'{{"tokens": [1, 2], "secret": "{marker}"}}\n')
    (run_dir / "trace.jsonl").write_text(f'{{"event": "x", "secret": "{marker}"}}\n')
    (run_dir / "parity-prompts.jsonl").write_text(f'{{"prompt": "{marker}"}}\n')
    spec = hostile(tmp_path, "secrets", env={"OPENAI_API_KEY": marker, "HF_HUB_TOKEN": marker,
                                            "NIGHTSHIFT_CONTROL": marker})
    (spec.source_tree / f"control-{marker}.txt").write_text(marker)  # a positive control the scan must find
    sandbox = DockerSandbox(config(memory_gb=2), run_dir)
    server = sandbox.start(spec.model_copy(update={"startup_timeout_s": 300}))
    try:
        seen = observed(server)
    finally:
        assert server.stop() == "ok"
    assert seen["files_scanned"] > 10_000, seen["files_scanned"]
    control = {"env NIGHTSHIFT_CONTROL", f"name /sandbox/tree/control-{marker}.txt",
               f"content /sandbox/tree/control-{marker}.txt"}
    assert control <= set(seen["hits"]), seen["hits"]
    leaks = [hit for hit in seen["hits"] if hit not in control and not hit.endswith("/environ")]
    assert leaks == [], leaks  # /proc/*/environ hits are the control variable, seen by each process
    assert_next_candidate_runs(engine, sandbox, tmp_path)


DEAD_HARNESS = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from agent.world.task import Sandbox
from sandbox.base import ServerSpec
from sandbox.docker_backend import DockerSandbox
sandbox = DockerSandbox(Sandbox(backend="docker", image={image!r}, memory_gb=1, pids_limit=128, tmpfs_mb=64),
                        Path({run!r}))
server = sandbox.start(ServerSpec(name="orphan", source_tree={tree!r}, model_dir={model!r}, startup_timeout_s=120))
print("started", server.container.name, flush=True)
time.sleep(3600)
"""


def test_leftovers_of_a_killed_run_are_reaped_on_the_next_start(engine, tmp_path, run_dir):
    dead_run = tmp_path / f"dead-{uuid.uuid4().hex[:8]}"
    dead_run.mkdir()
    orphan = hostile(tmp_path, "benign", name="orphan")
    script = DEAD_HARNESS.format(root=str(ROOT), image=IMAGE, run=str(dead_run), tree=str(orphan.source_tree),
                                 model=str(orphan.model_dir))
    harness = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert harness.stdout.readline().startswith("started"), "the doomed harness did not start its server"
    finally:
        os.kill(harness.pid, signal.SIGKILL)
        harness.wait()
    [left] = containers_of(engine, dead_run)
    assert left.status == "running"
    io_dir = Path(left.labels["nightshift.io"])
    assert io_dir.exists()

    sandbox = DockerSandbox(config(), run_dir)
    server = sandbox.start(hostile(tmp_path, "benign", name="survivor"))  # the first start reaps
    try:
        assert not containers_of(engine, dead_run) and not io_dir.exists()
        assert DockerSandbox(config(), tmp_path / "another-run").reap() == 0  # a live run's server stays
        assert server.alive()
    finally:
        assert server.stop() == "ok"
    assert_next_candidate_runs(engine, sandbox, tmp_path)


@pytest.mark.vllm
@pytest.mark.contained  # one start and one completion: beside the heavy tier
@pytest.mark.timeout(1800)
def test_real_vllm_serves_a_greedy_completion_in_the_container(engine, vllm_tree, local_greedy_tokens, real_vllm_seed, run_dir):
    """Real vLLM starts and serves in a container of the sandbox image, imports from the mounted candidate tree, and
    returns the greedy tokens the same tree returns served locally."""
    sandbox = DockerSandbox(config(memory_gb=8, pids_limit=4096, tmpfs_mb=2048), run_dir)
    started = time.monotonic()
    server = sandbox.start(real_vllm_spec(vllm_tree, seed=real_vllm_seed))
    startup_s = time.monotonic() - started
    try:
        tokens = greedy_tokens(server)
        # started from the local server's caches (vLLM's model inspection among them), and exports its own
        assert seeded(sandbox, server, run_dir / "exported") == [SEED_MARK, MODEL_INSPECTION]
        imports = server.imported_files()
        assert "vllm/entrypoints/openai/api_server.py" in imports or "vllm/entrypoints/cli/serve.py" in imports
        assert any(f.startswith("vllm/v1/") for f in imports)
    finally:
        outcome = server.stop()
    assert outcome == "ok", server.logs()
    print(f"real vLLM in the container: healthy after {startup_s:.0f}s, tokens {tokens}")
    assert tokens == local_greedy_tokens, "the container changed the greedy output"


def test_a_candidate_cannot_reach_the_runs_other_processes_or_files(engine, tmp_path, run_dir):
    """The candidate that wins by slowing the incumbent, in a container: told the host pids of another server of
    the run (a container too) and of the harness, the marker in the other server's environment, and host paths of
    the run folder and of the other server's socket folder and scratch, it sees, signals, traces and opens none of
    them; the other server runs on, never stopped."""
    sandbox = DockerSandbox(config(), run_dir)
    seen, told = try_the_neighbours(sandbox, tmp_path, run_dir, startup_timeout_s=120)
    assert seen["act"] == "neighbours", seen
    assert seen["marked"] == [] and seen["signalled"] == [] and seen["traced"] == [], seen
    assert seen["read"] == [], seen
    assert told["stopped"] == [] and told["answers"], told
    assert_next_candidate_runs(engine, sandbox, tmp_path)


def test_held_while_the_other_side_is_measured_its_escaped_work_stops_too(engine, tmp_path, run_dir):
    """A candidate's busy loop in a grandchild that left its session and process group (setsid, double fork) is
    still in its container: paused, it uses no CPU; let run, it does (the control)."""
    sandbox = DockerSandbox(config(), run_dir)
    server = sandbox.start(hostile(tmp_path, "idle_work"))
    try:
        assert_held_work_stops(server)
    finally:
        assert server.stop() == "ok"
    assert not containers_of(engine, run_dir)

