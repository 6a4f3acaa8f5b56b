"""Containment tests for the namespace backend (sandbox/namespace.py), against real processes.

The same contract as tests/sandbox/test_docker_sandbox.py: each plants a hostile candidate
(tests/hostile/acts), checks the recorded outcome, then that the next candidate runs normally.
Skipped only where `unshare` cannot make the namespaces (not root, and no user namespaces).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from sandbox import cgroups, make_sandbox
from sandbox.base import SandboxError, ServerSpec
from sandbox.config import SandboxConfig
from sandbox import priority
from sandbox.namespace import IO_ROOT, NamespaceSandbox, NamespaceUnavailable, probe
from tests.hostile.plant import assert_held_work_stops, hostile_spec, observed, try_the_neighbours
from tests.real_vllm import MODEL_INSPECTION, SEED_MARK, greedy_tokens, real_vllm_spec, seeded

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.contained, pytest.mark.slow, pytest.mark.timeout(900)]  # root: namespaces, cgroups


def hostile(tmp_path: Path, act: str, name: str | None = None, **fields) -> ServerSpec:
    return hostile_spec(tmp_path, act, name, fields.pop("startup_timeout_s", 60), **fields)


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    try:
        return probe()
    except NamespaceUnavailable as exc:
        if os.geteuid() == 0:
            pytest.fail(f"running as root, yet: {exc}")
        pytest.skip(str(exc))


def config(**overrides) -> SandboxConfig:
    return SandboxConfig(**{"backend": "namespace", "memory_gb": 1, "pids_limit": 128, "tmpfs_mb": 64, **overrides})


def leftovers(run_dir: Path) -> list[Path]:
    """Socket folders (with their cgroups) of this run's servers that still exist."""
    found = []
    for state in IO_ROOT.glob("*/state.json"):
        try:
            if json.loads(state.read_text())["run"] == str(run_dir.resolve()):
                found.append(state.parent)
        except (OSError, ValueError, KeyError):
            pass
    return found


def processes_of(uid: int) -> list[int]:
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] != "Z":
            pids.append(int(status.parent.name))
    return pids


def processes_in(pid_ns: str) -> list[int]:
    """Live processes in a pid namespace (`pid:[inode]`), as far as this process may look."""
    pids = []
    for ns in Path("/proc").glob("[0-9]*/ns/pid"):
        try:
            if os.readlink(ns) == pid_ns and _running(int(ns.parent.parent.name)):
                pids.append(int(ns.parent.parent.name))
        except OSError:
            continue
    return pids


def assert_next_candidate_runs(sandbox: NamespaceSandbox, tmp_path: Path) -> None:
    server = sandbox.start(hostile(tmp_path, "benign", name=f"next-{uuid.uuid4().hex[:6]}"))
    try:
        with server.sync_client(30) as client:
            assert client.get("/health").status_code == 200
            reply = client.post("/v1/completions", json={"model": "model", "prompt": "hi", "max_tokens": 3})
            assert reply.json()["choices"][0]["token_ids"] == [5, 6, 7]
        assert observed(server)["uid"] == server.isolation["uid"]
    finally:
        assert server.stop() == "ok"
    assert not leftovers(sandbox.run_dir)


def test_the_task_section_selects_the_backend(run_dir):
    assert isinstance(make_sandbox(SandboxConfig(backend="namespace"), run_dir), NamespaceSandbox)


def test_benign_candidate_is_contained_and_records_imports(tmp_path, run_dir, namespaces):
    userns, _ = namespaces
    sandbox = NamespaceSandbox(config(cpus=1), run_dir)
    server = sandbox.start(hostile(tmp_path, "benign"))
    try:
        init = server.init_pid()
        for kind in ("pid", "net", "mnt", "ipc", "uts"):
            assert os.readlink(f"/proc/{init}/ns/{kind}") != os.readlink(f"/proc/self/ns/{kind}"), kind
        mounts = dict(server.mounts())
        assert {"/", "/usr", "/sandbox/tree", "/sandbox/model", "/sandbox/recorder", "/sandbox/io", "/tmp",
                "/proc", "/dev/shm"} <= mounts.keys(), mounts
        for path in ("/", "/usr", "/sandbox/tree", "/sandbox/model", "/sandbox/recorder", "/dev"):
            assert mounts[path].startswith("ro,"), (path, mounts[path])
        assert mounts["/sandbox/io"].startswith("rw,") and mounts["/tmp"].startswith("rw,")
        roots = sandbox_python_roots()  # the interpreter's folders, wherever they are (under /tmp on the GPU machine)
        outside = [m for m in mounts if not any(Path(m).is_relative_to(r) for r in roots)]
        assert not [m for m in outside if m.startswith(("/work", "/home", "/tmp/", "/run", "/var", "/root"))]
        assert server.isolation["userns"] == userns and server.isolation["limits"] == cgroups.detect()
        assert observed(server)["uid"] == server.isolation["uid"] and (userns or server.isolation["uid"] != 0)
        [child] = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        status = dict(line.split(":\t", 1) for line in Path(f"/proc/{child}/status").read_text().splitlines()
                      if ":\t" in line)
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0, status
        assert status["NoNewPrivs"].strip() == "1" and status["NSpid"].split()[-1] == "2"
        if server.cgroup:
            assert all(d.is_dir() for d in server.cgroup.dirs)
            assert init in cgroups.pids_in(server.cgroup.dirs[0])
        imports = server.imported_files()
        assert "vllm/entrypoints/cli/main.py" in imports and "vllm/entrypoints/cli/stub_server.py" in imports
        assert server.alive()
    finally:
        assert server.stop() == "ok"
    assert not server.alive() and not server.folder.exists()
    assert not server.cgroup or not any(d.exists() for d in server.cgroup.dirs)
    assert "vllm/entrypoints/cli/main.py" in server.imported_files()  # kept after the sandbox is gone
    assert "serving on" in server.logs()
    assert not Path(f"/proc/{init}").exists() or "State:\tZ" in Path(f"/proc/{init}/status").read_text()


def test_a_folder_on_the_import_path_that_holds_the_run_folder_is_not_mounted(tmp_path, run_dir, monkeypatch):
    """`python -m agent.face.cli noise --runs-dir X` run from X (or from /tmp, with runs under /tmp) puts X on the
    harness's import path. The server still starts, and X, which holds the run folder, is not mounted in it."""
    from sandbox.namespace import python_roots

    holder = run_dir.parent
    monkeypatch.syspath_prepend(str(holder))
    assert holder not in python_roots(run_dir) and holder.resolve() in python_roots()  # the control: it is a root
    server = NamespaceSandbox(config(), run_dir).start(hostile(tmp_path, "benign"))
    try:
        mounts = dict(server.mounts())
        assert "/sandbox/tree" in mounts
        assert str(holder.resolve()) not in mounts and str(run_dir.resolve()) not in mounts, mounts
    finally:
        assert server.stop() == "ok"


def test_a_post_mortem_sees_the_servers_processes_and_its_scratch(tmp_path, run_dir):
    """What the harness records of a server that stopped answering, before it stops it: its processes as
    /proc shows them from outside, and how full its capped scratch tmpfs is as they see it."""
    from sandbox.host import describe_snapshot, server_snapshot

    sandbox = NamespaceSandbox(config(tmpfs_mb=64), run_dir)
    server = sandbox.start(hostile(tmp_path, "benign"))
    try:
        snap = server_snapshot(server)
        assert {server.init_pid()} < {p["pid"] for p in snap["processes"]} and snap["threads"] >= 2
        assert snap["scratch"]["path"] == "/tmp" and 60 <= snap["scratch"]["size_mb"] <= 64
        assert "threads" in describe_snapshot(snap) and "of 64 MB used" in describe_snapshot(snap)
    finally:
        assert server.stop() == "ok"
    assert server_snapshot(server)["processes"] == []


def sandbox_python_roots():
    from sandbox.namespace import python_roots

    return python_roots()


def test_network_egress_and_dns_fail(tmp_path, run_dir):
    sandbox = NamespaceSandbox(config(), run_dir)
    server = sandbox.start(hostile(tmp_path, "network"))
    try:
        seen = observed(server)
    finally:
        assert server.stop() == "ok"
    assert seen["tcp"] and all(result != "connected" for result in seen["tcp"].values()), seen
    assert seen["dns"] and all(not result.startswith("resolved") for result in seen["dns"].values()), seen
    assert seen["interfaces"] == ["lo"]
    assert_next_candidate_runs(sandbox, tmp_path)


def test_writes_fail_outside_the_capped_tmpfs(tmp_path, run_dir):
    sandbox = NamespaceSandbox(config(tmpfs_mb=32), run_dir)
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
                 "/root/nightshift-probe", "/sandbox/nightshift-probe", "/sandbox/tree/nightshift-probe",
                 "/sandbox/tree/vllm/__init__.py", "/sandbox/model/nightshift-probe",
                 "/sandbox/recorder/nightshift-probe"):
        assert writes[path] == "EROFS", (path, writes[path])
    assert writes["/sandbox/recorder/sitecustomize.py"] in ("EROFS", "EACCES")
    assert writes["/tmp/nightshift-probe"] == "written" and writes["/dev/shm/nightshift-probe"] == "written"
    assert seen["fill_tmp"]["result"] == "ENOSPC" and seen["fill_tmp"]["written_mb"] <= 32, seen["fill_tmp"]
    assert not (spec.source_tree / "nightshift-probe").exists()
    assert (spec.source_tree / "vllm" / "__init__.py").read_text() == ""
    assert_next_candidate_runs(sandbox, tmp_path)


def limits_or_skip(kind: str) -> cgroups.Limits:
    if kind == "prlimit":
        return "prlimit"
    found = cgroups.detect()
    if found == "prlimit":
        pytest.skip("no writable cgroup (v2 with memory+pids delegated, or v1 memory+pids) on this host")
    return found


@pytest.mark.parametrize("kind", ["cgroup", "prlimit"])
def test_fork_bomb_is_contained(tmp_path, run_dir, kind):
    sandbox = NamespaceSandbox(config(pids_limit=64), run_dir, limits=limits_or_skip(kind))
    server = sandbox.start(hostile(tmp_path, "fork_bomb"))
    try:
        seen = observed(server)
    finally:
        assert server.stop() == "ok"
    assert seen["own_fork_during_bomb"] == "EAGAIN", seen
    assert seen["processes_during_bomb"] <= 64, seen  # the pid namespace's /proc: the sandbox's processes only
    assert_next_candidate_runs(sandbox, tmp_path)


@pytest.mark.parametrize("kind", ["cgroup", "prlimit"])
def test_memory_hog_is_stopped_and_reported_as_oom(tmp_path, run_dir, kind):
    sandbox = NamespaceSandbox(config(memory_gb=0.25), run_dir, limits=limits_or_skip(kind))
    with pytest.raises(SandboxError) as caught:
        sandbox.start(hostile(tmp_path, "memory_hog"))
    assert caught.value.outcome == "oom", caught.value
    assert "memory_hog:" in caught.value.logs
    hoarded = [int(line.split()[1]) for line in caught.value.logs.splitlines() if line.startswith("memory_hog:")]
    assert max(hoarded) <= 256, hoarded
    assert not leftovers(run_dir)
    assert_next_candidate_runs(sandbox, tmp_path)


def test_hang_is_killed_at_the_timeout(tmp_path, run_dir):
    sandbox = NamespaceSandbox(config(), run_dir)
    started = time.monotonic()
    with pytest.raises(SandboxError) as caught:
        sandbox.start(hostile(tmp_path, "hang", startup_timeout_s=8))
    elapsed = time.monotonic() - started
    assert caught.value.outcome == "timeout", caught.value
    assert 8 <= elapsed < 30, elapsed
    assert "ignoring SIGTERM" in caught.value.logs
    assert not leftovers(run_dir)
    assert_next_candidate_runs(sandbox, tmp_path)


def test_a_crash_at_start_names_its_error(tmp_path, run_dir):
    spec = hostile(tmp_path, "benign", name="crash")
    (spec.source_tree / "vllm" / "entrypoints" / "cli" / "main.py").write_text("raise ValueError('no such kernel')\n")
    sandbox = NamespaceSandbox(config(), run_dir)
    with pytest.raises(SandboxError) as caught:
        sandbox.start(spec)
    assert caught.value.outcome == "crash"
    assert str(caught.value) == "crash: server exited during startup (exit code 1): ValueError: no such kernel"
    missing = spec.model_copy(update={"name": "no-model", "model_dir": tmp_path / "missing"})
    with pytest.raises(SandboxError, match="NamespaceInitError: mount .*missing.*No such file"):
        sandbox.start(missing)
    assert not leftovers(run_dir)
    assert_next_candidate_runs(sandbox, tmp_path)


def test_secrets_are_out_of_reach(tmp_path, run_dir, monkeypatch):
    marker = "NIGHTSHIFT" + "-PLANTED-" + uuid.uuid4().hex
    for name in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "HF_TOKEN", "VLLM_API_KEY", "NIGHTSHIFT_SECRET"):
        monkeypatch.setenv(name, marker)
    (run_dir / f"references-{marker}.jsonl").write_text(f'{{"tokens": [1, 2], "secret": "{marker}"}}\n')
    (run_dir / "trace.jsonl").write_text(f'{{"event": "x", "secret": "{marker}"}}\n')
    (run_dir / "parity-prompts.jsonl").write_text(f'{{"prompt": "{marker}"}}\n')
    planted = []
    for home in {Path(os.path.expanduser("~")), Path(sys.prefix).parent}:  # ~/.ssh-like files, beside the prefix
        folder = home / f".nightshift-test-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir()
        except OSError:
            continue
        planted.append(folder)
        (folder / "id_ed25519").write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{marker}\n")
    spec = hostile(tmp_path, "secrets", env={"OPENAI_API_KEY": marker, "HF_HUB_TOKEN": marker,
                                            "NIGHTSHIFT_CONTROL": marker})
    (spec.source_tree / f"control-{marker}.txt").write_text(marker)  # a positive control the scan must find
    sandbox = NamespaceSandbox(config(memory_gb=2), run_dir)
    try:
        server = sandbox.start(spec.model_copy(update={"startup_timeout_s": 420}))
        try:
            seen = observed(server)
        finally:
            assert server.stop() == "ok"
    finally:
        for folder in planted:
            (folder / "id_ed25519").unlink()
            folder.rmdir()
    assert seen["files_scanned"] > 10_000, seen["files_scanned"]
    control = {"env NIGHTSHIFT_CONTROL", f"name /sandbox/tree/control-{marker}.txt",
               f"content /sandbox/tree/control-{marker}.txt"}
    assert control <= set(seen["hits"]), seen["hits"]
    leaks = [hit for hit in seen["hits"] if hit not in control and not hit.endswith("/environ")]
    assert leaks == [], leaks  # /proc/*/environ hits are the control variable, seen by each process
    assert_next_candidate_runs(sandbox, tmp_path)


def test_a_candidate_cannot_reach_the_runs_other_processes_or_files(tmp_path, run_dir):
    """The candidate that wins by slowing the incumbent: told the host pids of another server of the run and of the
    harness, the marker in the other server's environment, and host paths of the run folder and of the other
    server's folder and scratch, it sees none of those processes, signals and traces none, and opens none of the
    paths; the other server runs on, never stopped."""
    sandbox = NamespaceSandbox(config(), run_dir)
    seen, told = try_the_neighbours(sandbox, tmp_path, run_dir)
    assert seen["act"] == "neighbours", seen
    assert seen["marked"] == [] and seen["signalled"] == [] and seen["traced"] == [], seen
    assert seen["read"] == [], seen
    assert len(seen["visible"]) <= 3, seen["visible"]  # its pid 1 and itself: its own pid namespace only
    assert told["stopped"] == [] and told["answers"], told
    assert_next_candidate_runs(sandbox, tmp_path)


def test_held_while_the_other_side_is_measured_its_escaped_work_stops_too(tmp_path, run_dir):
    """A candidate's busy loop in a grandchild that left its session and process group (setsid, double fork) still
    runs in its pid namespace: held, it uses no CPU; let run, it does (the control)."""
    sandbox = NamespaceSandbox(config(), run_dir)
    server = sandbox.start(hostile(tmp_path, "idle_work"))
    try:
        assert_held_work_stops(server)
    finally:
        assert server.stop() == "ok"
    assert not leftovers(run_dir)


def test_a_server_runs_at_the_tasks_niceness_and_its_candidate_cannot_go_lower_or_push_others(tmp_path, run_dir):
    """sandbox.nice: every process of a server starts at it (where the harness may set it: as root). The `priority`
    act then tries to lower its own to -20 and to raise every other process it sees to 19: refused for itself (no
    capability in the sandbox), and the other server of the run (the victim), in its own pid namespace, keeps its
    niceness."""
    expected = -10 if os.geteuid() == 0 else os.getpriority(os.PRIO_PROCESS, 0)
    sandbox = NamespaceSandbox(config(), run_dir)
    victim = sandbox.start(hostile(tmp_path, "benign", name="victim", nice=-10))
    try:
        server = sandbox.start(hostile(tmp_path, "priority", nice=-10))
        try:
            seen = observed(server)
            assert seen["before"] == seen["after"] == expected and seen["refused"], seen
            for one in (server, victim):
                ns = os.readlink(f"/proc/{one.init_pid()}/ns/pid")
                members = processes_in(ns)
                assert members and {priority.of(pid) for pid in members} == {expected}, (one.name, members)
            assert priority.of(os.getpid()) == priority.thread_nice()  # the harness is left as it was
        finally:
            assert server.stop() == "ok"
    finally:
        assert victim.stop() == "ok"
    assert not leftovers(run_dir)


DEAD_HARNESS = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from sandbox.base import ServerSpec
from sandbox.config import SandboxConfig
from sandbox.namespace import NamespaceSandbox
sandbox = NamespaceSandbox(SandboxConfig(backend="namespace", memory_gb=1, pids_limit=128, tmpfs_mb=64), Path({run!r}))
server = sandbox.start(ServerSpec(name="orphan", source_tree={tree!r}, model_dir={model!r}, startup_timeout_s=60))
server.hold({held!r})
print("started", server.isolation["uid"], server.init_pid(), server.process.pid, flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("held", [False, True], ids=["running", "held"])
def test_a_killed_harness_leaves_nothing_running(tmp_path, run_dir, held):
    """SIGKILLed, the harness takes its server's whole namespace with it, also when it dies holding the server (the
    idle side of a pair is frozen while the other is measured): pid 1 is never frozen, and sees the pipe close."""
    dead_run = tmp_path / f"dead-{uuid.uuid4().hex[:8]}"
    dead_run.mkdir()
    orphan = hostile(tmp_path, "fork_bomb", name="orphan")  # a server with children of its own
    script = DEAD_HARNESS.format(root=str(ROOT), run=str(dead_run), tree=str(orphan.source_tree),
                                 model=str(orphan.model_dir), held=held)
    harness = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = harness.stdout.readline()
        assert line.startswith("started"), "the doomed harness did not start its server"
        uid, init, unshare = (int(x) for x in line.split()[1:])
        pid_ns = os.readlink(f"/proc/{init}/ns/pid")  # the server's processes, whatever uid they have
    finally:
        os.kill(harness.pid, signal.SIGKILL)
        harness.wait()

    def left_running() -> list[int]:
        # as root each server has a uid of its own; in a user namespace it is the harness's (uid 0 inside)
        return processes_in(pid_ns) + (processes_of(uid) if os.geteuid() == 0 else [])

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (left_running() or _running(init) or _running(unshare)):
        time.sleep(0.2)
    assert left_running() == [] and not _running(init) and not _running(unshare)
    [left] = leftovers(dead_run)  # the socket folder and cgroups stay until a reap
    cgroup_dirs = [Path(d) for d in json.loads((left / "state.json").read_text())["cgroups"]]
    assert all(cgroups.pids_in(d) == [] for d in cgroup_dirs)

    sandbox = NamespaceSandbox(config(), run_dir)
    server = sandbox.start(hostile(tmp_path, "benign", name="survivor"))  # the first start reaps
    try:
        assert not left.exists() and not any(d.exists() for d in cgroup_dirs)
        assert NamespaceSandbox(config(), tmp_path / "another-run").reap() == 0  # a live run's server stays
        assert server.alive()
    finally:
        assert server.stop() == "ok"
    assert_next_candidate_runs(sandbox, tmp_path)


def _running(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


CACHING_SERVE = """
import os
from vllm.entrypoints.cli.stub_server import serve
home = os.environ["HOME"]
found = sorted(os.path.relpath(os.path.join(d, f), home) for d, _, fs in os.walk(home) for f in fs if f.startswith("kernel"))
os.makedirs(os.path.join(home, "cache", "torchinductor"), exist_ok=True)
open(os.path.join(home, "cache", "torchinductor", "kernel-" + os.environ["NIGHTSHIFT_SERVER"]), "w").write("compiled")
serve({"cached": found, "tree": os.environ["NIGHTSHIFT_SOURCE_TREE"], "inductor": os.environ["TORCHINDUCTOR_CACHE_DIR"]})
"""


def test_servers_start_from_the_exported_caches_at_one_tree_path(tmp_path, run_dir):
    def caching(name: str, **fields) -> ServerSpec:
        spec = hostile(tmp_path, "benign", name=name, env={"NIGHTSHIFT_SERVER": name}, **fields)
        (spec.source_tree / "vllm" / "entrypoints" / "cli" / "main.py").write_text(CACHING_SERVE)
        return spec

    sandbox = NamespaceSandbox(config(), run_dir)
    seed = tmp_path / "seed"
    base = sandbox.start(caching("baseline"))
    sandbox.export_cache(base, seed)
    first = observed(base)
    base.stop()
    candidate = sandbox.start(caching("candidate", cache_seed=seed))  # another worktree
    try:
        second = observed(candidate)
    finally:
        candidate.stop()
    assert first["cached"] == [] and second["cached"] == ["cache/torchinductor/kernel-baseline"]
    assert first["tree"] == second["tree"] == "/sandbox/tree" and second["inductor"].startswith("/tmp/")
    assert sorted(p.name for p in (seed / "cache" / "torchinductor").iterdir()) == ["kernel-baseline"]


@pytest.mark.vllm
@pytest.mark.contained  # one start and one completion: beside the heavy tier
@pytest.mark.timeout(1800)
def test_real_vllm_serves_a_greedy_completion_in_the_namespace_sandbox(vllm_tree, local_greedy_tokens, real_vllm_seed, run_dir):
    """Real vLLM starts and serves in the namespace sandbox, imports from the candidate tree, and returns the greedy
    tokens the same tree returns served locally; it starts from the local server's exported caches."""
    from agent.stages.engine_config import config_fields, predict_config, serve_flags

    sandbox = NamespaceSandbox(config(memory_gb=8, pids_limit=4096, tmpfs_mb=2048), run_dir)
    started = time.monotonic()
    spec = real_vllm_spec(vllm_tree, seed=real_vllm_seed)
    server = sandbox.start(spec)
    startup_s = time.monotonic() - started
    try:
        tokens = greedy_tokens(server)
        # the recorder printed the engine core's scheduling limits, and they are what the tree's EngineArgs predict
        logged, predicted = config_fields(server.logs()), predict_config(vllm_tree, spec.model_dir,
                                                                          serve_flags(spec), spec.env)
        limits = ("max_num_seqs", "max_num_active_seqs", "max_num_scheduled_tokens", "async_scheduling",
                  "batch_queue_size")
        assert {k: logged.get(k) for k in limits} == {k: predicted[k] for k in limits}
        assert logged["async_scheduling"] == "False"  # the CPU platform turns the overlap off
        # started from the local server's caches (vLLM's model inspection among them), and exports its own
        assert seeded(sandbox, server, run_dir / "exported") == [SEED_MARK, MODEL_INSPECTION]
        imports = server.imported_files()
        assert "vllm/entrypoints/openai/api_server.py" in imports or "vllm/entrypoints/cli/serve.py" in imports
        assert any(f.startswith("vllm/v1/") for f in imports)
    finally:
        outcome = server.stop()
    assert outcome == "ok", server.logs()
    print(f"real vLLM in the namespace sandbox: healthy after {startup_s:.0f}s, tokens {tokens}")
    assert tokens == local_greedy_tokens, "the sandbox changed the greedy output"


def test_without_a_cgroup_a_gpu_server_gets_no_address_space_cap():
    from sandbox.namespace import memory_cap, prlimits

    c = config(memory_gb=2, pids_limit=100)
    assert prlimits(c, []) == {"NPROC": 99, "AS": 2 << 30}
    assert prlimits(c, [0]) == {"NPROC": 99}
    assert memory_cap("prlimit", [0]).startswith("none")
    assert memory_cap("v2", [0]) == "cgroup v2"


SITE_SERVE = """
import errno, os
from vllm.entrypoints.cli.stub_server import serve
import nightshift_site_marker
try:
    open(os.path.join(os.path.dirname(nightshift_site_marker.__file__), "planted"), "w")
    wrote = "written"
except OSError as exc:
    wrote = errno.errorcode[exc.errno]
serve({"marker": nightshift_site_marker.VALUE, "site_write": wrote,
       "cached": sorted(os.listdir(os.path.join(os.environ["HOME"], "cache")))})
"""


def test_an_interpreter_site_under_tmp_is_bound_read_only_over_the_seeded_scratch(tmp_path, run_dir, monkeypatch):
    """Where the harness's packages sit under /tmp (the sandbox's scratch path), as on the GPU machine's
    offline install: the scratch goes first, the site folder is bound over it read-only, and seeding the
    compile caches does not touch it (it once walked the whole scratch and failed on the bind)."""
    site = Path(f"/tmp/nightshift-site-{uuid.uuid4().hex[:8]}")
    site.mkdir()
    try:
        (site / "nightshift_site_marker.py").write_text("VALUE = 'from the host site'\n")
        monkeypatch.syspath_prepend(str(site))
        seed = tmp_path / "seed"
        (seed / "cache" / "torchinductor").mkdir(parents=True)
        (seed / "cache" / "torchinductor" / "kernel").write_text("compiled")
        spec = hostile(tmp_path, "benign", name="site", cache_seed=seed)
        (spec.source_tree / "vllm" / "entrypoints" / "cli" / "main.py").write_text(SITE_SERVE)
        sandbox = NamespaceSandbox(config(), run_dir)
        server = sandbox.start(spec)
        try:
            seen = observed(server)
        finally:
            server.stop()
        assert seen == {"marker": "from the host site", "site_write": "EROFS", "cached": ["torchinductor"]}
        assert not (site / "planted").exists()
    finally:
        shutil.rmtree(site)


def test_the_tree_is_byte_compiled_on_the_host_before_the_start(tmp_path, run_dir):
    """Read-only inside, the tree would be compiled from source by every server process at every start."""
    spec = hostile(tmp_path, "benign", name="bytecode")
    server = NamespaceSandbox(config(), run_dir).start(spec)
    try:
        assert server.isolation["precompiled_s"] >= 0
    finally:
        assert server.stop() == "ok"
    cli = spec.source_tree / "vllm" / "entrypoints" / "cli" / "__pycache__"
    assert {p.name.split(".")[0] for p in cli.glob("*.pyc")} == {"main", "stub_server", "__init__"}


NOBODY = 65534


def test_the_contract_holds_for_an_unprivileged_harness():
    """This suite once more with the harness as an unprivileged user, where every server also gets a user
    namespace (uid 0 inside it, no capabilities) and no cgroup is writable: each hostile candidate contained."""
    if os.environ.get("NIGHTSHIFT_UNPRIVILEGED_RUN"):
        pytest.skip("this is the unprivileged run")
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("switching to an unprivileged user needs root and util-linux's setpriv")
    home = Path(tempfile.mkdtemp(prefix="nightshift-nobody-", dir="/tmp"))  # pytest's own tmp is private to root
    os.chown(home, NOBODY, NOBODY)
    try:
        run_as_nobody(home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run_as_nobody(home: Path) -> None:
    become = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "env", f"HOME={home}",
              f"NIGHTSHIFT_NAMESPACE_IO={home / 'ns'}", f"NIGHTSHIFT_CACHE={home / 'cache'}",
              "NIGHTSHIFT_UNPRIVILEGED_RUN=1"]  # nothing of root's private folders (pytest's, the suite's checkpoint cache)
    reach = subprocess.run([*become, sys.executable, "-c", "import pytest, sandbox.namespace"], cwd=ROOT,
                           capture_output=True, text=True)
    if reach.returncode != 0:
        pytest.skip(f"an unprivileged user cannot run this Python ({reach.stderr.strip().splitlines()[-1:]}); "
                    ".ci/run makes it reachable")
    suite = subprocess.run([*become, sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                            f"--basetemp={home / 'bt'}", str(Path(__file__).relative_to(ROOT))],
                           cwd=ROOT, capture_output=True, text=True, timeout=900)
    summary = suite.stdout.strip().splitlines()[-1]
    print(f"unprivileged harness: {summary}", *[l for l in suite.stdout.splitlines() if l.startswith("SKIPPED")],
          sep="\n  ")
    if "no unprivileged user namespaces" in suite.stdout:
        pytest.skip("this host allows no unprivileged user namespaces")
    assert suite.returncode == 0, suite.stdout[-4000:] + suite.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary


def test_reap_counts_only_servers_it_killed_and_removes_what_dead_ones_left(tmp_path, monkeypatch):
    """A dead harness's sandbox whose server still runs is killed and counted; one whose server already died with its
    harness (the usual case: pid 1 watches the harness's pipe) leaves only folders, removed but not counted, so the
    count a resume records does not depend on which harness happened to look first."""
    import socket

    import sandbox.namespace as ns
    from sandbox.host import start_time

    monkeypatch.setattr(ns, "IO_ROOT", tmp_path / "io")
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_owner = f"{socket.gethostname()}:x:{gone.pid}:0"
    survivor = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        for name, pid in (("still-running", survivor.pid), ("died-with-harness", gone.pid)):
            folder = tmp_path / "io" / name
            folder.mkdir(parents=True)
            (folder / "state.json").write_text(json.dumps(
                {"owner": dead_owner, "run": str(tmp_path), "server": name, "pid": pid,
                 "start": start_time(survivor.pid) if pid == survivor.pid else "123", "cgroups": []}))
        assert NamespaceSandbox(config(), tmp_path / "resumed").reap() == 1
        assert survivor.wait(timeout=10) == -signal.SIGKILL
        assert list((tmp_path / "io").iterdir()) == []
    finally:
        survivor.kill()
        survivor.wait()
