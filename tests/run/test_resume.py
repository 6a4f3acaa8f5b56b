"""`nightshift run --resume`: the harness is SIGKILLed at every stage boundary (and halfway through writing a
trace line), then resumed; the finished run must keep the same patches, in order, as a run never killed.

The harness is a real process (tests/resume_driver.py, the CLI's run loop on fake servers in real processes)
that kills itself at a chosen record (traces/log.py, NIGHTSHIFT_TEST_CRASH)."""
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import git
import pytest

from agent.replay.chain import audit
from agent.run.loop import Loop
from agent.proposers.clients import FakeModel
from agent.proposers.base import Attempt, ProposalContext
from agent.proposers.flags import FlagsProposer
from agent.proposers.llm import LlmProposer
from agent.proposers.queue import QueueProposer
from agent.run.setup import RunLocked, lock_run, prepare_run
from agent.world.task import FlagsProposer as FlagsConfig
from agent.world.task import parse_task
from tests.conftest import once_per_session
from tests.fake_sandbox import FakeSandbox
from tests.stand_in import REQUEST_TIMEOUT_S, fake_task, mode, new_file_patch
from traces import read_trace
from traces.log import CRASH_ENV
from traces.schema import Decision, Proposal, Record

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.32.0"
FAST_DELAY_S = 0.008
PATCHES = {  # the baseline takes 20 ms a token: passes long enough to measure on a busy machine, and each keep
    # a few times faster than its incumbent (a pass's fixed costs, about 0.2 s on a busy 2-core machine, dilute it)
    "1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", FAST_DELAY_S), "faster"),
    "2-random.patch": new_file_patch("vllm/fake_mode_2.json", mode("random"), "different tokens"),
    "3-faster.patch": new_file_patch("vllm/fake_mode_3.json", mode("exact", 0.001), "faster still"),
}


pytestmark = pytest.mark.paced  # paced: keeps by speed (fake speedups of 2.5x and more) must repeat the
# uninterrupted run's


def harness(*args: str, crash: str = "", timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != CRASH_ENV}, **(env or {})}
    env["PYTHONPATH"] = str(ROOT)
    if crash:
        env[CRASH_ENV] = crash
    return subprocess.run([sys.executable, "-m", "tests.resume_driver", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "agent.face.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def fake_checkout(tmp_path_factory) -> Path:
    """A git checkout of a pure-Python stand-in for vLLM (tests/fake_vllm.py reads its mode), tagged."""
    path = tmp_path_factory.mktemp("fake-vllm") / "checkout"
    (path / "vllm").mkdir(parents=True)
    (path / "vllm" / "__init__.py").write_text(f"VERSION = '{VERSION}'\n")
    (path / "vllm" / "fake_mode.json").write_text(mode("exact", 0.02))
    (path / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    repo = git.Repo.init(path, initial_branch="main")
    repo.git.add("-A")
    repo.git.commit("-qm", "stand-in vLLM", env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
                                                 "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"})
    repo.create_tag(f"v{VERSION}")
    return path


def write_task_file(tmp_path_factory, checkout: Path, model: Path, patches: dict[str, str], **overrides) -> Path:
    """The crash suites' task: a queue of `patches`, small parity and benchmark settings, as JSON on disk."""
    folder = tmp_path_factory.mktemp("patches")
    for name, text in patches.items():
        (folder / name).write_text(text)
    task = fake_task(checkout, model, folder, budget={"max_candidates": len(patches), "wall_clock_s": 600},
                     parity={"num_prompts": 2, "input_len": 8, "max_tokens": 8, "regime": "sequential"},
                     acceptance={"min_speedup": 1.05, "confidence": 0.95, "confirmations": 0},
                     # 6 pairs, up to 12 where the sequential rule has not decided (a busy machine's spread)
                     benchmark={"warmup_requests": 2, "repetitions": 6, "max_repetitions": 12,
                                "request_timeout_s": REQUEST_TIMEOUT_S, "max_client_busy": 1.0}, **overrides)
    path = folder.parent / "task.json"
    path.write_text(task.model_dump_json())
    return path


@pytest.fixture(scope="module")
def task_file(tmp_path_factory, fake_checkout, fake_model):
    return write_task_file(tmp_path_factory, fake_checkout, fake_model, PATCHES)


def start(task_file: Path, runs: Path, name: str, crash: str = "") -> Path:
    run_id = f"{name}-{secrets.token_hex(3)}"  # the checkout is shared: one branch per run
    proc = harness("start", str(task_file), str(runs), run_id, crash=crash)
    assert proc.returncode == (-signal.SIGKILL if crash else 0), proc.stderr[-3000:]
    return runs / run_id


def kept_patches(run_dir: Path) -> list[tuple[str, str]]:
    """(the change, the serving flags) of each commit on the run branch, oldest first."""
    started = read_trace(run_dir / "trace.jsonl")[0].event
    repo = git.Repo(started.checkout)
    shas = repo.git.rev_list("--reverse", f"{started.base_commit}..{started.branch}").split()
    return [(repo.git.diff(f"{sha}^", sha, "--", ".", ":(exclude)nightshift.serve.yaml"),
             repo.git.show(f"{sha}:nightshift.serve.yaml")) for sha in shas]


def leftovers(run_dir: Path) -> list[str]:
    """Server processes of the run still alive, and server pid files left behind (a parallel run's workers' too)."""
    alive = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "fake_vllm.py" in text and str(run_dir) in text:
            alive.append(f"pid {cmdline.parent.name}: {text[:200]}")
    return alive + [str(p) for p in [*run_dir.glob("servers/*/pid"), *run_dir.glob("workers/*/servers/*/pid")]]


def worktrees(run_dir: Path) -> list[str]:
    started = read_trace(run_dir / "trace.jsonl")[0].event
    listed = git.Repo(started.checkout).git.worktree("list", "--porcelain").split("\n\n")
    ours = [block for block in listed if str(run_dir) in block]
    assert not [b for b in ours if "prunable" in b], ours
    paths = [Path(block.splitlines()[0].split(" ", 1)[1]) for block in ours]
    assert all(p.is_dir() for p in paths), paths
    return sorted(p.name for p in paths)


@pytest.fixture(scope="module")
def uninterrupted(task_file, tmp_path_factory):
    """A run never killed and the patches it kept (made once for the session: tests/conftest.py
    `once_per_session`; its folder is only read)."""
    def run():
        run_dir = start(task_file, tmp_path_factory.mktemp("runs"), "never-killed")
        patches = kept_patches(run_dir)
        assert len(patches) == 2 and "fake_mode_1.json" in patches[0][0] and "fake_mode_3.json" in patches[1][0]
        return str(run_dir), patches
    run_dir, patches = once_per_session(tmp_path_factory, "resume-uninterrupted", run)
    return Path(run_dir), [tuple(p) for p in patches]


def decided(events: list) -> list[tuple]:
    """(candidate, verdict, stage, reason) of each decision: what an assertion on the kept patches shows when one
    is missing."""
    return [(e.candidate, e.verdict, e.stage, e.reason) for e in events if e.kind == "decision"]


def check_finished(run_dir: Path, expected: list) -> list:
    records = read_trace(run_dir / "trace.jsonl")
    events = [r.event for r in records]
    assert events[-1].kind == "run_finished" and events[-1].reason == "budget: candidates", events[-1]
    assert kept_patches(run_dir) == expected, decided(events)
    result = audit(run_dir)
    assert result.finished and result.commits == 2
    decisions = [e for e in events if e.kind == "decision"]
    assert sorted(d.candidate for d in decisions) == [1, 2, 3]  # each candidate decided once
    commits = [e for e in events if e.kind == "commit"]
    assert len({c.decision_sha256 for c in commits}) == len(commits) == 2
    assert leftovers(run_dir) == []
    # the dead harness's trees were removed by the resume, and the resumed one's own (baseline, incumbent) when
    # the run ended; none is left registered in the checkout, none prunable
    assert worktrees(run_dir) == []
    return events


CRASHES = [
    "after:self_parity:*", "after:proposal:3", "after:patch_applied:3", "after:build:3", "after:parity:3",
    "after:sample:3", "after:benchmark:3", "after:decision:1", "before:commit:1", "after:commit:1",
    "tear:benchmark:3", "tear:commit:3", "after:decision:3", "after:commit:3",
]
SPENT = {"tear:commit:3", "after:decision:3", "after:commit:3"}
"""Kills after the last candidate's decision: the budget is spent, so the resumed run only finishes."""


@pytest.mark.parametrize("crash", CRASHES)
@pytest.mark.slow
def test_a_run_killed_at_a_stage_boundary_resumes_to_the_same_branch(crash, task_file, uninterrupted, tmp_path):
    run_dir = start(task_file, tmp_path / "runs", "killed", crash=crash)
    when, kind, candidate = crash.split(":")
    before = read_trace(run_dir / "trace.jsonl") if when != "tear" else None
    resumed = harness("resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = check_finished(run_dir, uninterrupted[1])
    marks = [e for e in events if e.kind == "resumed"]
    assert len(marks) == 1
    mark = marks[0]
    if when == "tear":
        assert mark.dropped_bytes > 0 and mark.dropped.startswith('{"sha256":"')
        assert f'"kind":"{kind}"' not in mark.dropped or len(mark.dropped) >= 300
    else:
        assert mark.dropped_bytes == 0 and mark.after_seq == len(before) - 1
    in_flight = {"proposal", "patch_applied", "build", "parity", "sample", "benchmark"}
    if kind in in_flight:
        assert mark.candidate == int(candidate)  # evaluated again from its proposal, not proposed again
        assert len([e for e in events if e.kind == "proposal" and e.candidate == mark.candidate]) == 1
    if crash in ("after:decision:1", "after:decision:3"):
        assert mark.pending_keep == "commit"
    if crash in ("before:commit:1", "tear:commit:3"):
        assert mark.pending_keep.startswith("found ")
    kinds = [e.kind for e in events]
    after = kinds[kinds.index("resumed") + 1:]
    if crash in SPENT:  # the keep settled (if pending); the kept head, never audited at its end, is audited now
        assert mark.finishing == "budget: candidates", after
        settled = [] if crash == "after:commit:3" else ["commit"]
        assert after == settled + ["self_parity", "audit", "audit", "run_finished"], after
        end_audit = [e for e in events if e.kind == "audit"][-1]
        assert end_audit.incumbent and end_audit.candidate == 0 and end_audit.commit == events[-1].head_commit
    else:
        assert mark.finishing == "" and after[:2] in (["self_parity", "audit"], ["commit", "self_parity"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed"][0]["after_seq"] == mark.after_seq


@pytest.mark.slow
def test_a_run_killed_while_resuming_resumes_again(task_file, uninterrupted, tmp_path):
    run_dir = start(task_file, tmp_path / "runs", "twice", crash="after:decision:1")
    assert harness("resume", str(run_dir), crash="after:resumed:*").returncode == -signal.SIGKILL
    assert harness("resume", str(run_dir), crash="after:commit:1").returncode == -signal.SIGKILL
    assert harness("resume", str(run_dir)).returncode == 0
    events = check_finished(run_dir, uninterrupted[1])
    assert [e.pending_keep for e in events if e.kind == "resumed"] == ["commit", "commit", ""]


@pytest.mark.slow
def test_resume_refuses_a_finished_tampered_moved_or_running_run(task_file, uninterrupted, tmp_path):
    for detach in ([], ["--detach"]):
        done = cli("run", "--resume", str(uninterrupted[0]), *detach)
        assert done.returncode == 2 and "already finished" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    run_dir = start(task_file, tmp_path / "runs", "refused", crash="after:parity:3")
    trace = run_dir / "trace.jsonl"
    original = trace.read_bytes()
    lines = original.split(b"\n")
    lines[3] = lines[3].replace(b'"candidate":1', b'"candidate":7', 1)
    trace.write_bytes(b"\n".join(lines))
    tampered = cli("run", "--resume", str(run_dir))
    assert tampered.returncode == 2 and "record 4" in tampered.stderr, tampered.stderr
    trace.write_bytes(original)
    started = read_trace(trace)[0].event
    repo = git.Repo(started.checkout)
    head = repo.git.rev_parse(started.branch)
    intruder = tmp_path / "intruder"
    repo.git.worktree("add", "--detach", str(intruder), head)
    git.Repo(intruder).git.commit("-q", "--allow-empty", "-m", "sneak", env={
        "GIT_AUTHOR_NAME": "x", "GIT_AUTHOR_EMAIL": "x@x", "GIT_COMMITTER_NAME": "x", "GIT_COMMITTER_EMAIL": "x@x"})
    repo.git.update_ref(f"refs/heads/{started.branch}", git.Repo(intruder).head.commit.hexsha)
    moved = cli("run", "--resume", str(run_dir))
    assert moved.returncode == 2 and "does not account for" in moved.stderr, moved.stderr
    repo.git.update_ref(f"refs/heads/{started.branch}", head)
    repo.git.worktree("remove", "--force", str(intruder))
    lock = lock_run(run_dir)
    for detach in ([], ["--detach"]):
        running = cli("run", "--resume", str(run_dir), *detach)
        assert running.returncode == 2 and "still running" in running.stderr, running.stderr
    lock.close()
    assert trace.read_bytes() == original  # a refused resume writes nothing
    assert harness("resume", str(run_dir)).returncode == 0
    check_finished(run_dir, uninterrupted[1])


@pytest.mark.slow  # a whole uninterrupted run first, then the refused resume: about 50 s
def test_a_resume_refused_at_its_start_leaves_the_run_resumable(task_file, uninterrupted, tmp_path):
    """A resumed start that a check refuses (here a baseline server that fails to start) stops the run, but does
    not end it: it says it can go on, `status` says it stopped, and the next resume goes on with the budget left.
    Each resume counts the leftover servers it really killed."""
    run_dir = start(task_file, tmp_path / "runs", "refused-start", crash="after:parity:3")
    left = len(list(run_dir.glob("servers/*/pid")))
    assert left >= 3  # the reference, the incumbent and candidate 3's server
    refused = harness("resume", str(run_dir), env={"FAKE_CRASH": "baseline-2"})
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert f"the run can go on: nightshift run --resume {run_dir}" in " ".join(refused.stderr.split())
    last = read_trace(run_dir / "trace.jsonl")[-1].event
    assert last.kind == "run_finished" and last.resumable and "SandboxError" in last.reason
    status = cli("status", str(run_dir))
    assert status.returncode == 3 and "stopped" in status.stdout, status.stdout
    assert "can go on" in cli("replay", str(run_dir)).stdout
    again = harness("resume", str(run_dir))
    assert again.returncode == 0, again.stderr[-3000:]
    events = check_finished(run_dir, uninterrupted[1])
    marks = [e for e in events if e.kind == "resumed"]
    assert [m.after_event for m in marks] == ["parity of candidate 3", "run_finished"]
    assert [m.candidate for m in marks] == [3, 3] and marks[1].candidates_done == 2
    assert [m.reaped for m in marks] == [left, 0]  # the refused harness stopped its own servers
    assert not events[-1].resumable


@pytest.mark.slow
def test_resume_detached_returns_at_once_and_the_run_finishes_in_the_background(task_file, uninterrupted, tmp_path):
    # killed as it wrote its end (its kept head audited): nothing left but the end, and no server to start
    run_dir = start(task_file, tmp_path / "runs", "detached", crash="before:run_finished")
    log = run_dir.parent / f"{run_dir.name}.log"
    log.write_text("the killed harness's output\n")
    proc = cli("run", "--resume", str(run_dir), "--detach")
    assert proc.returncode == 0, proc.stderr
    assert f"run {run_dir.name} resumed in the background" in " ".join(proc.stdout.split()), proc.stdout
    deadline = time.monotonic() + 90
    while read_trace(run_dir / "trace.jsonl")[-1].event.kind != "run_finished":
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)
    events = check_finished(run_dir, uninterrupted[1])
    assert [e.finishing for e in events if e.kind == "resumed"] == ["budget: candidates"]
    assert log.read_text().startswith("the killed harness's output\n")  # the resumed run's output goes on after it
    # the background harness lets go of the run when it exits, a moment after it writes its end
    deadline = time.monotonic() + 60
    while True:
        try:
            lock_run(run_dir, claim=False).close()
            break
        except RunLocked:
            assert time.monotonic() < deadline, "the background harness still holds the run a minute after its end"
            time.sleep(0.2)


@pytest.mark.slow
def test_a_candidate_over_its_time_limit_is_a_timeout_and_the_run_goes_on(tmp_path, fake_checkout, fake_model):
    folder = tmp_path / "patches"
    folder.mkdir()
    for name, text in {
        "1-stall.patch": new_file_patch("vllm/fake_mode_1.json", mode("stall"), "never healthy"),
        "2-hang.patch": new_file_patch("vllm/fake_mode_2.json", mode("exact", 0.004, slow_after=8, slow_delay_s=5),
                                       "hangs in the benchmark"),
        "3-fast.patch": new_file_patch("vllm/fake_mode_3.json", mode("exact", 0.004), "faster"),
    }.items():
        (folder / name).write_text(text)
    task = fake_task(fake_checkout, fake_model, folder, budget={"max_candidates": 3, "wall_clock_s": 600,
                                                                "candidate_timeout_s": 10},
                     acceptance={"min_speedup": 1.05, "confidence": 0.95, "confirmations": 0},
                     # 5 pairs, not 3: the trimmed estimator drops a pass slowed by the hung candidate's end (one
                     # such pass among 3 made the fast candidate's interval [0.08, 48] beside other tests)
                     benchmark={"warmup_requests": 2, "repetitions": 5, "request_timeout_s": 30,
                                "max_client_busy": 1.0})
    setup = prepare_run(task, tmp_path / "runs", vllm_version=VERSION)
    loop = Loop(setup, QueueProposer(folder), sandbox=FakeSandbox(setup.run_dir / "servers"))
    began = time.monotonic()
    finished = loop.run()
    decisions = {r.event.candidate: r.event for r in read_trace(setup.run_dir / "trace.jsonl")
                 if r.event.kind == "decision"}
    assert (decisions[1].verdict, decisions[1].stage) == ("timeout", "start"), decisions[1].reason
    assert (decisions[2].verdict, decisions[2].stage) == ("timeout", "benchmark"), decisions[2].reason
    assert "candidate_timeout_s (10 s)" in decisions[2].reason
    assert decisions[3].verdict == "keep" and finished.kept == 1, decisions[3].reason
    assert time.monotonic() - began < 60 and loop.pool.running == [] and leftovers(setup.run_dir) == []
    assert audit(setup.run_dir).decisions == 1


def as_records(events) -> list:
    return [Record(seq=i, time=0.0, prev_sha256="", event=e) for i, e in enumerate(events)]


def test_the_flags_search_restored_from_its_records_goes_on_as_it_would_have():
    config = FlagsConfig(space={"max_num_seqs": [4, 8, 16, 32], "block_size": [16, 32]}, seed=3)
    baseline = {"max_num_seqs": 4, "block_size": 16}
    live, events = FlagsProposer(config, baseline), []

    def ctx(n):
        return ProposalContext(task=None, candidate=n, checkout=Path("."), incumbent_args=dict(baseline))

    for n, speedup in ((1, 1.2), (2, None), (3, 0.9)):
        proposal = live.propose(ctx(n))
        decision = Decision(candidate=n, verdict="discard", stage="decision" if speedup else "start", reason="-",
                            speedup=speedup)
        events += [proposal, decision]
        live.observe(Attempt(proposal, decision))
    in_flight = live.propose(ctx(4))
    restored = FlagsProposer(config, baseline)
    restored.restore(as_records([*events, in_flight]))
    assert restored.tried == live.tried and not restored.recorded
    decision = Decision(candidate=4, verdict="discard", stage="decision", reason="-", speedup=1.01)
    for proposer in (live, restored):
        proposer.observe(Attempt(in_flight, decision))
    assert restored.propose(ctx(5)).engine_args == live.propose(ctx(5)).engine_args
    assert len(restored.study.trials) == len(live.study.trials)


def test_the_queue_restored_from_its_records_goes_on_after_the_proposed_files(tmp_path):
    for name, text in PATCHES.items():
        (tmp_path / name).write_text(text)
    proposer = QueueProposer(tmp_path)
    done = Proposal(candidate=1, proposer="queue", summary="-", meta={"file": "1-fast.patch"})
    proposer.restore(as_records([done]))
    assert [p.name for p in proposer.pending] == ["2-random.patch", "3-faster.patch"]


def test_the_llm_proposer_restored_from_its_records_calls_no_llm_again(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / "vllm" / "v1" / "sample").mkdir(parents=True)
    (checkout / "vllm" / "v1" / "sample" / "sampler.py").write_text("def f(x):\n    return x\n")
    repo = git.Repo.init(checkout)
    repo.git.add("-A")
    repo.git.commit("-qm", "vllm", env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                        "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    task = parse_task({
        "name": "tiny", "target": {"vllm_version": VERSION}, "model": {"synthetic": {"config": "config.json"}},
        "workload": {"num_prompts": 4, "input_len": 8, "output_len": 8},
        "parity": {"num_prompts": 2, "input_len": 8, "max_tokens": 4},
        "edit_surface": {"include": ["vllm/v1/*"]}, "budget": {"max_candidates": 5, "wall_clock_s": 60},
        "proposer": {"kind": "llm", "base_url": "http://127.0.0.1:9", "model": "fake", "profile": False,
                     "repair_turns": 1, "price": {"input_per_mtok": 2.0, "output_per_mtok": 8.0}}})
    answers = ["no edit here", "SUMMARY: add zero\n\nvllm/v1/sample/sampler.py\n<<<<<<< SEARCH\n    return x\n"
                               "=======\n    return x + 0\n>>>>>>> REPLACE\n"]
    live, events = LlmProposer.from_task(task, model=FakeModel(answers)), []

    def record(event):
        events.append(event)
        return ""

    proposal = live.propose(ProposalContext(task=task, candidate=1, checkout=checkout, incumbent_args={},
                                            record=record))
    decision = Decision(candidate=1, verdict="discard", stage="parity", reason="prompt 0 diverges at token 3")
    events += [proposal, decision]
    live.observe(Attempt(proposal, decision))
    silent = FakeModel([])
    restored = LlmProposer.from_task(task, model=silent)
    restored.restore(as_records(events))
    assert silent.calls == 0 and [e.kind for e in events].count("llm_call") == 2
    assert (restored.spend_usd, restored.tokens_used) == (live.spend_usd, live.tokens_used) and live.spend_usd > 0
    assert restored.stats.summary() == live.stats.summary() and restored._seen == live._seen
    assert restored._invalid_log == live._invalid_log
    (convo, attempt), (expected, _) = restored._pending_repair, live._pending_repair
    assert (convo.messages, convo.repairs) == (expected.messages, expected.repairs)  # the answer last in them


def test_what_is_left_of_a_killed_runs_budget():
    from agent.run.resume import Resumption, nothing_left
    from agent.world.task import load_task, with_overrides

    task = with_overrides(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"),
                          budget={"max_candidates": 3, "wall_clock_s": 100, "max_gpu_hours": 0.05},
                          sandbox={"workers": 2, "gpus_per_candidate": 1})
    proposal = Proposal(candidate=3, proposer="queue", summary="in flight")

    def left(decided: int, spent_s: float, in_flight: bool = False) -> str:
        return nothing_left(task, Resumption(event=None, history=[None] * decided, best_speedup=1.0, kept=0,
                                             spent_s=spent_s, redo=[proposal] if in_flight else []))

    assert left(2, 50) == ""
    assert left(2, 50, in_flight=True) == ""
    assert left(3, 50) == "budget: candidates"
    assert left(2, 101, in_flight=True) == "budget: wall clock"  # the candidate in flight is not started again
    assert left(2, 91) == "budget: GPU-hours"  # 2 workers x 91 s > 0.05 GPU-hours (180 s)
