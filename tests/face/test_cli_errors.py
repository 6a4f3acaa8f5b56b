"""What a user can get wrong, through the real command: one `error:` line naming the cause, exit code 2,
no traceback, and nothing on disk (no run folder, the checkout's status and branches as they were)."""
import importlib.util
import os
import shutil
import re
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest
import yaml

from agent.world.checkout import CheckoutError, open_checkout
from agent.world.task import load_task, with_overrides
from sandbox.base import SandboxError, ServerSpec, last_error_line
from sandbox.local import LocalSandbox, free_port
from tests.conftest import has_vllm
from traces import TraceWriter
from traces.schema import Proposal, RunStarted

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "tasks" / "gemma4-tiny-cpu.yaml"
NMS = "operator torchvision::nms does not exist"
NO_VLLM = "vLLM is not installed"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
needs_vllm = pytest.mark.skipif(not has_vllm(), reason="vLLM is not installed")


def installed_version() -> str:
    if not has_vllm():
        return load_task(TASK).target.vllm_version
    from agent.world.checkout import installed_vllm

    return installed_vllm()[1]


@pytest.fixture
def home(tmp_path):
    (tmp_path / "cache").mkdir()
    return tmp_path


def nightshift(home: Path, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in [*(env or {}).pop("PREPEND", []), str(ROOT), os.environ.get("PYTHONPATH")] if p)
    full = {**os.environ, "NIGHTSHIFT_CACHE": str(home / "cache"), "PYTHONPATH": path, "COLUMNS": "80", **(env or {})}
    return subprocess.run([sys.executable, "-m", "agent.face.cli", *map(str, args)], cwd=home, env=full,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def run(home: Path, *args, **kw) -> subprocess.CompletedProcess:
    return nightshift(home, "run", *args, "--runs-dir", home / "runs", "--quiet", **kw)


def assert_one_error(proc: subprocess.CompletedProcess, *causes: str, code: int = 2) -> str:
    """Exactly one `error:` line; the message from it on names one of `causes`."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    assert "Traceback" not in out, out
    lines = out.splitlines()
    at = [i for i, line in enumerate(lines) if "error:" in line]
    assert len(at) == 1, out
    message = "\n".join(lines[at[0]:])
    assert lines[at[0]].lstrip().startswith("error: "), out
    assert any(cause in message for cause in causes), out
    return message


def disk(home: Path) -> dict:
    """Every file under `home` (but git's index, which `git status` refreshes) and each repo's status and refs."""
    files = {str(p.relative_to(home)): (p.stat().st_size, p.stat().st_mtime_ns) for p in home.rglob("*")
             if p.is_file() and p.name != "index"}
    repos = {str(g.parent): (git.Repo(g.parent).git.status("--porcelain"), git.Repo(g.parent).git.branch("-a"),
                             git.Repo(g.parent).git.worktree("list"))
             for g in home.rglob(".git")}
    return {"files": files, "repos": repos}


def task_file(home: Path, name: str = "task.yaml", extra: dict | None = None, **sections) -> Path:
    data = load_task(TASK).model_dump(mode="json")
    for section, values in sections.items():
        data[section] = {**data[section], **values}
    data.update(extra or {})
    path = home / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def fake_checkout(home: Path, tag: str) -> Path:
    path = home / "checkout"
    (path / "vllm").mkdir(parents=True)
    (path / "vllm" / "__init__.py").write_text("")
    repo = git.Repo.init(path, initial_branch="main")
    repo.git.add("-A")
    repo.git.commit("-qm", "vllm sources", env=GIT_ENV)
    repo.create_tag(f"v{tag}")
    return path


def checked(home: Path, *args, causes: tuple[str, ...], code: int = 2, **kw) -> str:
    before = disk(home)
    message = assert_one_error(run(home, *args, **kw), *causes, code=code)
    assert disk(home) == before
    assert not (home / "runs").exists()
    return message


def test_missing_task_file(home):
    checked(home, home / "nope.yaml", causes=("task file not found",))


def test_unknown_task_key(home):
    message = checked(home, task_file(home, extra={"bogus": 1}), causes=("bogus: Extra inputs are not permitted",))
    assert "1 problem(s)" in message


def test_bad_setting(home):
    checked(home, TASK, "--set", "nope.key=1", causes=("nope is not a section of the task",))


def test_task_targets_another_vllm(home):
    checkout = fake_checkout(home, installed_version())
    task = task_file(home, target={"vllm_version": "9.9.9", "checkout": str(checkout)})
    checked(home, task, causes=("targets vLLM 9.9.9, but", NO_VLLM))


def test_checkout_at_another_version(home):
    checkout = fake_checkout(home, "9.9.9")
    task = task_file(home, target={"vllm_version": installed_version(), "checkout": str(checkout)})
    checked(home, task, causes=(f"{checkout} has no tag v{installed_version()}", NO_VLLM))


def test_not_a_checkout(home):
    (home / "empty").mkdir()
    task = task_file(home, target={"vllm_version": installed_version(), "checkout": str(home / "empty")})
    checked(home, task, causes=("is not a git checkout", NO_VLLM))


def test_dirty_checkout(home):
    checkout = fake_checkout(home, installed_version())
    (checkout / "vllm" / "__init__.py").write_text("X = 1\n")
    with pytest.raises(CheckoutError, match=r"uncommitted changes \(vllm/__init__.py\)"):
        open_checkout(checkout, installed_version())
    task = task_file(home, target={"vllm_version": installed_version(), "checkout": str(checkout)})
    checked(home, task, causes=("has uncommitted changes (vllm/__init__.py)", NO_VLLM))


def test_patch_folder_without_patches(home):
    (home / "patches").mkdir()
    (home / "patches" / "README").write_text("no patches here\n")
    checked(home, TASK, "--proposer", "queue", "--patches", home / "patches", causes=("no .patch or .diff files in",))


def test_patch_folder_missing(home):
    checked(home, TASK, "--patches", home / "nope", causes=("patch folder not found",))


@pytest.mark.parametrize("text, cause", [
    ("this is not a patch\n", "No valid patches in input"),
    ("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,3 +1 @@\n-a\n", "corrupt patch at line 5"),
])
def test_unparseable_patch(home, text, cause):
    (home / "patches").mkdir()
    (home / "patches" / "1-ok.patch").write_text("--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-a\n+b\n")
    (home / "patches" / "2-bad.patch").write_text(text)
    message = checked(home, TASK, "--patches", home / "patches", causes=(cause,))
    assert "2-bad.patch: not a patch git can read" in message and "1-ok.patch" not in message


NOT_APPLYING = "Subject: edits a file the base lacks\n\n--- a/vllm/nope.py\n+++ b/vllm/nope.py\n@@ -1 +1 @@\n-a\n+b\n"


@needs_vllm
def test_a_queue_none_of_whose_patches_applies_is_refused_before_the_baseline(home):
    checkout = fake_checkout(home, installed_version())
    branches = git.Repo(checkout).git.branch("-a")
    (home / "patches").mkdir()
    for name in ("1-a.patch", "2-b.patch"):
        (home / "patches" / name).write_text(NOT_APPLYING)
    task = task_file(home, target={"vllm_version": installed_version(), "checkout": str(checkout)})
    message = assert_one_error(run(home, task, "--patches", home / "patches"), "no queued patch applies")
    assert "(2 checked; 1-a.patch: vllm/nope.py: does not exist)" in message
    assert not (home / "runs").exists()
    assert git.Repo(checkout).git.branch("-a") == branches and not git.Repo(checkout).git.status("--porcelain")


def test_a_queued_patch_that_does_not_apply_beside_one_that_does_is_a_warning(home):
    from agent.run.preflight import check_patches
    from tests.stand_in import new_file_patch

    checkout = fake_checkout(home, installed_version())
    (home / "patches").mkdir()
    (home / "patches" / "1-ok.patch").write_text(new_file_patch("vllm/new.py", "X = 1\n", "adds a file"))
    (home / "patches" / "2-bad.patch").write_text(NOT_APPLYING)
    (home / "patches" / "3-flags.patch").write_text("Nightshift-Engine-Args: {max_num_seqs: 8}\n")
    task = with_overrides(load_task(task_file(home, target={"vllm_version": installed_version(),
                                                            "checkout": str(checkout)})),
                          proposer={"kind": "queue", "patches": str(home / "patches")})
    warnings = check_patches(task, git.Repo(checkout))
    assert warnings == ["2-bad.patch does not apply to v%s (vllm/nope.py: does not exist); it is still "
                        "proposed, after the patches before it" % installed_version()]
    assert not git.Repo(checkout).git.status("--porcelain")  # the scratch index is not the checkout's


def test_docker_not_running(home):
    task = task_file(home, sandbox={"backend": "docker"})
    checked(home, task, causes=("no Docker engine reachable",),
            env={"DOCKER_HOST": f"unix://{home / 'dead.sock'}"})


def test_where_the_default_sandbox_cannot_run_the_run_stops_naming_the_others(home):
    """The default backend is `namespace`. On a machine where its namespaces cannot be made (here no `unshare` on
    PATH, only git) the run stops before anything starts, naming the other two backends and what `local` gives up."""
    (home / "bin").mkdir()
    (home / "bin" / "git").symlink_to(shutil.which("git"))
    message = checked(home, task_file(home), causes=("needs util-linux's `unshare`",), env={"PATH": str(home / "bin")})
    assert "sandbox.backend: docker" in message and "`local` (no isolation" in message, message


@pytest.mark.parametrize("command", ["review", "replay", "status"])
def test_unknown_run(home, command):
    (home / "runs").mkdir()
    before = disk(home)
    assert_one_error(nightshift(home, command, "nope", "--runs-dir", home / "runs"), "no run at nope")
    assert disk(home) == before


def started() -> RunStarted:
    return RunStarted(run_id="r1", nightshift_version="0", vllm_version="0.32.0", torch_version="t",
                      python_version="3", platform="p", checkout="/nonexistent", base_commit="b" * 40,
                      branch="nightshift/r1", model_sha256="m", task={"name": "x"})


@pytest.mark.parametrize("damage, record, cause", [
    (lambda data: data.replace(b'"summary":"p2"', b'"summary":"p9"'), 3, "record hash mismatch"),
    (lambda data: data[:-20], 4, "torn last line"),
])
def test_damaged_trace(home, damage, record, cause):
    trace = home / "runs" / "r1" / "trace.jsonl"
    writer = TraceWriter(trace)
    writer.append(started())
    for i in (1, 2, 3):
        writer.append(Proposal(candidate=i, proposer="queue", summary=f"p{i}"))
    writer.close()
    trace.write_bytes(damage(trace.read_bytes()))
    before = disk(home)
    proc = nightshift(home, "replay", "r1", "--runs-dir", home / "runs")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"audit failed at record {record}: ") and cause in lines[0], out
    assert disk(home) == before


def test_unreadable_branch_is_one_error_line(home):
    trace = home / "runs" / "r1" / "trace.jsonl"
    writer = TraceWriter(trace)
    writer.append(started())
    writer.close()
    assert_one_error(nightshift(home, "replay", "r1", "--runs-dir", home / "runs"),
                     "cannot read branch nightshift/r1 in /nonexistent")


@pytest.mark.vllm
@needs_vllm
def test_broken_vllm_install_is_caught_before_anything_starts(home):
    fake = home / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise RuntimeError({NMS!r})\n")
    started = time.monotonic()
    message = checked(home, TASK, causes=(NMS,), env={"PREPEND": [str(home / "site")]})
    assert time.monotonic() - started < 60
    assert "pip uninstall torchvision torchaudio torchcodec" in message and "scripts/install.sh" in message
    assert not any((home / "cache").iterdir())


def test_detach_prints_the_run_and_its_log_and_returns(home):
    task = task_file(home, sandbox={"backend": "docker"})
    dead = {"DOCKER_HOST": f"unix://{home / 'dead.sock'}"}
    started = time.monotonic()
    proc = nightshift(home, "run", task, "--runs-dir", home / "runs", "--detach", env=dead)
    assert proc.returncode == 0 and time.monotonic() - started < 30, proc.stdout + proc.stderr
    found = re.search(r"run (\S+) started in the background \(pid (\d+)\); log (\S+)", proc.stdout)
    assert found, proc.stdout
    run_id, pid, log = found.group(1), int(found.group(2)), Path(found.group(3))
    assert log == (home / "runs" / f"{run_id}.log").resolve()
    deadline = time.monotonic() + 120
    while Path(f"/proc/{pid}").exists() and "error:" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    text = log.read_text()
    assert [line for line in text.splitlines() if "error:" in line] == \
        [line for line in text.splitlines() if "no Docker engine reachable" in line] != [], text
    assert "Traceback" not in text and not (home / "runs" / run_id).exists()
    assert sorted(p.name for p in (home / "runs").iterdir()) == [f"{run_id}.log"]


def test_detach_refuses_an_existing_run_id(home):
    (home / "runs" / "r1").mkdir(parents=True)
    assert_one_error(nightshift(home, "run", TASK, "--runs-dir", home / "runs", "--detach", "--run-id", "r1"),
                     "run r1 already exists")
    assert sorted(p.name for p in (home / "runs").iterdir()) == ["r1"]


needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")


@pytest.mark.parametrize("args, cause", [
    (["--workers", "0"], "--workers 0: a run needs at least one worker"),
    (["--workers", "3", "--set", "sandbox.gpus=[0, 1]"],
     "sandbox.workers 3 x gpus_per_candidate 1 needs 3 GPUs, sandbox.gpus lists 2: [0, 1]"),
])
def test_bad_worker_count(home, args, cause):
    checked(home, TASK, *args, causes=(cause,))


def test_workers_without_ray(home):
    shim = home / "site" / "ray"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    checked(home, TASK, "--workers", "2", causes=("needs Ray: pip install 'nightshift[ray]'",),
            env={"PREPEND": [str(home / "site")]})


@needs_ray
@pytest.mark.parametrize("address, cause", [
    ("127.0.0.1:{port}", "no Ray cluster answers at 127.0.0.1:{port} (sandbox.ray_address or RAY_ADDRESS)"),
    ("nowhere", "cannot start or join the Ray cluster at nowhere: ValueError: Invalid address format: nowhere"),
])
def test_bad_ray_address(home, address, cause):
    port = free_port()
    started = time.monotonic()
    checked(home, TASK, "--workers", "2", "--set", f"sandbox.ray_address={address.format(port=port)}",
            causes=(cause.format(port=port),))
    assert time.monotonic() - started < 60


def test_last_error_line():
    logs = ("INFO starting\nTraceback (most recent call last):\n  File \"x.py\", line 1\n"
            f"RuntimeError: {NMS}\nINFO shutting down\n")
    assert last_error_line(logs) == f"RuntimeError: {NMS}"
    assert last_error_line("INFO all good\n") == ""


def test_a_server_that_dies_at_start_names_its_error(tmp_path):
    tree = tmp_path / "tree"
    (tree / "vllm" / "entrypoints" / "cli").mkdir(parents=True)
    for package in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli"):
        (tree / package / "__init__.py").write_text("")
    (tree / "vllm" / "entrypoints" / "cli" / "main.py").write_text(f"raise RuntimeError({NMS!r})\n")
    sandbox = LocalSandbox(run_dir=tmp_path / "run")
    with pytest.raises(SandboxError) as err:
        sandbox.start(ServerSpec(name="c1", source_tree=tree, model_dir=tmp_path, startup_timeout_s=60))
    assert re.fullmatch(rf"crash: server exited during startup( \(exit code 1\))?: RuntimeError: {NMS}", str(err.value))
