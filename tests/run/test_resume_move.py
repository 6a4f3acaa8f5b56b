"""`nightshift run --resume <pack.tgz | folder>` where the run has never been: another runs folder, another vLLM
checkout, an empty NIGHTSHIFT_CACHE. The harness (tests/resume_driver.py, fake servers) is killed mid-candidate,
packed, resumed elsewhere; there packed again while it runs, and resumed once more in a third place."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import git
import pytest

from agent.replay.chain import audit, checkout_of
from agent.run.move import MoveRefused
from agent.run.resume import check_resumable
from sandbox.local import reap_servers

from tests.run.test_resume import (CRASH_ENV, PATCHES, ROOT, VERSION, cli, fake_checkout, harness,  # noqa: F401
                               start, task_file, write_task_file)
from traces import read_trace


def host_checkout(fake_checkout: Path, path: Path, content: str | None = None) -> Path:
    """A checkout as `nightshift checkout` makes one on another host from the same vLLM: the same tagged commit,
    and nothing else (no run branch). With CONTENT, one whose vLLM sources differ."""
    repo = git.Repo.init(path, initial_branch="main")
    repo.git.fetch("--quiet", str(fake_checkout), f"refs/tags/v{VERSION}:refs/tags/v{VERSION}")
    repo.git.checkout("-q", "-B", "main", f"v{VERSION}")
    if content is not None:
        (path / "vllm" / "__init__.py").write_text(content)
        repo.git.commit("-qam", "another vLLM", env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                                       "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
        repo.git.tag("-f", f"v{VERSION}")
    return path


def commits(run_dir: Path) -> list[str]:
    records = read_trace(run_dir / "trace.jsonl")
    started = records[0].event
    return git.Repo(checkout_of(records)).git.rev_list(f"{started.base_commit}..{started.branch}").split()


@pytest.fixture
def places(tmp_path):
    """Three "hosts" (folders of this one); the servers their killed harnesses leave are killed at the end."""
    yield [tmp_path / name for name in ("a", "b", "c")]
    reap_servers_under(tmp_path)


def reap_servers_under(root: Path) -> int:
    return sum(reap_servers(runs) for runs in root.glob("*/runs"))


@pytest.fixture
def own_queue(tmp_path_factory, fake_checkout, fake_model) -> Path:
    """The crash suites' task with a patch folder of its own, which the test takes away."""
    return write_task_file(tmp_path_factory, fake_checkout, fake_model, PATCHES)


def test_a_run_killed_mid_candidate_moves_twice_and_finishes(own_queue, fake_checkout, places, tmp_path):
    host_a, host_b, host_c = places
    run_a = start(own_queue, host_a / "runs", "moving", crash="after:sample:1")  # killed mid-candidate
    assert (run_a / "harness").is_file()
    pack1 = tmp_path / "carried" / "run1.tgz"
    packed = cli("pack", str(run_a), str(pack1))
    assert packed.returncode == 0 and "has not finished" in packed.stdout, packed.stderr
    manifest = json.loads(tarfile.open(pack1).extractfile(f"{run_a.name}/manifest.json").read())
    assert manifest["harness_alive"] is False and manifest["run_dir"] == str(run_a)
    # the queue's patches travel in the pack: the folder the task recorded is not on the other hosts
    queue = Path(json.loads(own_queue.read_text())["proposer"]["patches"])
    assert manifest["queue"] == str(queue)
    assert sorted(n for n in manifest["files"] if n.startswith("queued-patches/")) == \
        sorted(f"queued-patches/{name}" for name in PATCHES)
    shutil.rmtree(queue)

    # Host B: another runs folder, checkout and cache. The harness goes on from the pack; it is packed while it
    # runs, the live pack refused beside it on this host, then the harness is killed.
    checkout_b = host_checkout(fake_checkout, host_b / "vllm")
    env_b = {**os.environ, "PYTHONPATH": str(ROOT), "NIGHTSHIFT_CACHE": str(host_b / "cache")}
    env_b.pop(CRASH_ENV, None)
    proc = subprocess.Popen([sys.executable, "-m", "tests.resume_driver", "resume", str(pack1), str(host_b / "runs"),
                             str(checkout_b)], cwd=ROOT, env=env_b, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run_b = host_b / "runs" / run_a.name
    deadline = time.monotonic() + 90
    while not (run_b / "trace.jsonl").is_file() or b'"kind":"parity"' not in \
            (run_b / "trace.jsonl").read_bytes().partition(b'"kind":"resumed"')[2]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.1)
    pack2 = tmp_path / "carried" / "run2.tgz"
    packed = cli("pack", str(run_b), str(pack2))
    assert packed.returncode == 0, packed.stderr
    with pytest.raises(MoveRefused, match="still runs on this host"):
        check_resumable(str(pack2), host_c / "runs")  # the live pack, beside its harness on the same host
    proc.kill()  # host B is taken away
    proc.communicate()
    assert not (run_b / "branch.bundle").exists() and not (run_b / "manifest.json").exists()

    checkout_c = host_checkout(fake_checkout, host_c / "vllm")
    resumed = harness("resume", str(pack2), str(host_c / "runs"), str(checkout_c),
                      env={"NIGHTSHIFT_CACHE": str(host_c / "cache")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_c = host_c / "runs" / run_a.name
    assert "moved from" in resumed.stdout and str(run_c) in " ".join(resumed.stdout.split())

    records = read_trace(run_c / "trace.jsonl")
    events = [r.event for r in records]
    assert events[-1].kind == "run_finished" and events[-1].reason == "budget: candidates", events[-1]
    marks = [e for e in events if e.kind == "resumed"]
    assert len(marks) == 2 and all(m.moved is not None for m in marks)
    first, second = (m.moved for m in marks)
    assert (first.from_run_dir, first.from_checkout, first.to_run_dir, first.to_checkout) == \
        (str(run_a), str(fake_checkout), str(run_b), str(checkout_b))
    assert (first.to_cache, first.pack, first.packed_live) == (str(host_b / "cache"), str(pack1), False)
    assert (second.from_run_dir, second.from_checkout, second.to_run_dir, second.to_checkout) == \
        (str(run_b), str(checkout_b), str(run_c), str(checkout_c))
    assert second.from_cache == str(host_b / "cache") and second.to_cache == str(host_c / "cache")
    assert second.packed_live and second.pack == str(pack2)
    # each host read the queue the pack carried, and host B's pack carried it on
    assert (first.queue, second.queue) == (str(run_b / "queued-patches"), str(run_c / "queued-patches"))
    assert "queued patches from" in resumed.stdout
    for name, text in PATCHES.items():
        assert (run_c / "queued-patches" / name).read_text() == text
    assert [m.candidate for m in marks] == [1, first_in_flight(records, marks[1])]
    assert [m.reaped for m in marks] == [0, 0]  # nothing of the other hosts' is killed here
    # the budget counts across the three places: three candidates in all, each decided once
    decisions = [e for e in events if e.kind == "decision"]
    assert sorted(d.candidate for d in decisions) == [1, 2, 3]
    assert len([e for e in events if e.kind == "proposal"]) == 3
    assert marks[1].spent_s > marks[0].spent_s and events[-1].seconds > marks[1].spent_s
    keeps = [d for d in decisions if d.verdict == "keep"]
    kept_commits = [e for e in events if e.kind == "commit"]
    assert len(keeps) == len(kept_commits) == len(commits(run_c)) >= 1  # 1 and 3 are faster; 2 fails parity
    assert audit(run_c).finished
    replay = cli("replay", str(run_c))
    assert replay.returncode == 0 and "audit ok" in replay.stdout, replay.stdout + replay.stderr
    assert not (run_c / "branch.bundle").exists()  # replay read the branch in checkout C
    assert git.Repo(checkout_c).git.rev_parse(f"nightshift/{run_a.name}") == \
        events[-1].head_commit
    # the harnesses killed on "hosts" A and B left their servers there
    assert reap_servers(host_a / "runs") >= 2 and reap_servers(host_b / "runs") >= 2
    assert reap_servers_under(tmp_path) == 0


def first_in_flight(records, mark) -> int:
    """The candidate in flight when host B's harness was killed: the last proposal before the mark."""
    proposals = [r.event.candidate for r in records[:mark.after_seq + 1] if r.event.kind == "proposal"]
    decided = {r.event.candidate for r in records[:mark.after_seq + 1] if r.event.kind == "decision"}
    left = [n for n in proposals if n not in decided]
    return left[0] if left else 0


def test_a_pack_whose_vllm_differs_or_whose_branch_went_on_is_refused(task_file, fake_checkout, places, tmp_path):
    run_a = start(task_file, tmp_path / "a" / "runs", "refused-move", crash="after:commit:1")
    pack = tmp_path / "run.tgz"
    assert cli("pack", str(run_a), str(pack)).returncode == 0
    other = host_checkout(fake_checkout, tmp_path / "b" / "vllm", content="VERSION = '0.32.0'  # patched\n")
    refused = cli("run", "--resume", str(pack), "--runs-dir", str(tmp_path / "b" / "runs"), "--checkout", str(other))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "is not the run's base" in refused.stderr and "vllm/__init__.py" in refused.stderr
    assert not git.Repo(other).git.branch("--list", f"nightshift/{run_a.name}")  # nothing brought in
    # the folder the refused attempt unpacked is taken again as it is; a changed one is refused
    run_b = tmp_path / "b" / "runs" / run_a.name
    assert check_resumable(str(pack), tmp_path / "b" / "runs") == run_b
    (run_b / "trace.jsonl").write_bytes((run_b / "trace.jsonl").read_bytes()[:-1])
    with pytest.raises(MoveRefused, match="already exists"):
        check_resumable(str(pack), tmp_path / "b" / "runs")
    # a damaged pack is named
    data = bytearray(pack.read_bytes())
    broken = tmp_path / "broken.tgz"
    broken.write_bytes(bytes(data[:len(data) // 2]))
    assert "cannot read the pack" in cli("run", "--resume", str(broken), "--runs-dir", str(tmp_path / "c")).stderr
    # the run's own checkout went on past the pack: resuming the pack into it would fork the run. The resumed run
    # finishes; whether its faster candidate 3 is kept depends on the machine's load, so the branch is taken past
    # the pack's head by a commit of its own, as a keep would
    resumed = harness("resume", str(run_a))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    repo, branch = git.Repo(fake_checkout), f"nightshift/{run_a.name}"
    tip = repo.git.rev_parse(branch)
    went_on = repo.git.commit_tree(f"{tip}^{{tree}}", "-p", tip, "-m", "the run went on",
                                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
                                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"})
    repo.git.update_ref(f"refs/heads/{branch}", went_on, tip)
    refused = cli("run", "--resume", str(pack), "--runs-dir", str(tmp_path / "d"), "--checkout", str(fake_checkout))
    assert refused.returncode == 2 and "does not contain" in refused.stderr, refused.stderr


def test_a_run_told_to_stop_with_sigterm_stops_resumable_and_moves(task_file, fake_checkout, places, tmp_path):
    """What a spot host's notice does: SIGTERM. The run records a resumable stop, is packed and goes on elsewhere."""
    host_a, host_b, _ = places
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(CRASH_ENV, None)
    runs = host_a / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "tests.resume_driver", "start", str(task_file), str(runs),
                             "termed"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trace = runs / "termed" / "trace.jsonl"
    deadline = time.monotonic() + 90
    while not trace.is_file() or b'"kind":"sample"' not in trace.read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    last = read_trace(trace)[-1].event
    assert last.kind == "run_finished" and last.resumable and last.reason == "stopped by SIGTERM"
    assert not list((runs / "termed").glob("servers/*/pid"))  # it stopped its own servers
    assert cli("pack", str(runs / "termed"), str(tmp_path / "run.tgz")).returncode == 0
    resumed = harness("resume", str(tmp_path / "run.tgz"), str(host_b / "runs"),
                      str(host_checkout(fake_checkout, host_b / "vllm")), env={"NIGHTSHIFT_CACHE": str(host_b / "c")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = [r.event for r in read_trace(host_b / "runs" / "termed" / "trace.jsonl")]
    mark = next(e for e in events if e.kind == "resumed")
    assert mark.after_event == "run_finished" and mark.candidate == 1 and mark.moved.to_run_dir.startswith(
        str(host_b))
    assert events[-1].reason == "budget: candidates" and not events[-1].resumable
    assert sorted(e.candidate for e in events if e.kind == "decision") == [1, 2, 3]


def test_recorded_project_paths_are_found_in_this_project(tmp_path):
    """A run records its task's model config and patch folder as absolute paths of the project it ran from;
    on a host that holds the project elsewhere, the resumed run finds them at the same place within this one.
    A recorded path that exists is taken as it is, and one found nowhere is left for the check that names it."""
    from agent.run.resume import here

    project = tmp_path / "here" / "nightshift"
    (project / "tasks" / "models" / "m").mkdir(parents=True)
    (project / "tasks" / "models" / "m" / "config.json").write_text("{}")
    (project / "queue").mkdir()
    gone = Path("/gone/elsewhere/repo")
    assert here(gone / "tasks" / "models" / "m" / "config.json", project) == project / "tasks/models/m/config.json"
    assert here(gone / "queue", project) == project / "queue"
    assert here(gone / "nothing" / "like" / "it", project) == gone / "nothing" / "like" / "it"
    existing = tmp_path / "old" / "tasks" / "models" / "m"
    existing.mkdir(parents=True)
    (existing / "config.json").write_text("{}")
    assert here(existing / "config.json", project) == existing / "config.json"
