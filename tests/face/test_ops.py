"""`nightshift status` and `nightshift pack` on a real run folder: a trace of schema events against a
real git checkout whose run branch holds a real commit with its trace trailer."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from agent.face.cli import app
from agent.face.ops import pack_run
from agent.world.task import load_task, with_overrides
from agent.run.workspace import Workspace
from traces import TraceWriter
from agent.stages.stats import estimate_speedup
from traces.schema import (BenchReport, Commit, Decision, ParityReport, PatchApplied, Proposal, RunFinished,
                           RunStarted, Sample, SelfParity)

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "20261201-010203-abcd"
PATCH = ("diff --git a/vllm/fast.py b/vllm/fast.py\nnew file mode 100644\n--- /dev/null\n+++ b/vllm/fast.py\n"
         "@@ -0,0 +1 @@\n+FAST = True\n")
cli = CliRunner()


class Run:
    """A run folder written the way the loop writes one, stopped after candidate 2's parity."""

    def __init__(self, tmp_path: Path):
        self.checkout = tmp_path / "checkout"
        (self.checkout / "vllm").mkdir(parents=True)
        (self.checkout / "vllm" / "__init__.py").write_text("VERSION = '0.32.0'\n")
        self.repo = git.Repo.init(self.checkout, initial_branch="main")
        self.repo.git.add("-A")
        self.repo.git.commit("-q", "-m", "vLLM 0.32.0", env=author())
        self.repo.create_tag("v0.32.0")
        self.dir = tmp_path / "runs" / RUN_ID
        self.dir.mkdir(parents=True)
        self.workspace = Workspace(self.repo, RUN_ID, self.dir / "worktrees")
        base = self.workspace.create_branch("v0.32.0")
        task = with_overrides(load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml"),
                              budget={"max_candidates": 5, "wall_clock_s": 3600},
                              acceptance={"min_speedup": 1.05, "confirmations": 0}, audit={"enabled": False})
        (self.dir / "task.json").write_text(task.model_dump_json(indent=2))
        log = self.dir / "servers" / "reference" / "server.log"
        log.parent.mkdir(parents=True)
        log.write_text("".join(f"line {i}\n" for i in range(1, 501)))
        self.trace = TraceWriter(self.dir / "trace.jsonl")
        self.trace.append(RunStarted(
            run_id=RUN_ID, nightshift_version="0.1.0", vllm_version="0.32.0", torch_version="2", python_version="3",
            platform="linux", checkout=str(self.checkout), base_commit=base, branch=self.workspace.branch,
            model_sha256="0" * 64, task=task.model_dump(mode="json")))
        self.trace.append(SelfParity(ok=True, prompts=4, identical=4, regime="sequential"))
        self.keep(1)
        self.trace.append(Proposal(candidate=2, proposer="flags", summary="max_num_seqs=8",
                                   engine_args={"max_num_seqs": 8}))
        self.trace.append(ParityReport(candidate=2, ok=True, regime="sequential", prompts=4, tokens_per_prompt=8,
                                       digest="d" * 64))

    def keep(self, n: int) -> None:
        self.trace.append(Proposal(candidate=n, proposer="queue", summary="a faster module", patch=PATCH))
        worktree = self.workspace.worktree(f"candidate-{n}")
        files = self.workspace.apply(worktree, PATCH)
        self.trace.append(PatchApplied(candidate=n, worktree=str(worktree), parent_commit=self.workspace.head(),
                                       files=files, engine_args={}))
        decision = self.trace.append(self.benchmark(n, [1.2, 1.25, 1.15], "keep"))
        sha = self.workspace.commit(worktree, {}, f"nightshift: a faster module\n\nNightshift-Trace-Event: {decision}\n")
        self.trace.append(Commit(candidate=n, branch=self.workspace.branch, commit=sha, decision_sha256=decision))

    def benchmark(self, n: int, ratios: list[float], verdict: str) -> Decision:
        """A benchmark whose samples give these paired ratios, and the decision that follows from it."""
        samples = [Sample(role=role, repetition=i, seconds=1.0, input_tokens=100, output_tokens=100,
                          total_tokens_per_s=rate, output_tokens_per_s=rate / 2)
                   for i, ratio in enumerate(ratios) for role, rate in (("incumbent", 1000.0), ("candidate", 1000 * ratio))]
        e = estimate_speedup([1000 * r for r in ratios], [1000.0] * len(ratios), 1.05, 0.95)
        self.trace.append(BenchReport(candidate=n, metric="total_tokens_per_s", samples=samples, speedup=e.speedup,
                                      ci_low=e.ci_low, ci_high=e.ci_high, confidence=0.95, p_value=e.p_value,
                                      output_check="every request returned exactly 32 tokens"))
        return Decision(candidate=n, verdict=verdict, stage="decision", reason=verdict, speedup=e.speedup,
                        ci_low=e.ci_low, ci_high=e.ci_high)

    def finish(self) -> None:
        self.trace.append(self.benchmark(2, [1.0, 1.1, 0.9], "discard"))
        self.trace.append(RunFinished(reason="budget: wall clock", candidates=2, kept=1, best_speedup=1.2,
                                      head_commit=self.workspace.head(), seconds=120.0))
        self.trace.close()


def author() -> dict:
    return {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


@pytest.fixture
def run(tmp_path) -> Run:
    return Run(tmp_path)


def unpack(pack: Path, where: Path) -> Path:
    with tarfile.open(pack) as tar:
        tar.extractall(where, filter="data")
    return where / RUN_ID


def replay(folder: Path) -> subprocess.CompletedProcess:
    """A real `nightshift replay`, from a folder with no checkout in sight."""
    return subprocess.run([sys.executable, "-m", "agent.face.cli", "replay", str(folder)], cwd=folder.parent,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                                                               "HOME": str(folder.parent), "COLUMNS": "200"})


def test_status_of_a_running_run_shows_its_stage_and_exits_3(run):
    result = cli.invoke(app, ["status", str(run.dir)], env={"COLUMNS": "120"})
    assert result.exit_code == 3, result.output
    assert "running: benchmarking (candidate 2)" in result.output
    assert "parity (candidate 2)" in result.output
    assert "1 evaluated, 1 kept" in result.output and "1.199x" in result.output
    assert "4 candidate(s)" in result.output


def test_status_json_counts_the_budget(run):
    result = cli.invoke(app, ["status", RUN_ID, "--runs-dir", str(run.dir.parent), "--json"])
    assert result.exit_code == 3, result.output
    status = json.loads(result.output)
    assert (status["evaluated"], status["kept"], status["candidates_left"]) == (1, 1, 4)
    assert status["last_event"] == "parity" and status["candidate"] == 2 and not status["finished"]
    assert 3590 < status["wall_clock_left_s"] <= 3600


def test_status_ignores_a_torn_last_line(run):
    with open(run.dir / "trace.jsonl", "ab") as f:
        f.write(b'{"sha256":"0123456789abcdef","seq":8,"time":17')
    result = cli.invoke(app, ["status", str(run.dir), "--json"])
    assert result.exit_code == 3, result.output
    status = json.loads(result.output)
    assert status["torn_last_line"] and status["records"] == 9 and status["last_event"] == "parity"


def test_status_of_a_finished_run_exits_0(run):
    run.finish()
    result = cli.invoke(app, ["status", str(run.dir)], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "finished: budget: wall clock" in result.output and "2 evaluated, 1 kept" in result.output
    assert "58m00s" in result.output  # 3600 s of wall clock less the 120 s the run took


def test_status_names_a_run_whose_process_is_gone(run):
    gone = subprocess.Popen(["true"])
    gone.wait()
    (run.dir / "servers" / "reference" / "owner").write_text(str(gone.pid))
    result = cli.invoke(app, ["status", str(run.dir)], env={"COLUMNS": "200"})
    assert result.exit_code == 3, result.output
    assert f"stopped: the run's process (pid {gone.pid}) is gone" in result.output
    (run.dir / "servers" / "reference" / "owner").write_text(str(os.getpid()))
    assert "running: benchmarking" in cli.invoke(app, ["status", str(run.dir)], env={"COLUMNS": "200"}).output


def test_status_of_a_broken_trace_fails(run):
    data = (run.dir / "trace.jsonl").read_bytes()
    (run.dir / "trace.jsonl").write_bytes(data.replace(b'"summary":"a faster module"', b'"summary":"a faster modulE"'))
    result = cli.invoke(app, ["status", str(run.dir)])
    assert result.exit_code == 1 and "record hash mismatch" in result.output


def test_pack_replays_on_a_host_without_the_checkout(run, tmp_path):
    run.finish()
    (run.dir.parent / f"{RUN_ID}.log").write_text("run started in the background\nfinished\n")
    result = cli.invoke(app, ["pack", str(run.dir), str(tmp_path / "run.tgz")])
    assert result.exit_code == 0, result.output
    folder = unpack(tmp_path / "run.tgz", tmp_path / "elsewhere")
    shutil.rmtree(run.checkout)
    shutil.rmtree(run.dir)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["branch"] == f"nightshift/{RUN_ID}" and manifest["finished"]
    assert {"trace.jsonl", "task.json", "branch.bundle", "servers/reference/server.log.head",
            "servers/reference/server.log.tail"} <= set(manifest["files"])
    head = (folder / "servers/reference/server.log.head").read_text().splitlines()
    tail = (folder / "servers/reference/server.log.tail").read_text().splitlines()
    assert (len(head), head[0], len(tail), tail[0], tail[-1]) == (200, "line 1", 200, "line 301", "line 500")
    assert manifest["log_lines"] == {"servers/reference/server.log": 500, "nightshift.log": 2}
    assert (folder / "nightshift.log.head").read_text() == "run started in the background\nfinished\n"
    assert not (folder / "nightshift.log.tail").read_text()
    done = replay(folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "audit ok" in done.stdout and "1 commit(s)" in done.stdout
    clone = git.Repo.clone_from(str(folder / "branch.bundle"), tmp_path / "clone", branch=f"nightshift/{RUN_ID}")
    assert (tmp_path / "clone" / "vllm" / "fast.py").read_text() == "FAST = True\n"
    assert clone.git.rev_parse("HEAD") == manifest["head_commit"]


def test_pack_of_a_live_run_keeps_the_complete_lines(run, tmp_path):
    with open(run.dir / "trace.jsonl", "ab") as f:
        f.write(b'{"sha256":"01234')
    manifest = pack_run(run.dir, tmp_path / "live.tgz")
    assert manifest["records"] == 9 and not manifest["finished"]
    folder = unpack(tmp_path / "live.tgz", tmp_path / "elsewhere")
    assert (folder / "trace.jsonl").read_bytes().endswith(b"}\n")
    shutil.rmtree(run.checkout)
    done = replay(folder)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "audit ok" in done.stdout and "did not finish" in done.stdout


def packed_and_unpacked(run, tmp_path) -> Path:
    """The finished run, packed and unpacked in a folder of its own."""
    run.finish()
    pack_run(run.dir, tmp_path / "run.tgz")
    return unpack(tmp_path / "run.tgz", tmp_path / "elsewhere")


def test_replay_refuses_a_bundle_with_an_extra_commit(run, tmp_path):
    folder = packed_and_unpacked(run, tmp_path)
    branch = f"nightshift/{RUN_ID}"
    clone = git.Repo.clone_from(str(folder / "branch.bundle"), tmp_path / "clone", branch=branch)
    (tmp_path / "clone" / "vllm" / "fast.py").write_text("FAST = 'sneaky'\n")
    clone.git.commit("-q", "-am", "not judged", env=author())
    (folder / "branch.bundle").unlink()
    clone.git.bundle("create", str(folder / "branch.bundle"), branch)
    shutil.rmtree(run.checkout)
    done = replay(folder)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "audit failed" in done.stdout and "does not account for" in done.stdout


def test_replay_refuses_a_changed_trace_byte(run, tmp_path):
    folder = packed_and_unpacked(run, tmp_path)
    trace = folder / "trace.jsonl"
    trace.write_bytes(trace.read_bytes().replace(b'"summary":"a faster module"', b'"summary":"a slower module"', 1))
    shutil.rmtree(run.checkout)
    done = replay(folder)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "audit failed" in done.stdout and "record hash mismatch" in done.stdout


def test_pack_needs_the_checkout(run, tmp_path):
    shutil.rmtree(run.checkout)
    result = cli.invoke(app, ["pack", str(run.dir), str(tmp_path / "run.tgz")])
    assert result.exit_code == 2 and "cannot read branch" in result.output
    assert not (tmp_path / "run.tgz").exists()


def test_replay_names_a_corrupt_bundle(run, tmp_path):
    folder = packed_and_unpacked(run, tmp_path)
    bundle = folder / "branch.bundle"
    bundle.write_bytes(bundle.read_bytes()[:-200])
    shutil.rmtree(run.checkout)
    done = replay(folder)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot read branch" in done.stderr and "branch.bundle" in done.stderr
