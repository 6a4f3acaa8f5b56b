"""The container specification the Docker backend produces (no engine needed): the GPU path is
checked here because it needs a GPU host to run."""
import os
from pathlib import Path

import pytest

from sandbox.base import SandboxError, ServerSpec, wait_healthy
from sandbox.config import SandboxConfig
from sandbox.docker_backend import DockerSandbox, DockerServer, GpuNotIdle
from sandbox.docker_spec import IO, MODEL, RECORDER, SCRATCH, SEED, SEEDING, TREE, container_spec
from sandbox.gpu_idle import gpu_memory_used_mib, wait_until_idle

SECRET_ENV = {"OPENAI_API_KEY": "sk-1", "HF_TOKEN": "hf-1", "VLLM_API_KEY": "v-1", "AWS_SECRET_ACCESS_KEY": "a",
              "GITHUB_AUTH": "g", "DB_PASSWORD": "p"}


@pytest.fixture
def paths(tmp_path):
    made = {name: tmp_path / name for name in ("run", "tree", "model", "io", "recorder")}
    for path in made.values():
        path.mkdir()
    return made


def gpu_spec(paths, **overrides) -> ServerSpec:
    fields = dict(name="cand-7-parity", labels={"candidate": "7", "role": "parity"}, source_tree=paths["tree"],
                  model_dir=paths["model"], engine_args={"max_num_seqs": 8, "enforce_eager": True},
                  env={"VLLM_ATTENTION_BACKEND": "FLASH_ATTN", "ANTHROPIC_API_KEY": "sk-ant"}, gpus=[2, 3])
    return ServerSpec(**{**fields, **overrides})


def build(paths, spec, **overrides):
    args = dict(image="nightshift-sandbox:gpu", run="run-42", io_dir=paths["io"], recorder=paths["recorder"],
                owner="host:123:456", user="10001:10001", memory_gb=64, cpus=8, pids_limit=4096,
                tmpfs_mb=2048, gpus=spec.gpus, private=[paths["run"]],
                host_env={**SECRET_ENV, "PATH": "/host/bin", "VLLM_CPU_KVCACHE_SPACE": "1", "HOME": "/root"})
    return container_spec(spec, **{**args, **overrides})


def test_gpu_candidate_gets_its_gpus_by_id(paths):
    kwargs = build(paths, gpu_spec(paths))
    [request] = kwargs["device_requests"]
    assert request["DeviceIDs"] == ["2", "3"]
    assert request["Capabilities"] == [["gpu"]]
    assert request["Count"] in (0, None)


def test_cpu_candidate_has_no_device_requests(paths):
    assert "device_requests" not in build(paths, gpu_spec(paths, gpus=[]), gpus=[])


def test_mounts_are_read_only_except_the_socket_folder(paths):
    volumes = build(paths, gpu_spec(paths))["volumes"]
    assert volumes == {
        str(paths["tree"].resolve()): {"bind": TREE, "mode": "ro"},
        str(paths["model"].resolve()): {"bind": MODEL, "mode": "ro"},
        str(paths["recorder"].resolve()): {"bind": RECORDER, "mode": "ro"},
        str(paths["io"].resolve()): {"bind": IO, "mode": "rw"},
    }


def test_hardening(paths):
    kwargs = build(paths, gpu_spec(paths))
    assert kwargs["network_mode"] == "none"
    assert kwargs["read_only"] is True
    assert kwargs["cap_drop"] == ["ALL"] and "cap_add" not in kwargs
    assert kwargs["security_opt"] == ["no-new-privileges"]
    assert kwargs["init"] is True
    assert kwargs["user"] == "10001:10001"
    assert kwargs["pids_limit"] == 4096
    assert kwargs["mem_limit"] == kwargs["memswap_limit"] == "65536m"
    assert kwargs["nano_cpus"] == 8_000_000_000
    assert kwargs["tmpfs"] == {SCRATCH: "rw,nosuid,nodev,size=2048m,mode=1777"}
    assert "privileged" not in kwargs and "ports" not in kwargs and "network" not in kwargs


def test_labels_name_the_run_and_the_candidate(paths):
    kwargs = build(paths, gpu_spec(paths))
    labels = kwargs["labels"]
    assert labels["nightshift"] == "sandbox"
    assert labels["nightshift.run"] == "run-42"
    assert labels["nightshift.candidate"] == "7"
    assert labels["nightshift.server"] == "cand-7-parity"
    assert labels["nightshift.owner"] == "host:123:456"
    assert labels["nightshift.role"] == "parity"
    assert kwargs["name"] == "nightshift-run-42-cand-7-parity"


def test_labels_given_with_the_prefix_are_kept(paths):
    spec = gpu_spec(paths, labels={"nightshift.run": "run-42", "nightshift.candidate": "candidate-3"})
    labels = build(paths, spec)["labels"]
    assert labels["nightshift.candidate"] == "candidate-3" and labels["nightshift.run"] == "run-42"
    assert not any(k.startswith("nightshift.nightshift") for k in labels)
    assert build(paths, gpu_spec(paths, labels={}))["labels"]["nightshift.candidate"] == "cand-7-parity"


def test_no_secret_reaches_the_environment(paths):
    env = build(paths, gpu_spec(paths))["environment"]
    assert not set(SECRET_ENV) & set(env)
    assert "ANTHROPIC_API_KEY" not in env
    assert all(not any(word in k for word in ("KEY", "TOKEN", "SECRET", "PASSWORD", "AUTH")) for k in env)
    assert env["VLLM_ATTENTION_BACKEND"] == "FLASH_ATTN"  # the candidate's own engine env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # VLLM_* from the host, as the local backend does
    assert env["HOME"] == SCRATCH and "PATH" not in env  # the image's PATH stays
    assert env["PYTHONPATH"] == f"{RECORDER}:{TREE}"
    assert env["NIGHTSHIFT_IMPORT_LOG"].startswith(IO + "/")


def test_command_serves_on_the_socket_with_the_model_inside(paths):
    command = build(paths, gpu_spec(paths))["command"]
    assert command[:5] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", MODEL]
    assert command[-2:] == ["--uds", f"{IO}/server.sock"]
    assert "--max-num-seqs" in command and "--enforce-eager" in command
    assert "--host" not in command and "--port" not in command
    assert str(paths["model"]) not in " ".join(command)


@pytest.mark.parametrize("exposed", ["run", "parent"])
def test_refuses_to_mount_the_run_folder(paths, exposed):
    tree = paths["run"] if exposed == "run" else paths["run"].parent
    with pytest.raises(ValueError, match="refusing to mount"):
        build(paths, gpu_spec(paths, source_tree=tree))


def test_candidate_tree_inside_the_run_folder_is_fine(paths):
    inside = paths["run"] / "worktrees" / "cand-7"
    inside.mkdir(parents=True)
    assert build(paths, gpu_spec(paths, source_tree=inside))["volumes"][str(inside.resolve())]["mode"] == "ro"


def test_backend_uses_the_task_settings(paths, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-host")
    config = SandboxConfig(backend="docker", image="img:gpu", gpus=[5], memory_gb=3, cpus=2, pids_limit=99,
                           tmpfs_mb=77)
    sandbox = DockerSandbox(config, paths["run"])
    kwargs = sandbox.spec_for(gpu_spec(paths, gpus=[]), paths["io"])
    assert kwargs["image"] == "img:gpu"
    assert kwargs["device_requests"][0]["DeviceIDs"] == ["5"]
    assert (kwargs["mem_limit"], kwargs["pids_limit"], kwargs["nano_cpus"]) == ("3072m", 99, 2_000_000_000)
    assert kwargs["labels"]["nightshift.run"] == "run"
    assert "OPENAI_API_KEY" not in kwargs["environment"]
    assert Path(kwargs["volumes"][str(paths["io"].resolve())]["bind"]) == Path(IO)


FAKE_NVIDIA_SMI = """#!/bin/sh
# prints "index, memory.used" for the GPUs listed after -i, reading MiB from $FAKE_GPU_MIB
for id in $(echo "$4" | tr ',' ' '); do echo "$id, $(cat "$FAKE_GPU_MIB")"; done
"""


@pytest.fixture
def fake_nvidia_smi(tmp_path, monkeypatch):
    bin_dir, level = tmp_path / "bin", tmp_path / "mib"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    level.write_text("400")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GPU_MIB", str(level))
    return level


def test_gpu_idle_check_reads_nvidia_smi(fake_nvidia_smi):
    assert gpu_memory_used_mib([0, 3]) == {0: 400, 3: 400}
    assert wait_until_idle([3], {3: 400}, timeout_s=0)[0]
    fake_nvidia_smi.write_text("30000")
    idle, reason = wait_until_idle([3], {3: 400}, timeout_s=1)
    assert not idle and "not back to idle" in reason


def test_next_start_refuses_a_gpu_still_holding_memory(fake_nvidia_smi, paths):
    sandbox = DockerSandbox(SandboxConfig(backend="docker", gpus=[1]), paths["run"])
    sandbox.gpu_idle_timeout_s = 1
    sandbox.check_gpus_idle([1])  # first sight: 400 MiB is this GPU's idle level
    fake_nvidia_smi.write_text("20000")
    with pytest.raises(GpuNotIdle, match="not back to idle"):
        sandbox.check_gpus_idle([1])
    fake_nvidia_smi.write_text("600")  # within the margin
    sandbox.check_gpus_idle([1])


def test_gpu_idle_check_is_a_no_op_without_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_memory_used_mib([0]) is None
    idle, reason = wait_until_idle([0], {})
    assert idle and "skipped" in reason
    assert wait_until_idle([], {}) == (True, "no GPUs requested")


def test_reaping_tells_a_dead_harness_from_a_live_one():
    import subprocess
    import sys

    from sandbox.docker_backend import owner_alive, process_identity

    assert owner_alive(process_identity(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    identity = process_identity(child.pid)
    child.wait()
    assert not owner_alive(identity)
    host, boot, pid, start = process_identity(os.getpid()).split(":")
    assert not owner_alive(f"{host}:{boot}:{pid}:{int(start) + 1}")  # the pid was reused by another process
    assert not owner_alive(f"{host}:{boot[::-1]}:{pid}:{start}")  # a harness of an earlier boot is gone
    assert owner_alive(f"another-host:{boot}:{pid}:{start}")  # cannot tell: keep it
    assert not owner_alive("garbage")


class FakeContainer:
    """What the startup wait sees of a container: its state, logs, stop and remove."""

    def __init__(self, state: dict):
        self.attrs, self.stopped, self.removed = {"State": state}, False, False

    def reload(self):
        pass

    def logs(self, tail):
        return b"RuntimeError: operator torchvision::nms does not exist\n"

    def stop(self, timeout):
        self.stopped = True

    def remove(self, force):
        self.removed = True


@pytest.mark.parametrize("state, outcome, message", [
    ({"Running": False, "Status": "exited", "ExitCode": 1}, "crash", "server exited during startup (exit code 1)"),
    ({"Running": False, "Status": "exited", "ExitCode": 137, "OOMKilled": True}, "oom", "(exit code 137)"),
    ({"Running": True, "Status": "running"}, "timeout", "server not healthy after 1s; killed and removed"),
])
def test_a_container_that_fails_to_start_is_removed_at_once(paths, state, outcome, message):
    container = FakeContainer(state)
    server = DockerServer(gpu_spec(paths, gpus=[]), container, paths["io"], [], {})
    with pytest.raises(SandboxError) as caught:
        wait_healthy(server, 1)
    assert caught.value.outcome == outcome and message in str(caught.value)
    assert container.removed and not container.stopped  # killed, no grace period
    assert server.stop() == outcome and not paths["io"].exists()


def test_a_seeded_server_gets_the_seed_read_only_and_copies_it_in_before_it_serves(paths):
    """The baseline's caches (vLLM's model inspection among them: 8 s of every cold start here) reach a container
    through a read-only mount, copied into its tmpfs by its first process, which then execs the server."""
    seed = paths["run"].parent / "seed"
    (seed / "cache" / "vllm").mkdir(parents=True)
    spec = build(paths, gpu_spec(paths, cache_seed=seed))
    assert spec["volumes"][str(seed)] == {"bind": SEED, "mode": "ro"}
    command = spec["command"]
    assert command[:3] == ["python3", "-c", SEEDING] and command[3:] == build(paths, gpu_spec(paths))["command"]
    assert "os.execvp(sys.argv[1], sys.argv[1:])" in SEEDING and f"'{SCRATCH}/' + name" in SEEDING
    assert str(seed) not in build(paths, gpu_spec(paths, cache_seed=paths["run"].parent / "absent"))["volumes"]
    with pytest.raises(ValueError, match="exposes"):  # a seed is mounted only where it exposes nothing private
        build(paths, gpu_spec(paths, cache_seed=paths["run"].parent), private=[paths["run"]])


def test_the_seeding_launcher_copies_what_it_can_and_becomes_the_server(tmp_path):
    """SEEDING run for real (its two paths moved under tmp_path): the caches copied, a file that cannot be copied
    (a FIFO) left out without failing the start, and the server command run in the same process."""
    import subprocess
    import sys

    seed, scratch = tmp_path / "seed", tmp_path / "scratch"
    (seed / "cache" / "vllm" / "modelinfos").mkdir(parents=True)
    (seed / "cache" / "vllm" / "modelinfos" / "m.json").write_text("{}")
    (seed / ".triton").mkdir()
    os.mkfifo(seed / ".triton" / "pipe")
    scratch.mkdir()
    code = SEEDING.replace(SEED, str(seed)).replace(f"'{SCRATCH}/'", f"'{scratch}/'")
    assert code.count(str(seed)) == 2 and code.count(str(scratch)) == 1
    out = subprocess.run([sys.executable, "-c", code, sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (scratch / "cache" / "vllm" / "modelinfos" / "m.json").read_text() == "{}"
    assert out.stdout.strip().isdigit()


def test_a_trusted_containers_caches_are_exported_from_its_tmpfs(paths, tmp_path):
    """EXPORTING run for real in place of the container (its tmpfs moved under tmp_path): the caches come back as
    a tar and land in the seed; a container that cannot answer leaves the seed as it was."""
    import subprocess
    import sys

    scratch = tmp_path / "scratch"
    (scratch / "cache" / "vllm" / "modelinfos").mkdir(parents=True)
    (scratch / "cache" / "vllm" / "modelinfos" / "m.json").write_text('{"hash": "h"}')
    (scratch / "elsewhere").mkdir()

    class Container:
        def __init__(self, fails=False):
            self.fails = fails

        def exec_run(self, argv, demux):
            assert argv[:2] == ["python3", "-c"] and demux
            if self.fails:
                return type("R", (), {"exit_code": 1, "output": (b"", b"no python")})()
            code = argv[2].replace(f"'{SCRATCH}/'", f"'{scratch}/'")
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
            return type("R", (), {"exit_code": done.returncode, "output": (done.stdout, done.stderr)})()

    sandbox = DockerSandbox(SandboxConfig(backend="docker"), paths["run"])
    sandbox.export_cache(type("S", (), {"container": Container(), "name": "baseline"})(), paths["run"] / "seed")
    assert (paths["run"] / "seed" / "cache" / "vllm" / "modelinfos" / "m.json").read_text() == '{"hash": "h"}'
    assert not (paths["run"] / "seed" / "elsewhere").exists()
    sandbox.export_cache(type("S", (), {"container": Container(fails=True), "name": "b"})(), paths["run"] / "other")
    assert not (paths["run"] / "other").exists()
