"""`nightshift noise` with fake servers in real processes: repeated A/As and a known slowdown, servers started once."""
import json

import pytest
from typer.testing import CliRunner

from agent.replay.chain import audit
from agent.face.cli import app
from agent.studies.noise_study import study
from agent.run.setup import prepare_run
from tests.fake_sandbox import FakeSandbox
from tests.stand_in import REQUEST_TIMEOUT_S, ROOT, VERSION, fake_task, mode, new_file_patch
from traces import read_trace


pytestmark = pytest.mark.serial  # serial: repeated A/As and a known slowdown measure the host's noise


STUDY_SETTINGS = dict(benchmark={"warmup_requests": 2, "repetitions": 4, "request_timeout_s": REQUEST_TIMEOUT_S,
                                 "max_client_busy": 1.0},
                      acceptance={"min_speedup": 1.3, "confidence": 0.95, "confirmations": 0})
"""The studies' fake task: 4 pairs a benchmark, stand-ins' effects many times their noise."""


def dead_code_patch(folder):
    (folder / "dead-code.patch").write_text(new_file_patch("vllm/never_imported.py", "X = 1\n",
                                                           "a module no server imports"))


@pytest.fixture
def setup(tmp_path, fake_checkout, fake_model):
    (tmp_path / "slow-4x.patch").write_text(new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.04),
                                                           "four times the time per token"))
    dead_code_patch(tmp_path)
    task = fake_task(fake_checkout, fake_model, tmp_path, **STUDY_SETTINGS)
    return prepare_run(task, tmp_path / "runs", run_id=f"noise-{tmp_path.name}"[:60], vllm_version=VERSION)


@pytest.mark.slow
def test_a_a_benchmarks_and_a_known_slowdown_on_servers_started_once(setup, tmp_path):
    slow, dead = tmp_path / "slow-4x.patch", tmp_path / "dead-code.patch"  # written before the preflight
    sandbox = FakeSandbox(tmp_path / "servers")
    lines = []
    data = study(setup, 3, [slow, dead], 2, sandbox=sandbox, on_line=lines.append)
    names = ["baseline", "baseline-aa", "dead-code", "reference", "slow-4x"]  # the audit's reference: neither side
    assert sorted(spec.name for spec in sandbox.started) == names and sorted(sandbox.stops) == names  # side by side
    assert data["summary"]["patches"]["dead-code"]["never_imported"] == ["vllm/never_imported.py"]
    aa, patch = data["summary"]["a_a"], data["summary"]["patches"]["slow-4x"]
    assert [r["label"] for r in data["benchmarks"]] == ["A/A"] * 3 + ["slow-4x"] * 2 + ["dead-code"] * 2
    assert len(lines) == 7
    assert all(0.75 < s < 1.33 for s in aa["speedups"]) and aa["false_accepts"] == 0
    assert aa["benchmarks"] == 3 and aa["pooled_log_ratio_sd"] > 0 and aa["mde_speedup"] > 1.0
    assert patch["direction"] == "slower" and patch["detected"] == 2 and patch["accepted"] == 0
    assert all(0.1 < s < 0.5 for s in patch["speedups"])
    assert patch["never_imported"] == []  # the fake server reads its mode file; a .py never imported would be named
    for row in data["benchmarks"][:5]:
        assert row["pairs"] == 4 and len(row["samples"]) == 8
        assert [s["role"] for s in row["samples"]] == ["incumbent", "candidate", "candidate", "incumbent"] * 2
    kinds = [r.event.kind for r in read_trace(setup.run_dir / "trace.jsonl")]
    # the run's audit A/A, then each A/A benchmark audited beside its noise row, then the patches' audits
    assert kinds == ["run_started", "audit"] + ["audit", "noise_floor"] * 3 + ["audit"] * 4 + ["run_finished"]
    assert aa["audit"]["benchmarks"] == 3 and aa["audit"]["false_rejects"] == 0
    assert audit(setup.run_dir).commits == 0  # the study's trace is a hash chain replay accepts
    text = (setup.run_dir / "noise.md").read_text()
    assert "A/A: 3 benchmarks, 0 false accepts" in text and "slow-4x: mean" in text and "detected slower in 2 of 2" in text
    assert "NEVER IMPORTED: ['vllm/never_imported.py']" in text
    assert json.loads((setup.run_dir / "noise.json").read_text())["summary"] == data["summary"]


@pytest.mark.slow
def test_a_known_slowdown_both_ways_is_a_known_speedup_the_other_way_round(setup, tmp_path):
    """--both-ways: each patch is also benchmarked with its server as the incumbent and the baseline's copy as the
    candidate, alternately with the forward direction: a 4x slowdown is then a 4x speedup, detected and accepted."""
    sandbox = FakeSandbox(tmp_path / "servers")
    data = study(setup, 2, [tmp_path / "slow-4x.patch"], 2, sandbox=sandbox, on_line=lambda line: None, both_ways=True)
    assert [r["label"] for r in data["benchmarks"]] == ["A/A"] * 2 + ["slow-4x", "slow-4x reversed"] * 2
    forward, reverse = data["summary"]["patches"]["slow-4x"], data["summary"]["patches"]["slow-4x reversed"]
    assert forward["direction"] == "slower" and forward["detected"] == 2 and forward["accepted"] == 0
    assert reverse["direction"] == "faster" and reverse["detected"] == 2 and reverse["accepted"] == 2
    assert all(2 < s < 10 for s in reverse["speedups"]), reverse
    assert "slow-4x reversed: mean" in (setup.run_dir / "noise.md").read_text()


@pytest.mark.slow
def test_a_study_stopped_by_sigterm_writes_the_benchmarks_it_has(setup, tmp_path):
    """`nightshift noise` had no SIGTERM handler, so a stopped study died before writing noise.json and lost every
    benchmark it had measured; it now takes the run's handler (`_terminate`, installed here as the command does):
    the study writes what it has, and its trace reads as a stop, not an error."""
    import os
    import signal

    from agent.face.cli import _terminate
    from traces.log import taken

    lines = []

    def stop_at_the_second(line):
        lines.append(line)
        if len(lines) == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        with pytest.raises(SystemExit) as stopped:
            study(setup, 4, [], 1, sandbox=FakeSandbox(tmp_path / "servers"), on_line=stop_at_the_second)
    finally:
        signal.signal(signal.SIGTERM, previous)
    taken(stopped.value)  # the stop is delivered: no later test has it raised again
    assert stopped.value.code == 128 + signal.SIGTERM and len(lines) == 2
    data = json.loads((setup.run_dir / "noise.json").read_text())
    assert [r["label"] for r in data["benchmarks"]] == ["A/A", "A/A"] and data["summary"]["a_a"]["benchmarks"] == 2
    last = list(read_trace(setup.run_dir / "trace.jsonl"))[-1].event
    assert last.kind == "run_finished" and last.reason == "stopped by SIGTERM"


@pytest.mark.slow
def test_the_noise_command_stopped_by_sigterm_writes_what_it_has_and_stops_its_servers(fake_checkout, fake_model,
                                                                                        tmp_path):
    """The command in its own process (its code path after the options, on fake servers: tests/resume_driver.py),
    stopped as a user's shell or a spot host stops it: SIGTERM after the first A/A. It exits 143, noise.json holds
    the A/As it measured, the trace ends as a stop, and no server is left."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "patches").mkdir()
    dead_code_patch(tmp_path / "patches")
    task = fake_task(fake_checkout, fake_model, tmp_path / "patches", **STUDY_SETTINGS)
    (tmp_path / "task.json").write_text(task.model_dump_json())
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "tests.resume_driver", "noise", str(tmp_path / "task.json"),
                             str(runs), "noise-termed", "6"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not [t for t in runs.glob("noise-*/trace.jsonl") if b'"kind":"noise_floor"' in t.read_bytes()]:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    [run_dir] = runs.glob("noise-*")
    data = json.loads((run_dir / "noise.json").read_text())
    assert 1 <= len(data["benchmarks"]) < 6 and {r["label"] for r in data["benchmarks"]} == {"A/A"}
    last = list(read_trace(run_dir / "trace.jsonl"))[-1].event
    assert last.kind == "run_finished" and last.reason == "stopped by SIGTERM"
    assert not list(run_dir.glob("servers/*/pid"))  # it stopped its own servers


@pytest.mark.parametrize("argv, message", [
    (["--aa", "1"], "at least 2 A/A benchmarks"),
    (["--aa", "2", "--patch", "no-such.patch"], "patch file not found: no-such.patch"),
    (["--aa", "-1"], "counts must be positive"),
])
def test_bad_study_options_are_one_clear_line(argv, message, tmp_path):
    result = CliRunner().invoke(app, ["noise", *argv, "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_servers_that_rank_near_ties_each_their_own_way_pass_the_studys_audit(fake_model, tmp_path):
    """On an H100 (benchmarks/results/h100-noise-20261207.md) both A/As of a study failed their token audit: the
    study scored every output on its first server, so that server's own outputs (the control) left its top-1 at
    1,458 of 65,536 tokens and the second copy's at 2,582. GPU servers of one build pick kernels of their own at
    start, so each scores its own outputs closest. These stand-ins do the same (`process_flips`: at half of the near
    ties each process ranks the two tokens its own way). A reference that is neither side, as in a run, passes them;
    the first side as the reference (the old way, shown on the recorded audits) does not."""
    from agent.stages.token_audit import judge
    from tests.stand_in import stand_in_checkout
    from traces.schema import TokenAudit

    checkout = stand_in_checkout(tmp_path / "seated", {"vllm/fake_mode.json": mode("exact", 0.01, process_flips=0.5)})
    dead_code_patch(tmp_path)  # the task's queue folder needs a patch; the study runs A/As only
    task = fake_task(checkout, fake_model, tmp_path, **STUDY_SETTINGS)
    setup = prepare_run(task, tmp_path / "runs", run_id=f"kernels-{tmp_path.name}"[:60], vllm_version=VERSION)
    sandbox = FakeSandbox(tmp_path / "servers")
    data = study(setup, 2, [], 1, sandbox=sandbox, on_line=print)
    assert sorted(spec.name for spec in sandbox.started) == ["baseline", "baseline-aa", "reference"]
    audits = [r.event for r in read_trace(setup.run_dir / "trace.jsonl") if isinstance(r.event, TokenAudit)]
    calibration, rows = audits[0], audits[1:]
    assert len(rows) == 2 and data["summary"]["a_a"]["audit"]["false_rejects"] == 0, [a.verdict for a in rows]
    for a in rows:  # both sides scored on the reference leave its top-1 alike, and often (the kernels differ)
        assert a.side.non_top1 > 0.05 * a.side.tokens and a.control.non_top1 > 0.05 * a.control.tokens
        assert 0.5 < a.side.non_top1 / a.control.non_top1 < 2
    # The adversary of this test: a study that scores on its first side. That side's own outputs (the control and
    # the study's audit A/A), scored by itself, never leave its top-1 here; the same honest A/A then fails.
    def self_scored(side):
        return side.model_copy(update={"non_top1": 0, "per_request": [0] * side.requests, "values": []})
    a = task.audit
    verdict = judge(rows[0].side, self_scored(rows[0].control), self_scored(calibration.side),
                    a.hard_bound_nats, a.rate_ratio, task.acceptance.confidence)
    assert not verdict.passed and verdict.test == "rate", verdict


@pytest.mark.slow
def test_a_benchmark_not_counted_keeps_the_samples_the_rule_read(fake_model, tmp_path):
    """Beside the test suite an A/A was found 'moved by code' (5 of the candidate's 40 passes over max_num_seqs 4,
    2 of the incumbent's) and the study wrote only the reason: what the passes read could not be looked at. A
    benchmark not counted now keeps its samples, here a server that holds 16 sequences whatever max_num_seqs says."""
    from tests.stand_in import stand_in_checkout

    checkout = stand_in_checkout(tmp_path / "seated", {"vllm/fake_mode.json": mode("exact", 0.01, max_seqs=4)})
    (tmp_path / "moved.patch").write_text(new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.01, max_seqs=16),
                                                         "hold 16 sequences whatever max_num_seqs says"))
    task = fake_task(checkout, fake_model, tmp_path, workload={"num_prompts": 16, "input_len": 16, "output_len": 32},
                     **STUDY_SETTINGS)
    setup = prepare_run(task, tmp_path / "runs", run_id=f"moved-{tmp_path.name}"[:60], vllm_version=VERSION)
    data = study(setup, 0, [tmp_path / "moved.patch"], 1, sandbox=FakeSandbox(tmp_path / "servers"), on_line=print)
    [row] = data["benchmarks"]
    assert "moved by code" in row["not_counted"]
    seen = {r: [x["decoding_at_once"] for x in row["samples"] if x["role"] == r] for r in ("incumbent", "candidate")}
    assert len(seen["candidate"]) == len(seen["incumbent"]) >= 4 and max(seen["candidate"]) > 8
    assert max(seen["incumbent"]) <= 6, seen


def test_a_benchmark_the_rules_do_not_count_is_recorded_apart_and_the_study_goes_on():
    """Beside the test suite an A/A-like benchmark was found 'moved by code' (since mended: passes delivered in a
    burst) and the whole study stopped with a traceback, its other benchmarks unwritten. Such a benchmark is now a
    row of its own, counted apart and left out of the speedups and the spread."""
    from pathlib import Path

    from agent.studies.noise_study import markdown, summarize
    from agent.world.task import load_task

    task = load_task(Path(__file__).resolve().parents[2] / "tasks" / "gemma4-tiny-cpu.yaml")

    def row(label, index, speedup):
        return {"label": label, "index": index, "pairs": 8, "speedup": speedup, "ci_low": speedup - 0.02,
                "ci_high": speedup + 0.02, "accepted": False, "slower": False, "faster": False, "log_ratio_sd": 0.05}

    rows = [row("A/A", 0, 1.0), {"label": "A/A", "index": 1, "accepted": False, "not_counted": "moved by code"},
            row("step", 0, 0.95), {"label": "step", "index": 1, "accepted": False, "not_counted": "idle work"}]
    summary = summarize(task, rows, ["step"])
    assert summary["a_a"]["benchmarks"] == 1 and summary["a_a"]["not_counted"] == 1
    assert summary["a_a"]["pooled_log_ratio_sd"] == pytest.approx(0.05)
    assert summary["patches"]["step"]["benchmarks"] == 1 and summary["patches"]["step"]["not_counted"] == 1
    text = markdown({"run_id": "r", "task": task.name, "environment": {"gpu": "cpu", "vllm": "0.32.0"},
                     "metric": "total_tokens_per_s", "min_speedup": 1.02, "confidence": 0.95, "summary": summary,
                     "benchmarks": rows})
    assert "| A/A #1 | not counted: moved by code |" in text and "1 not counted" in text
