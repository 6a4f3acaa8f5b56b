"""Candidates in parallel on a local Ray instance that declares 4 fake GPUs, with fake servers in real processes:
results are settled in candidate order, a keep measured against an old head is measured again (or discarded as
stale), a killed worker's candidate is a crash and the run goes on, and the branch and trace pass replay."""
import json
import os
import signal
import threading
import time
from pathlib import Path

import git
import pytest

ray = pytest.importorskip("ray")

from agent.replay.chain import audit  # noqa: E402
from agent.run.parallel import Parallel  # noqa: E402
from agent.proposers.queue import QueueProposer  # noqa: E402
from agent.run.setup import prepare_run  # noqa: E402
from tests.fake_sandbox import worker_sandbox  # noqa: E402
from tests.stand_in import VERSION, fake_task, mode, new_file_patch
from traces import read_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


pytestmark = [pytest.mark.heavy, pytest.mark.slow]  # heavy: a local Ray instance of 4 CPUs; candidates judged by
# speed, fake speedups many times the noise


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, resources={"fake_gpu": 4}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def parallel(tmp_path, fake_checkout, fake_model):
    def make(patches: dict[str, str], workers: int, **overrides):
        folder = tmp_path / "patches"
        folder.mkdir()
        for name, text in patches.items():
            (folder / name).write_text(text)
        task = fake_task(fake_checkout, fake_model, folder,
                         sandbox={"workers": workers, "gpu_resource": "fake_gpu"}, **overrides)
        setup = prepare_run(task, tmp_path / "runs", vllm_version=VERSION)
        return setup, Parallel(setup, QueueProposer(folder), sandbox_factory=worker_sandbox)
    return make


def kill_worker_at(run_dir: Path, candidate: int, stage: str, killed: list):
    def watch():
        deadline = time.time() + 150
        while time.time() < deadline and not killed:
            for path in (run_dir / "workers").glob("*/status.json"):
                try:
                    row = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if row["candidate"] == candidate and row["stage"] == stage:
                    os.kill(row["pid"], signal.SIGKILL)
                    killed.append(row)
                    return
            time.sleep(0.05)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_parallel_candidates_are_settled_against_the_head_they_would_join(parallel):
    setup, coordinator = parallel({
        "1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.001), "faster"),
        "2-as-fast.patch": new_file_patch("vllm/fake_mode_2.json", mode("exact", 0.001), "as fast as 1"),
        "3-conflict.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.001), "same file as 1"),
        "4-killed.patch": new_file_patch("vllm/fake_mode_4.json", mode("exact", 0.01), "its worker is killed"),
        "5-random.patch": new_file_patch("vllm/fake_mode_5.json", mode("random"), "different tokens"),
    }, workers=3)
    killed: list = []
    watcher = kill_worker_at(setup.run_dir, 4, "benchmark", killed)
    finished = coordinator.run()
    watcher.join(1)
    records = read_trace(setup.run_dir / "trace.jsonl")
    events = [r.event for r in records]
    got = {e.candidate: e for e in events if e.kind == "decision"}

    # Candidates 1-3 were in flight at once, all measured against the base commit.
    spans = {}
    for _, n, start, end in coordinator.spans:
        spans.setdefault(n, (start, end))  # the first measurement of each
    spans = {n: spans[n] for n in (1, 2, 3)}
    assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values())
    assert got[1].verdict == "keep", got[1].reason
    remeasured = {e.candidate: e for e in events if e.kind == "remeasured"}
    assert set(remeasured) == {2, 3} and all(e.measured_against == setup.base_commit for e in remeasured.values())
    assert got[2].verdict == "discard" and got[2].stage == "decision"  # against the new head it is not faster
    assert (got[3].verdict, got[3].stage) == ("discard", "apply") and got[3].reason.startswith("stale:")
    assert killed and (got[4].verdict, got[4].stage) == ("crash", "benchmark"), got[4].reason
    assert "died" in got[4].reason
    assert (got[5].verdict, got[5].stage) == ("discard", "parity")  # the run went on without the dead worker
    assert finished.candidates == 5 and finished.kept == 1 and finished.gpu_hours > 0

    # Each commit's evidence was measured against its own parent: the last patch_applied before its decision.
    repo = git.Repo(setup.repo.working_dir)
    commits = [e for e in events if e.kind == "commit"]
    for commit in commits:
        at = next(i for i, e in enumerate(events) if e.kind == "decision" and e.candidate == commit.candidate)
        applied = [e for e in events[:at] if e.kind == "patch_applied" and e.candidate == commit.candidate][-1]
        assert applied.parent_commit == repo.commit(commit.commit).parents[0].hexsha
    result = audit(setup.run_dir)
    assert result.commits == 1 and result.finished
    pids = list((setup.run_dir / "workers").glob("*/servers/*/pid"))
    assert not pids  # every server stopped, the dead worker's reaped


def test_two_workers_evaluate_twice_as_many_candidates_per_hour(parallel, tmp_path):
    patches = {f"{i}-slow.patch": new_file_patch(f"vllm/fake_mode_{i}.json", mode("exact", 0.01), f"no faster {i}")
               for i in range(1, 5)}
    setup, coordinator = parallel(patches, workers=2)
    started = time.time()
    finished = coordinator.run()
    assert finished.candidates == 4 and finished.kept == 0
    busy = sum(end - start for _, _, start, end in coordinator.spans)
    wall = max(end for *_, end in coordinator.spans) - min(start for *_, start, _ in coordinator.spans)
    print(f"2 workers: 4 candidates, {wall:.1f} s of candidate wall clock, {busy:.1f} s busy "
          f"({3600 * 4 / wall:.0f} candidates/h vs {3600 * 4 / busy:.0f} one at a time); run {time.time() - started:.1f} s")
    # Not the ratio (a loaded host stretches one span and not the other), but what makes it: both workers took
    # candidates, and the candidates were two at a time in flight, never more.
    assert len({worker for worker, *_ in coordinator.spans}) == 2
    assert most_in_flight(coordinator.spans) == 2
    assert audit(setup.run_dir).finished


def most_in_flight(spans) -> int:
    """The most candidates whose (start, end) spans overlap at one moment."""
    edges = sorted([(start, 1) for _, _, start, _ in spans] + [(end, -1) for *_, end in spans],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most
