"""`nightshift run --resume` of a parallel run: the coordinator (tests/resume_driver.py, the CLI's run loop, on
this module's local Ray instance with 4 fake GPUs and fake servers in real processes) SIGKILLs itself with several
candidates in flight, in the middle of a worker's records, after a keep before its commit, after a commit and after
a remeasurement; resumed, it must keep the same patches as a run never killed, each once, against its own parent,
leave no server, pid file or worktree of the dead coordinator behind, and pass replay."""
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import git
import pytest

ray = pytest.importorskip("ray")

from agent.replay.chain import audit  # noqa: E402
from tests.conftest import once_per_session
from tests.stand_in import fake_task, mode, new_file_patch
from tests.run.test_resume import FAST_DELAY_S, PATCHES, decided, fake_checkout, kept_patches, leftovers, worktrees, write_task_file  # noqa: E402,F401
from traces import read_trace  # noqa: E402
from traces.log import CRASH_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUEUE = {**PATCHES, "4-conflict.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", FAST_DELAY_S), "as 1")}


NO_CHILD_KILLING = {"RAY_kill_child_processes_on_worker_exit": "0", "RAY_process_group_cleanup_enabled": "0",
                    "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper": "0"}
"""Ray kills the processes a dead worker started; not here, so that the dead coordinator's servers are left running
(as where the raylet itself was killed) and the resumed run must kill them."""


pytestmark = [pytest.mark.paced, pytest.mark.slow]  # paced: keeps by speed (fake speedups of 2.5x and more) must
# repeat the uninterrupted run's


@pytest.fixture(scope="module")
def cluster():
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.update(NO_CHILD_KILLING)
    ray.init(num_cpus=4, resources={"fake_gpu": 4}, include_dashboard=False, log_to_driver=False)
    for name in NO_CHILD_KILLING:
        del os.environ[name]
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def task_file(tmp_path_factory, fake_checkout, fake_model):
    return write_task_file(tmp_path_factory, fake_checkout, fake_model, QUEUE,
                           sandbox={"workers": 3, "gpu_resource": "fake_gpu"})


def harness(cluster: str, *args: str, crash: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != CRASH_ENV}
    env.update(PYTHONPATH=str(ROOT), RAY_ADDRESS=cluster, **({CRASH_ENV: crash} if crash else {}))
    return subprocess.run([sys.executable, "-m", "tests.resume_driver", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def start(cluster: str, task_file: Path, runs: Path, name: str, crash: str = "") -> Path:
    run_id = f"{name}-{secrets.token_hex(3)}"
    proc = harness(cluster, "start", str(task_file), str(runs), run_id, crash=crash)
    assert proc.returncode == (-signal.SIGKILL if crash else 0), proc.stderr[-3000:]
    return runs / run_id


def check_worktrees(run_dir: Path) -> None:
    """The run has ended: no worktree of it (a worker's, the coordinator's, a dead one's) is left in the checkout."""
    assert worktrees(run_dir) == []  # none missing, prunable or left registered


def check_finished(run_dir: Path, expected: list) -> list:
    events = [r.event for r in read_trace(run_dir / "trace.jsonl")]
    assert events[-1].kind == "run_finished" and events[-1].reason == "budget: candidates", events[-1]
    decisions = decided(events)
    assert kept_patches(run_dir) == expected, decisions  # the decisions say why, where a keep is missing
    assert sorted(d[0] for d in decisions) == [1, 2, 3, 4], decisions
    assert sorted(e.candidate for e in events if e.kind == "proposal") == [1, 2, 3, 4]  # none proposed again
    commits = [e for e in events if e.kind == "commit"]
    assert len({c.decision_sha256 for c in commits}) == len(commits) == 2
    repo = git.Repo(read_trace(run_dir / "trace.jsonl")[0].event.checkout)
    for commit in commits:  # each kept on evidence measured against its own parent
        at = next(i for i, e in enumerate(events) if e.kind == "decision" and e.candidate == commit.candidate)
        applied = [e for e in events[:at] if e.kind == "patch_applied" and e.candidate == commit.candidate][-1]
        assert applied.parent_commit == repo.commit(commit.commit).parents[0].hexsha
    result = audit(run_dir)
    assert result.finished and result.commits == 2
    replay = subprocess.run([sys.executable, "-m", "agent.face.cli", "replay", str(run_dir)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0 and "audit ok" in replay.stdout, replay.stdout + replay.stderr
    assert leftovers(run_dir) == []
    check_worktrees(run_dir)
    return events


@pytest.fixture(scope="module")
def uninterrupted(cluster, task_file, tmp_path_factory):
    """A parallel run never killed and the patches it kept (made once for the session: tests/conftest.py
    `once_per_session`)."""
    def run():
        run_dir = start(cluster, task_file, tmp_path_factory.mktemp("runs"), "never-killed")
        patches = kept_patches(run_dir)
        assert len(patches) == 2 and "fake_mode_1.json" in patches[0][0] and "fake_mode_3.json" in patches[1][0]
        check_finished(run_dir, patches)
        return str(run_dir), patches
    run_dir, patches = once_per_session(tmp_path_factory, "parallel-resume-uninterrupted", run)
    return Path(run_dir), [tuple(p) for p in patches]


CRASHES = ["after:proposal:3", "after:benchmark:1", "after:decision:1", "before:commit:1", "after:commit:1",
           "after:remeasured:3"]
HALVES = [pytest.mark.xdist_group("parallel-resume-a"), pytest.mark.xdist_group("parallel-resume-b")]
"""The module's tests on two xdist workers, not one each: every worker that runs one starts a local Ray instance of
its own (on 2 cores, four at once were the paced tier's largest use of CPU after the tests themselves)."""


@pytest.mark.parametrize("crash", [pytest.param(c, marks=HALVES[i % 2]) for i, c in enumerate(CRASHES)])
def test_a_parallel_run_killed_at_a_boundary_resumes_to_the_same_branch(crash, cluster, task_file, uninterrupted,
                                                                       tmp_path):
    run_dir = start(cluster, task_file, tmp_path / "runs", "killed", crash=crash)
    before = [r.event for r in read_trace(run_dir / "trace.jsonl")]
    decided = {e.candidate for e in before if e.kind == "decision"}
    in_flight = sorted(e.candidate for e in before if e.kind == "proposal" and e.candidate not in decided)
    assert in_flight and (crash != "after:proposal:3" or in_flight == [1, 2, 3]), in_flight
    resumed = harness(cluster, "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = check_finished(run_dir, uninterrupted[1])
    marks = [e for e in events if e.kind == "resumed"]
    assert len(marks) == 1
    mark = marks[0]
    assert mark.in_flight == in_flight and mark.candidate == in_flight[0] and mark.after_seq == len(before) - 1
    assert mark.reaped >= 6 and mark.worktrees_removed >= 3  # each worker's reference and incumbent, at least
    again = f"candidate{'s' * (len(in_flight) > 1)} {', '.join(map(str, in_flight))} evaluated again"
    assert again in resumed.stdout, resumed.stdout
    if crash == "after:decision:1":
        assert mark.pending_keep == "commit"
    if crash == "before:commit:1":
        assert mark.pending_keep.startswith("found ")
    kinds = [e.kind for e in events]
    after = kinds[kinds.index("resumed") + 1:]
    assert after[:1] == (["commit"] if mark.pending_keep else ["self_parity"])
    assert after.count("self_parity") == 3  # the baseline phase again, on each worker


@HALVES[1]
def test_a_parallel_run_killed_after_its_last_decision_only_finishes(cluster, task_file, uninterrupted, tmp_path):
    run_dir = start(cluster, task_file, tmp_path / "runs", "spent", crash="after:decision:4")
    resumed = harness(cluster, "resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "nothing left to evaluate (budget: candidates)" in " ".join(resumed.stdout.split()), resumed.stdout
    events = check_finished(run_dir, uninterrupted[1])
    kinds = [e.kind for e in events]
    assert kinds[kinds.index("resumed") + 1:] == ["run_finished"]  # no worker started, no baseline phase
    mark = next(e for e in events if e.kind == "resumed")
    assert mark.finishing == "budget: candidates" and mark.in_flight == [] and mark.reaped >= 6
