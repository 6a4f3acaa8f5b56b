"""The local backend with real processes: scrubbed environment, process-group kill, reaping."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sandbox.base import ServerSpec, serve_argv
from sandbox.local import LocalSandbox, _alive, server_env


def spec(tmp_path, **kw) -> ServerSpec:
    return ServerSpec(name="c1", source_tree=tmp_path, model_dir=tmp_path, **kw)


def test_environment_is_scrubbed_of_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    env = server_env(spec(tmp_path, env={"MY_SECRET": "x", "VLLM_X": "1"}), tmp_path, tmp_path / "log", tmp_path)
    assert "sk-secret" not in env.values() and "hf-secret" not in env.values()
    assert "MY_SECRET" not in env and env["VLLM_X"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HOME"] == str(tmp_path) and env["PYTHONPATH"].endswith(str(tmp_path))


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
        assert neighbour.poll() is None and _alive(neighbour.pid)
    finally:
        neighbour.kill()
        orphan.kill()
