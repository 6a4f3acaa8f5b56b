"""The local backend with real processes: scrubbed environment, process-group kill, reaping."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox.base import SandboxError, ServerSpec, serve_argv
from sandbox.host import (OWNER_ENV, cpu_seconds, marked_processes, process_identity, running, server_marks,
                          start_time, stat_fields)
from sandbox.local import (RECORDER, LocalSandbox, LocalServer, _group_members, free_port, record_server,
                           server_env, wait_healthy)


pytestmark = pytest.mark.serial  # serial: CPU seconds of process trees and the settle wait


def spec(tmp_path, **kw) -> ServerSpec:
    return ServerSpec(name="c1", source_tree=tmp_path, model_dir=tmp_path, **kw)


def test_environment_is_scrubbed_of_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env = server_env(spec(tmp_path, env={"MY_SECRET": "x", "VLLM_X": "1"}), tmp_path, tmp_path / "log", tmp_path)
    assert "sk-secret" not in env.values() and "hf-secret" not in env.values()
    assert "MY_SECRET" not in env and env["VLLM_X"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HOME"] == str(tmp_path) and env["PYTHONPATH"].split(os.pathsep)[1] == str(tmp_path)


def test_multicast_settings_come_from_the_task_not_the_host(tmp_path, monkeypatch):
    """The GPU task sets NVLink multicast off in its engine.env; a harness's own NCCL settings do not leak in."""
    from agent.world.task import load_task

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = server_env(spec(tmp_path), tmp_path, tmp_path / "log", tmp_path)
    assert "NCCL_NVLS_ENABLE" not in env
    task = load_task(Path(__file__).resolve().parents[2] / "tasks" / "gemma4-e2b.yaml")
    env = server_env(spec(tmp_path, env=task.engine.env), tmp_path, tmp_path / "log", tmp_path)
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")


def test_serve_argv_spells_flags():
    argv = serve_argv(ServerSpec(name="x", source_tree=Path("/t"), model_dir=Path("/m"),
                                 engine_args={"max_num_seqs": 8, "enforce_eager": True, "enable_prefix_caching": False,
                                              "skip": None}))
    assert argv[:2] == ["serve", "/m"]
    assert "--max-num-seqs" in argv and argv[argv.index("--max-num-seqs") + 1] == "8"
    assert "--enforce-eager" in argv and "--no-enable-prefix-caching" in argv and "--skip" not in argv


def test_reap_kills_servers_whose_harness_is_gone(tmp_path):
    server_dir = tmp_path / "old-run" / "servers" / "c1"
    server_dir.mkdir(parents=True)
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    (server_dir / "pid").write_text(str(orphan.pid))
    (server_dir / "owner").write_text(str(dead_owner.pid))
    live_dir = tmp_path / "live-run" / "servers" / "c1"
    live_dir.mkdir(parents=True)
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    (live_dir / "pid").write_text(str(neighbour.pid))
    (live_dir / "owner").write_text(str(os.getpid()))
    try:
        assert LocalSandbox(None, tmp_path / "new-run").reap() == 1
        orphan.wait(10)
        assert orphan.returncode == -signal.SIGKILL
        time.sleep(0.2)
        assert neighbour.poll() is None and running(neighbour.pid)
    finally:
        neighbour.kill()
        orphan.kill()


def sleeper(env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                            env={**os.environ, **(env or {})})


def test_a_group_whose_leader_died_is_reaped_only_if_recorded_since_this_boot(tmp_path):
    """record_server writes the identity every backend uses (host, boot, pid, start time): a group whose leader
    died is killed when it was recorded since this boot, and left alone when recorded before a reboot (its pgid
    then names some other group)."""
    from sandbox.local import _group_members

    dead_owner = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_owner.wait()
    reaped = {}
    for case in ("this boot", "an earlier boot"):
        home = tmp_path / case.replace(" ", "-") / "old-run" / "servers" / "c1"
        home.mkdir(parents=True)
        leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen("
                                   "[sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"],
                                  start_new_session=True)
        deadline = time.time() + 10
        while len(_group_members(leader.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        record_server(home, leader.pid)
        identity = (home / "identity").read_text()
        assert identity == process_identity(leader.pid) and identity.split(":")[2] == str(leader.pid)
        if case == "an earlier boot":
            host, boot, pid, start = identity.split(":")
            (home / "identity").write_text(f"{host}:{boot[::-1]}:{pid}:{start}")
        (home / "owner").write_text(str(dead_owner.pid))
        leader.kill()
        leader.wait()
        members = _group_members(leader.pid)
        assert len(members) == 1
        try:
            reaped[case] = LocalSandbox(None, home.parent.parent.parent / "new-run").reap()
            deadline = time.time() + 10
            while _group_members(leader.pid) and time.time() < deadline and reaped[case]:
                time.sleep(0.05)
            reaped[case] = (reaped[case], bool(_group_members(leader.pid)))
        finally:
            os.killpg(leader.pid, signal.SIGKILL) if _group_members(leader.pid) else None
    assert reaped == {"this boot": (1, False), "an earlier boot": (0, True)}


def test_reap_finds_servers_their_dead_harness_never_recorded(tmp_path):
    """A harness killed between starting a server and writing its pid file, or a pid file a later start
    cleared: the server is found by the marks in its environment, and killed only if its harness is gone."""
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dead_identity = process_identity(dead.pid)
    dead.kill()
    dead.wait()
    home = tmp_path / "old-run" / "servers" / "c1"
    orphan = sleeper({**server_marks(home), OWNER_ENV: dead_identity})
    neighbour = sleeper(server_marks(tmp_path / "live-run" / "servers" / "c1"))  # its harness (this one) lives
    elsewhere = sleeper({**server_marks(tmp_path.parent / "other-runs" / "x"), OWNER_ENV: dead_identity})
    try:
        deadline = time.time() + 10
        while not marked_processes(tmp_path) and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(pid for pid, _ in marked_processes(tmp_path)) == sorted([orphan.pid, neighbour.pid])
        assert LocalSandbox(None, tmp_path / "new-run").reap() == 1
        orphan.wait(10)
        assert orphan.returncode == -signal.SIGKILL
        time.sleep(0.2)
        assert neighbour.poll() is None and elsewhere.poll() is None  # not under these runs
    finally:
        for proc in (orphan, neighbour, elsewhere):
            proc.kill()


LEAVES_ITS_GROUP = """
import os, sys, time
if os.fork() == 0:
    os.setsid()  # as a server's helper process may: its own group, the server's marks still in its environment
    print(os.getpid(), flush=True)  # once it is in its own group, not before
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


def test_reap_counts_each_server_once(tmp_path):
    """A resume once said "5 leftover servers killed" where 3 were left: a server whose processes are found both by
    its pid file and by their marks (a helper in a group of its own, or processes still dying after the group's
    kill) counts once, and the reaper returns when they are gone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_identity = process_identity(dead.pid)
    dead.wait()
    servers = []
    for name, code in (("reference", LEAVES_ITS_GROUP), ("incumbent", "import time; time.sleep(600)"),
                       ("candidate-1", "import time; time.sleep(600)")):
        home = tmp_path / "old-run" / "servers" / name
        home.mkdir(parents=True)
        proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, **server_marks(home), OWNER_ENV: dead_identity})
        (home / "owner").write_text(str(dead.pid))
        (home / "identity").write_text(process_identity(proc.pid))
        (home / "pid").write_text(str(proc.pid))
        servers.append(proc)
    helper = int(servers[0].stdout.readline())
    deadline = time.time() + 10
    while len(marked_processes(tmp_path)) < 4 and time.time() < deadline:
        time.sleep(0.05)
    assert os.getpgid(helper) != servers[0].pid and len(marked_processes(tmp_path)) == 4
    try:
        assert LocalSandbox(None, tmp_path / "new-run").reap() == 3
        assert not running(helper) and all(not running(p.pid) for p in servers)
        assert marked_processes(tmp_path) == []
        assert LocalSandbox(None, tmp_path / "new-run").reap() == 0  # nothing left to find, dying or not
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


def test_a_harness_dead_but_not_yet_waited_for_is_gone(tmp_path):
    """A killed harness stays a zombie until its parent waits for it: its servers are reaped all the same."""
    server_dir = tmp_path / "old-run" / "servers" / "c1"
    server_dir.mkdir(parents=True)
    harness = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while start_time(harness.pid) != "?" and time.time() < deadline:
        time.sleep(0.02)
    assert Path(f"/proc/{harness.pid}").exists()  # a zombie: not waited for yet
    orphan = sleeper()
    (server_dir / "pid").write_text(str(orphan.pid))
    (server_dir / "owner").write_text(str(harness.pid))
    try:
        assert not running(harness.pid) and process_identity(harness.pid) == ""
        assert LocalSandbox(None, tmp_path / "new-run").reap() == 1
        orphan.wait(10)
    finally:
        orphan.kill()
        harness.wait()


FAKE_SERVE = """
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
import vllm.patched
home = os.environ["HOME"]
seen = {"python_path": os.environ["PYTHONPATH"], "site_ran": os.environ.get("SHADOWED_SITE_RAN"),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cached": sorted(os.path.relpath(os.path.join(d, f), home) for d, _, fs in os.walk(home) for f in fs
                         if f.startswith("kernel"))}
open(os.path.join(home, "seen.json"), "w").write(json.dumps(seen))
os.makedirs(os.path.join(home, ".triton", "cache"), exist_ok=True)
open(os.path.join(home, ".triton", "cache", "kernel-" + os.path.basename(home)), "w").write("compiled")
class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


CHAINS_BACK = """
import importlib.util, os, sys
os.environ["SHADOWED_SITE_RAN"] = str(int(os.environ.get("SHADOWED_SITE_RAN", "0")) + 1)
here = os.path.dirname(os.path.abspath(__file__))
for entry in list(sys.path):  # chains like an installer's sitecustomize: scans from the start
    path = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
    if os.path.abspath(entry or ".") != here and os.path.isfile(path):
        spec = importlib.util.spec_from_file_location("_chained", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        break
"""


def fake_serve_tree(root: Path) -> Path:
    cli = root / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (root / "vllm", root / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(FAKE_SERVE)
    (root / "vllm" / "patched.py").write_text("VALUE = 1\n")
    return root


def test_server_keeps_the_harness_path_after_the_tree_and_chains_sitecustomize(tmp_path, monkeypatch):
    """A vLLM installed on PYTHONPATH (with its own sitecustomize) stays usable behind the candidate tree."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CHAINS_BACK)
    monkeypatch.setenv("PYTHONPATH", str(site))
    tree = fake_serve_tree(tmp_path / "tree")
    sandbox = LocalSandbox(None, tmp_path / "run")
    server = sandbox.start(ServerSpec(name="c1", source_tree=tree, model_dir=tmp_path, gpus=[3], startup_timeout_s=30))
    try:
        seen = json.loads((server.home / "seen.json").read_text())
    finally:
        server.stop()
    assert seen["python_path"].split(os.pathsep) == [str(RECORDER), str(tree), str(site)]
    assert seen["site_ran"] == "1" and seen["gpus"] == "3"  # once: no loop between the two files
    assert "vllm/patched.py" in server.imported_files()


def test_servers_start_from_the_exported_caches_only(tmp_path):
    tree = fake_serve_tree(tmp_path / "tree")
    sandbox = LocalSandbox(None, tmp_path / "run")
    seed = tmp_path / "seed"
    base = sandbox.start(ServerSpec(name="baseline", source_tree=tree, model_dir=tmp_path, startup_timeout_s=30))
    sandbox.export_cache(base, seed)
    base.stop()
    spec = ServerSpec(name="candidate", source_tree=tree, model_dir=tmp_path, startup_timeout_s=30, cache_seed=seed)
    candidate = sandbox.start(spec)
    candidate.stop()
    seen = json.loads((candidate.home / "seen.json").read_text())
    assert seen["cached"] == [".triton/cache/kernel-baseline"]
    assert sorted(p.name for p in (seed / ".triton" / "cache").iterdir()) == ["kernel-baseline"]


class Impostor:
    """Another process's server on loopback that answers /health 200 (in this test's process, not the server's)."""

    def __enter__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Healthy(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
        self.port = self.httpd.server_address[1]
        self.answered = 0
        original = self.httpd.finish_request
        self.httpd.finish_request = lambda *a: (setattr(self, "answered", self.answered + 1), original(*a))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_port_taken_before_the_server_binds_it_is_never_taken_for_the_server(tmp_path, monkeypatch):
    """The port a start chose free is bound first by another process that answers /health: that answer is not
    the server's; the server exits unable to bind, and the start is made again on a fresh port."""
    tree = fake_serve_tree(tmp_path / "tree")
    with Impostor() as impostor:
        ports = iter([impostor.port])
        monkeypatch.setattr("sandbox.local.free_port", lambda: next(ports, None) or free_port())
        server = LocalSandbox(None, tmp_path / "run").start(
            ServerSpec(name="c1", source_tree=tree, model_dir=tmp_path, startup_timeout_s=30))
        try:
            assert server.port != impostor.port and server.answers_itself()
            with server.sync_client(5) as client:
                assert client.get("/health").status_code == 200
        finally:
            server.stop()
        assert impostor.answered >= 1  # the first start's health checks reached it, and were not believed


def test_a_server_whose_port_another_process_answers_on_is_never_healthy(tmp_path):
    """A server process that never binds its port, while another process answers /health there: not healthy,
    killed at the timeout."""
    with Impostor() as impostor:
        server = _server(tmp_path, "import time; time.sleep(600)")
        server.port = impostor.port
        server.endpoint = type(server.endpoint)(f"http://127.0.0.1:{impostor.port}")
        assert not server.answers_itself()
        with pytest.raises(SandboxError, match="timeout: server not healthy after 2s"):
            wait_healthy(server, 2)
        assert impostor.answered >= 1


def _server(tmp_path, code: str) -> LocalServer:
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    (tmp_path / "tmp").mkdir()
    return LocalServer(spec(tmp_path), process, free_port(), tmp_path, log, tmp_path / "imports.txt", tmp_path / "tmp")


def test_a_server_that_hangs_at_start_is_killed_at_the_timeout(tmp_path):
    server = _server(tmp_path, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "print('ignoring SIGTERM', flush=True); time.sleep(600)")
    started = time.monotonic()
    with pytest.raises(SandboxError, match="timeout: server not healthy after 2s") as caught:
        wait_healthy(server, 2)
    assert time.monotonic() - started < 6  # no grace period for a server that never answered
    assert server.process.returncode == -signal.SIGKILL and "ignoring SIGTERM" in caught.value.logs
    assert not (tmp_path / "tmp").exists()


def test_a_server_that_exits_at_start_is_a_crash_with_its_exit_code(tmp_path):
    server = _server(tmp_path, "import sys; print('ValueError: no such kernel', flush=True); sys.exit(3)")
    with pytest.raises(SandboxError) as caught:
        wait_healthy(server, 30)
    assert caught.value.outcome == "crash"
    assert str(caught.value) == "crash: server exited during startup (exit code 3): ValueError: no such kernel"


def test_a_pid_file_whose_owner_is_not_yet_recorded_is_left_alone(tmp_path):
    """A parallel run's workers reap while their neighbours start servers: a reaper that finds a server's pid
    file before its owner file (the recording half done) must not kill it; the marks decide (owner alive)."""
    server_dir = tmp_path / "run" / "servers" / "c1"
    server_dir.mkdir(parents=True)
    server = sleeper(server_marks(server_dir))
    (server_dir / "pid").write_text(str(server.pid))
    try:
        assert LocalSandbox(None, tmp_path / "other-run").reap() == 0
        time.sleep(0.2)
        assert server.poll() is None
    finally:
        server.kill()


REAPER = """
import sys
from pathlib import Path
from sandbox.local import reap_servers
while True:
    reap_servers(Path(sys.argv[1]))
"""


def test_servers_recorded_while_a_neighbour_reaps_are_never_killed(tmp_path):
    """The race CI met: one worker records its servers while another worker's pool reaps the run's folder."""
    runs = tmp_path / "workers"
    server = sleeper()
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(runs)], cwd=Path(__file__).parents[2],
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        time.sleep(1.5)  # the reaper is looping
        deadline = time.time() + 6
        for i in range(1500):
            if reaper.poll() is not None or server.poll() is not None or time.time() > deadline:
                break
            home = runs / f"w{i % 4}" / "servers" / f"s{i}"
            home.mkdir(parents=True)
            record_server(home, server.pid)
        assert server.poll() is None, f"killed after {i} records"
        assert reaper.poll() is None, "the reaper died"
    finally:
        server.kill()
        reaper.kill()


BURN_IN_A_CHILD = """
import os, time
pid = os.fork()
if pid == 0:
    end = time.process_time() + 0.6
    while time.process_time() < end:
        pass
    os._exit(0)
os.waitpid(pid, 0)
print("reaped", flush=True)
time.sleep(600)
"""


def test_cpu_seconds_counts_a_tree_and_the_children_it_reaped():
    """What the benchmark records of the idle side's server: CPU time of its whole tree, where a child that burned
    and was reaped still counts (in its parent's), and a sleeping tree counts next to nothing."""
    burner = subprocess.Popen([sys.executable, "-c", BURN_IN_A_CHILD], stdout=subprocess.PIPE, text=True)
    idle = sleeper()
    try:
        assert burner.stdout.readline().strip() == "reaped"
        assert cpu_seconds(burner.pid) >= 0.55
        before = cpu_seconds(idle.pid)
        time.sleep(0.5)
        assert cpu_seconds(idle.pid) - before < 0.05
        assert cpu_seconds(None) is None
    finally:
        burner.kill()
        idle.kill()


TAIL_THEN_SLEEP = """
import time
end = time.monotonic() + 0.8
while time.monotonic() < end:
    pass
print("quiet", flush=True)
time.sleep(600)
"""


def test_settle_waits_out_a_tail_and_gives_up_on_a_spinner():
    """Before a pass the benchmark waits for both servers to go quiet: a process that works for 0.8 s after its
    last request is awaited until it stops; one that never stops is reported with its cores after the limit."""
    from agent.stages.bench import QUIET_CORES, settle
    tail = subprocess.Popen([sys.executable, "-c", TAIL_THEN_SLEEP], stdout=subprocess.PIPE, text=True)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = sleeper()
    try:
        waited, busy = asyncio.run(settle({tail.pid: "tail", idle.pid: "idle"}, 5.0))
        assert tail.stdout.readline().strip() == "quiet" and busy == {} and 0.4 < waited < 3, waited
        waited, busy = asyncio.run(settle({idle.pid: "idle"}, 5.0))
        assert busy == {} and waited < 0.6
        waited, busy = asyncio.run(settle({spinner.pid: "spinner", idle.pid: "idle"}, 1.0))
        assert list(busy) == ["spinner"] and busy["spinner"] > QUIET_CORES and 1.0 <= waited < 1.6
        assert asyncio.run(settle({spinner.pid: "spinner"}, 0)) == (0.0, {})
    finally:
        for p in (tail, spinner, idle):
            p.kill()


def test_a_start_is_made_again_only_for_a_lost_port_and_only_so_often():
    """on_a_fresh_port (the local backend's and the stand-ins' sandbox): a server that exits unable to bind is
    started again; any other crash is the server's own and raised at once; a port lost PORT_ATTEMPTS times is
    raised, not tried forever."""
    from sandbox.local import PORT_ATTEMPTS, on_a_fresh_port
    lost = SandboxError("crash", "server exited during startup (exit code 1)", "OSError: [Errno 98] Address already in use")
    own = SandboxError("crash", "server exited during startup (exit code 1)", "ImportError: no module named vllm")
    calls = []

    def start(failures):
        def once():
            calls.append(1)
            if failures:
                raise failures.pop(0)
            return "healthy"
        return once
    assert on_a_fresh_port(start([lost, lost])) == "healthy" and len(calls) == 3
    calls.clear()
    with pytest.raises(SandboxError, match="exit code 1") as raised:
        on_a_fresh_port(start([own, lost]))
    assert "ImportError" in raised.value.logs and len(calls) == 1
    calls.clear()
    with pytest.raises(SandboxError) as raised:
        on_a_fresh_port(start([lost] * (PORT_ATTEMPTS + 1)))
    assert "Address already in use" in raised.value.logs and len(calls) == PORT_ATTEMPTS


def test_a_local_candidate_reaches_the_runs_other_processes_and_files(tmp_path):
    """What docs/sandbox.md says of `local`, checked: no isolation. The candidate that wins by slowing the incumbent
    finds the other server by the marker in its environment, may stop and trace it, and reads the run folder and
    the other server's home; why `local` is for flags and trusted patches only, and not the default."""
    from tests.hostile.plant import try_the_neighbours

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    seen, told = try_the_neighbours(LocalSandbox(None, run_dir), tmp_path, run_dir, harness=False)
    assert seen["act"] == "neighbours", seen
    assert set(told["pids"]) <= set(seen["visible"]) and seen["marked"], seen
    assert set(told["pids"]) <= set(seen["signalled"]), seen  # stopped and let go at once: it answers after
    assert set(told["paths"]) == set(seen["read"]), seen
    assert told["answers"], told



NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")

THREAD_ON_CUE = """
import sys, threading, time
sys.stdin.readline()
threading.Thread(target=lambda: (print(threading.get_native_id(), flush=True), time.sleep(60)), daemon=True).start()
time.sleep(60)
"""


def _stranger_on(pid: int, kind: str) -> tuple[subprocess.Popen, int]:
    """A process that has PID (free now) as its own, in a session of its own (`session`), or as a thread's id
    (`thread`: kill() with a thread's id signals its whole process): the kernel hands out ns_last_pid + 1 next."""
    if kind == "thread":  # a harness-like process, already running, that starts a thread on cue
        process = subprocess.Popen([sys.executable, "-c", THREAD_ON_CUE], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        NS_LAST_PID.write_text(str(pid - 1))
        process.stdin.write("go\n")
        process.stdin.flush()
        got = int(process.stdout.readline())
    else:
        NS_LAST_PID.write_text(str(pid - 1))
        process = subprocess.Popen(["sleep", "60"], start_new_session=True)
        got = process.pid
    if got != pid:
        process.kill()
        process.wait()
        pytest.skip(f"pid {pid} went to another process first")
    return process, got


def _state(pid: int) -> str:
    return stat_fields(pid)[0]


@pytest.mark.parametrize("kind", ["session", "thread"])
def test_a_server_waited_for_never_reaches_the_process_that_took_its_pid(tmp_path, kind):
    """Pids wrap within seconds beside a fork bomb (every failed fork under a pids limit takes one: ~3,000 a
    second, pid_max 32768 here), so the pid of a server that died and was waited for can be a stranger's: a
    session leader, whose group id it is, or a thread of another process (a neighbouring harness: kill() with a
    thread's id stops its whole process). Holding the dead server (the idle side of a pair) or stopping it must
    not stop or kill the stranger."""
    if os.geteuid() != 0 or not os.access(NS_LAST_PID, os.W_OK):
        pytest.skip("choosing a pid needs root in the host's pid namespace (ns_last_pid)")
    server = _server(tmp_path, "import time; time.sleep(600)")
    os.killpg(server.process.pid, signal.SIGTERM)
    server.process.wait()
    assert not server.alive()  # it died, and its exit was collected: its pid is free
    stranger, pid = _stranger_on(server.process.pid, kind)
    try:
        server.hold(True)
        time.sleep(0.1)
        assert _state(stranger.pid) != "T"
        assert server.stop() == "crash"
        assert stranger.poll() is None and _state(stranger.pid) != "T"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_dead_leaders_leftovers_are_still_held_and_killed(tmp_path):
    """The other way: a server whose leader was waited for but whose children still run in its group (no one
    else can have the group's id then) is held and killed whole."""
    server = _server(tmp_path, "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(_group_members(server.process.pid)) < 2:
        time.sleep(0.05)
    os.kill(server.process.pid, signal.SIGTERM)
    server.process.wait()
    [child] = _group_members(server.process.pid)
    server.hold(True)
    assert _state(child) == "T"
    server.hold(False)
    assert server.stop() == "crash"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and running(child):
        time.sleep(0.05)
    assert not running(child)
