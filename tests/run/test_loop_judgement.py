"""The loop's judgement, with fake servers in real processes: what it keeps and what it refuses.

No vLLM or torch is needed: the checkout is a real git repo of a pure-Python stand-in, and the servers
are tests/fake_vllm.py processes (a causal stand-in model on loopback)."""
import json
import re
from pathlib import Path

import git
import pytest

from agent.stages import bench
from agent.replay.chain import audit
from agent.replay.evidence import check_decisions
from agent.run.baseline import AuditNotCalibrated, SetupNotDeterministic
from agent.run.judge import Judge
from agent.run.worker import Worker
from agent.stages.parity import ReferenceFailed
from agent.face.report import write_summary
from agent.world.task import load_task
from tests.stand_in import REQUEST_TIMEOUT_S, decisions, mode, new_file_patch, stopped_once
from traces import TraceError, read_trace

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.32.0"


pytestmark = pytest.mark.paced  # paced: speedup intervals of fake servers many times their noise; the idle-work
# check counts CPU seconds and is serial


@pytest.mark.slow
def test_each_candidate_is_judged_at_the_right_stage(run):
    setup, loop = run({
        "1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.0025), "faster, same tokens"),
        "2-short.patch": new_file_patch("vllm/fake_mode_2.json", mode("short", 0.0025), "does less work under load"),
        "3-random.patch": new_file_patch("vllm/fake_mode_3.json", mode("random"), "different tokens"),
        "4-crash.patch": new_file_patch("vllm/fake_mode_4.json", mode("crash"), "crashes at start"),
        "5-syntax.patch": new_file_patch("vllm/broken.py", "def broken(:\n", "syntax error"),
        "6-dead.patch": new_file_patch("vllm/unused_helper.py", "VALUE = 1\n", "never imported"),
        "7-outside.patch": new_file_patch("vllm/entrypoints/x.py", "X = 1\n", "outside the surface"),
        "8-garbage.patch": "Subject: does not apply\n\n--- a/vllm/nope.py\n+++ b/vllm/nope.py\n@@ -1 +1 @@\n-a\n+b\n",
        "9-hang.patch": new_file_patch("vllm/fake_mode_9.json", mode("hang"), "never answers"),
        # 5 pairs, up to 12 where the sequential rule has not decided: one stall of a loaded machine made the 4x
        # faster candidate's confirmation 1.87x [0.58, 6.06] at 5 pairs
        # the hanging one is caught by the request timeout at parity: it costs that timeout, so 20 s here
    }, benchmark={"warmup_requests": 2, "repetitions": 5, "max_repetitions": 12, "request_timeout_s": 20,
                  "max_client_busy": 1.0})
    finished = loop.run()
    got = decisions(setup)
    assert (got[1].verdict, got[1].stage) == ("keep", "decision"), got[1].reason
    assert got[1].ci_low > 1.05
    assert (got[2].verdict, got[2].stage) == ("discard", "benchmark")
    assert "did not return exactly 16 tokens" in got[2].reason
    assert (got[3].verdict, got[3].stage) == ("discard", "parity") and "diverges at token" in got[3].reason
    assert (got[4].verdict, got[4].stage) == ("crash", "start")
    assert (got[5].verdict, got[5].stage) == ("discard", "build") and "does not compile" in got[5].reason
    assert (got[6].verdict, got[6].stage) == ("discard", "liveness") and "unused_helper.py" in got[6].reason
    assert (got[7].verdict, got[7].stage) == ("discard", "surface")
    assert (got[8].verdict, got[8].stage) == ("discard", "apply")
    assert (got[9].verdict, got[9].stage) == ("crash", "parity") and "failed to answer" in got[9].reason
    assert finished.kept == 1 and finished.candidates == 9
    assert audit(setup.run_dir).commits == 1
    self_parity = next(r.event for r in read_trace(setup.run_dir / "trace.jsonl") if r.event.kind == "self_parity")
    margins = self_parity.margins  # the fake server's margins are spread over [0, 2) nats
    assert margins["positions"] == 16 * 8 and 0.5 < margins["median"] < 1.5 and margins["p10"] < margins["p90"]
    assert self_parity.margins_error == ""
    write_summary(setup.run_dir)
    assert json.loads((setup.run_dir / "summary.json").read_text())["self_parity"]["margins"] == margins
    assert loop.pool.running == [] and stopped_once(loop)


def test_a_candidate_exact_alone_and_wrong_in_batches_is_rejected_at_the_audit(run):
    """Parity sends one request at a time, so it sees only correct tokens; under the benchmark's load the
    candidate returns the right number of wrong tokens, faster. The audit of the benchmark's own outputs
    rejects it, naming the pass, request, position and tokens."""
    setup, loop = run({
        "1-batched.patch": new_file_patch("vllm/fake_mode_1.json", mode("batched", 0.0025), "fast, wrong in batches"),
    })
    finished = loop.run()
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("discard", "audit"), decision.reason
    records = [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]
    parity = next(e for e in records if e.kind == "parity" and e.candidate == 1)
    bench = next(e for e in records if e.kind == "benchmark" and e.candidate == 1)
    assert parity.ok and bench.ci_low > 1.05  # it passed parity and was measured faster
    token_audit = next(e for e in records if e.kind == "audit" and e.candidate == 1)
    assert token_audit.requests == 8 * 8 and token_audit.tokens == 8 * 8 * 16
    assert token_audit.violation_count > 0 and token_audit.deficits.max == pytest.approx(8.0)
    v = token_audit.violations[0]
    assert f"pass {v.repetition}, request {v.request}, position {v.position}: returned {v.returned}" in decision.reason
    assert "8.000 nats below" in decision.reason
    assert not [e for e in records if e.kind == "benchmark" and e.confirmation == 1]  # no confirmation spent
    assert finished.kept == 0 and audit(setup.run_dir).commits == 0
    calibration = next(e for e in records if e.kind == "audit" and e.calibration)
    assert calibration.violation_count == 0 and calibration.tokens == token_audit.tokens  # the A/A is as large
    assert token_audit.verdict.test == "hard_bound" and token_audit.control.non_top1 == 0


@pytest.mark.slow
def test_near_tie_flips_where_honest_numerics_flip_none_are_rejected_by_rate(run):
    """The baseline here is exact under load (its A/A and every control: no token off the top-1); a faster
    candidate that flips near-ties under load (deficits under 0.1 nats, far inside the hard bound) leaves the
    top-1 far more often than anything honest measured in this run: rejected at the audit by the rate test.
    (tests/stages/test_audit_rule.py keeps honest candidates whose noise matches a noisy machine's.)"""
    setup, loop = run({
        "1-neartie.patch": new_file_patch("vllm/fake_mode_1.json", mode("neartie", 0.0025, near_tie=0.1),
                                          "faster, flips near-ties in batches"),
    }, benchmark={"warmup_requests": 2, "repetitions": 8, "request_timeout_s": REQUEST_TIMEOUT_S, "max_client_busy": 1.0})
    finished = loop.run()
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("discard", "audit"), decision.reason
    token_audit = next(r.event for r in read_trace(setup.run_dir / "trace.jsonl") if r.event.kind == "audit"
                       and r.event.candidate == 1)
    assert token_audit.violation_count == 0 and 0 < token_audit.deficits.non_top1 and token_audit.deficits.max < 0.1
    assert token_audit.verdict.test == "rate" and token_audit.control.non_top1 == 0
    assert "more than 2x the control's 0 of" in decision.reason
    assert finished.kept == 0 and audit(setup.run_dir).commits == 0


@pytest.mark.slow
def test_a_change_close_to_exact_fails_the_cpu_tasks_parity_and_an_exact_one_passes_it(run):
    """Both ways, at the CPU task's own parity size (64 prompts of 16 tokens, one at a time). The fooling
    candidate is faster and right except at 1% of positions (margins under 0.02 nats), alone or batched, as a
    kernel that sums in another order is: it changes about 15% of 16-token outputs, so 8 prompts would pass
    it 27% of the time and 64 prompts 0.003%. The honest candidate after it is exact and faster: kept."""
    cpu = load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml").parity
    changed = 1 - 0.99 ** cpu.max_tokens
    assert (1 - changed) ** cpu.num_prompts < 1e-4 and (1 - changed) ** 8 > 0.25
    setup, loop = run({
        "1-reordered.patch": new_file_patch("vllm/fake_mode_1.json", mode("reordered", 0.0025, near_tie=0.02),
                                            "faster, sums in another order"),
        "2-fast.patch": new_file_patch("vllm/fake_mode_2.json", mode("exact", 0.0025), "faster, same tokens"),
    }, parity={"num_prompts": cpu.num_prompts, "input_len": cpu.input_len, "max_tokens": cpu.max_tokens,
               "regime": cpu.regime},
        benchmark={"warmup_requests": 2, "repetitions": 5, "max_repetitions": 12, "request_timeout_s": REQUEST_TIMEOUT_S,
                   "max_client_busy": 1.0})
    finished = loop.run()
    got = decisions(setup)
    assert (got[1].verdict, got[1].stage) == ("discard", "parity") and "diverges at token" in got[1].reason
    assert (got[2].verdict, got[2].stage) == ("keep", "decision"), got[2].reason
    parity = [r.event for r in read_trace(setup.run_dir / "trace.jsonl") if r.event.kind == "parity"]
    assert [p.prompts for p in parity] == [64, 64] and parity[1].ok
    assert finished.kept == 1


def test_a_reference_that_dies_during_the_audit_stops_the_run_and_blames_no_one(run, monkeypatch):
    setup, loop = run({
        "1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.0025), "faster"),
    })
    original = Judge.audit

    def audit_after_the_reference_died(judge, n, outputs, confirmation=0, control=None):  # a candidate's audit
        judge.reference.process.kill()
        judge.reference.process.wait()
        return original(judge, n, outputs, confirmation, control)

    monkeypatch.setattr(Judge, "audit", audit_after_the_reference_died)
    with pytest.raises(ReferenceFailed, match="failed while auditing tokens"):
        loop.run()
    kinds = [r.event.kind for r in read_trace(setup.run_dir / "trace.jsonl")]
    assert "benchmark" in kinds and "decision" not in kinds and kinds[-1] == "run_finished"
    assert loop.pool.running == [] and stopped_once(loop)


def test_a_baseline_that_fails_its_own_audit_refuses_to_start(run):
    setup, loop = run({"1.patch": new_file_patch("vllm/a.py", "A = 1\n", "x")})
    original = setup.baseline_tree

    def flipping_baseline():
        tree = original()
        (tree / "vllm" / "fake_mode.json").write_text(mode("neartie", near_tie=2.0))
        return tree

    setup.baseline_tree = flipping_baseline
    with pytest.raises(AuditNotCalibrated, match="baseline's own outputs under the benchmark load fail the token"):
        loop.run()
    kinds = [r.event.kind for r in read_trace(setup.run_dir / "trace.jsonl")]
    assert kinds == ["run_started", "self_parity", "audit", "run_finished"]
    assert loop.pool.running == [] and stopped_once(loop)


def test_a_nondeterministic_setup_refuses_to_start(run):
    setup, loop = run({"1.patch": new_file_patch("vllm/a.py", "A = 1\n", "x")})
    (setup.workspace.worktrees).mkdir(parents=True, exist_ok=True)
    original = setup.baseline_tree

    def random_baseline():
        tree = original()
        (tree / "vllm" / "fake_mode.json").write_text(mode("random"))
        return tree

    setup.baseline_tree = random_baseline
    with pytest.raises(SetupNotDeterministic, match="not reproducible"):
        loop.run()
    records = read_trace(setup.run_dir / "trace.jsonl")
    assert [r.event.kind for r in records] == ["run_started", "self_parity", "run_finished"]
    assert not records[1].event.ok
    assert records[2].event.reason.startswith("error: SetupNotDeterministic")
    assert loop.pool.running == [] and stopped_once(loop)


def test_a_candidate_right_only_where_parity_watches_is_rejected_at_the_audit(run):
    """The candidate sees what its server runs as: right under the parity servers' batch-invariant
    mode, wrong (by the right number of tokens, faster) on the production configuration, even one
    request at a time. Parity passes; the audit of the benchmark's own outputs does not."""
    setup, loop = run(
        {"1-unwatched.patch": new_file_patch("vllm/fake_mode_1.json", mode("unwatched", 0.0025),
                                             "fast, right only when watched")},
        parity={"num_prompts": 4, "input_len": 8, "max_tokens": 8, "regime": "one_batch",
                "env": {"VLLM_BATCH_INVARIANT": "1"}, "args": {"attention_backend": "TRITON_ATTN"}})
    finished = loop.run()
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("discard", "audit"), decision.reason
    records = [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]
    assert next(e for e in records if e.kind == "parity" and e.candidate == 1).ok
    token_audit = next(e for e in records if e.kind == "audit" and e.candidate == 1)
    assert token_audit.violation_count > 0 and token_audit.deficits.max == pytest.approx(8.0)
    assert finished.kept == 0 and audit(setup.run_dir).commits == 0


@pytest.mark.slow
def test_dedicated_parity_servers_start_beside_the_production_ones(run):
    setup, loop = run(
                      {"1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.0025), "faster")},
                      parity=DEDICATED,
                      benchmark={"warmup_requests": 2, "repetitions": 8, "request_timeout_s": REQUEST_TIMEOUT_S,
                                 "max_client_busy": 1.0, "client_processes": 2})
    finished = loop.run()
    assert finished.kept == 1, decisions(setup)[1].reason
    started = {spec.name: spec for spec in loop.pool.sandbox.started}
    assert sorted(started) == ["baseline-2", "baseline-perf", "candidate-1", "candidate-1-parity", "reference"]
    for name in ("reference", "baseline-2", "candidate-1-parity"):
        assert started[name].env.get("VLLM_BATCH_INVARIANT") == "1"
        assert started[name].engine_args["attention_backend"] == "TRITON_ATTN"
    for name in ("baseline-perf", "candidate-1"):
        assert "VLLM_BATCH_INVARIANT" not in started[name].env and "attention_backend" not in started[name].engine_args
    assert loop.pool.running == [] and stopped_once(loop)
    assert sorted(loop.pool.sandbox.exported) == ["baseline-2", "baseline-perf", "reference"]  # never a candidate's
    records = read_trace(setup.run_dir / "trace.jsonl")
    taken = [r.event.sample for r in records if r.event.kind == "sample" and r.event.confirmation == 0]
    report = next(r.event for r in records if r.event.kind == "benchmark")
    # each pass is on disk as soon as it is measured; the report adds the off-schedule flags, known once all are in
    as_taken = [s.model_copy(update={"flags": [f for f in s.flags if not f.startswith("off schedule")]})
                for s in report.samples]
    assert len(taken) == 16 and taken == as_taken
    assert all(0 < sample.client_busy <= 1 and sample.client_cpu_s > 0 for sample in taken)


DEDICATED = {"num_prompts": 4, "input_len": 8, "max_tokens": 8, "regime": "one_batch",
             "env": {"VLLM_BATCH_INVARIANT": "1"}, "args": {"attention_backend": "TRITON_ATTN"}}


def fake_servers_of(tree: Path) -> list[str]:
    """The pids of fake vLLM servers still running from `tree`."""
    alive = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"fake_vllm.py") for a in argv) and str(tree).encode() in argv:
            alive.append(cmdline.parent.name)
    return alive


def test_a_parity_failure_calls_off_the_production_start(run):
    """Parity is checked as soon as the candidate's (batch-invariant) parity server answers. A candidate that
    fails it is rejected without waiting for its production server, which here takes 120 s to start (as a
    compile would): that start is called off and its process killed."""
    setup, loop = run({"1-wrong.patch": new_file_patch("vllm/fake_mode_1.json", mode("random", production_start_s=120),
                                                       "slow to start, and wrong")}, parity=DEDICATED)
    finished = loop.run()
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("discard", "parity") and finished.kept == 0, decision.reason
    starts = {line["server"]: line for line in map(json.loads, (setup.run_dir / "server_starts.jsonl").open())}
    assert starts["candidate-1-parity"]["outcome"] == "ok" and starts["candidate-1"]["outcome"] == "cancelled"
    assert starts["candidate-1"]["seconds"] < 120
    assert "candidate-1" not in [spec.name for spec in loop.pool.sandbox.started]  # it never came up
    assert fake_servers_of(setup.workspace.worktrees / "candidate-1") == []
    assert loop.pool.running == [] and stopped_once(loop)
    print(f"rejected at parity {starts['candidate-1']['seconds']:.1f} s into a 120 s production start")


def test_a_production_start_that_fails_is_the_crash_not_the_parity_start_it_called_off(run):
    """The production server dies at startup while the parity server is still starting (60 s): the parity
    start is called off, and the decision names the production server's failure."""
    setup, loop = run({"1-crash.patch": new_file_patch(
        "vllm/fake_mode_1.json", mode("exact", 0.0025, parity_start_s=60, production_crash=True),
        "production server crashes at startup")}, parity=DEDICATED)
    loop.run()
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("crash", "start"), decision.reason
    assert "production server crashes at startup" in decision.reason and "called off" not in decision.reason
    starts = {line["server"]: line for line in map(json.loads, (setup.run_dir / "server_starts.jsonl").open())}
    assert starts["candidate-1-parity"]["outcome"] == "cancelled" and starts["candidate-1-parity"]["seconds"] < 60
    assert fake_servers_of(setup.workspace.worktrees / "candidate-1") == []
    assert loop.pool.running == []


def test_a_production_start_that_fails_while_parity_runs_stops_parity_there(run, monkeypatch):
    """Seen on a GPU: a candidate's production server ran out of memory while its parity server was checked, and
    parity went on for five minutes that could decide nothing. Here the parity server answers at 0.5 s a token
    (its prompts and long requests take over a minute) and the production server exits 3 s into its start: the
    decision is the production server's crash at `start`, and parity was stopped, so no parity report is written."""
    monkeypatch.setenv("FAKE_PACE", "candidate-1-parity:0.5")
    setup, loop = run({"1-crash.patch": new_file_patch(
        "vllm/fake_mode_1.json", mode("exact", 0.0025, production_start_s=3, production_crash=True),
        "production server dies while parity runs")}, parity=DEDICATED)
    loop.run()
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("crash", "start"), decision.reason
    assert "the production server crashes at startup" in decision.reason
    records = [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]
    assert not [e for e in records if e.kind == "parity" and e.candidate == 1]  # stopped, not finished
    starts = {line["server"]: line for line in map(json.loads, (setup.run_dir / "server_starts.jsonl").open())}
    assert starts["candidate-1-parity"]["outcome"] == "ok" and starts["candidate-1"]["outcome"] != "ok"
    assert fake_servers_of(setup.workspace.worktrees / "candidate-1") == []
    assert loop.pool.running == [] and stopped_once(loop)


def test_a_pass_whose_client_was_too_busy_is_not_trusted(run):
    setup, loop = run(
                      {"1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.0025), "faster")},
                      benchmark={"warmup_requests": 2, "repetitions": 5, "request_timeout_s": REQUEST_TIMEOUT_S,
                                 "max_client_busy": 0.001})
    loop.run()
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("discard", "benchmark")
    assert "load client process was busy" in decision.reason and "client_processes" in decision.reason
    taken = [r.event.sample for r in read_trace(setup.run_dir / "trace.jsonl") if r.event.kind == "sample"]
    assert len(taken) == 1 and taken[0].client_busy > 0.001  # stopped at the first untrusted pass


def test_a_reference_that_stops_answering_ends_the_run_without_blaming_the_candidate(run):
    setup, loop = run(
                      {"1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.0025), "faster")})
    worker = loop.slots.worker
    original_evaluate = worker.evaluate

    def evaluate_after_the_reference_died(proposal, head):
        loop.baseline.reference.process.kill()
        loop.baseline.reference.process.wait()
        return original_evaluate(proposal, head)

    worker.evaluate = evaluate_after_the_reference_died
    with pytest.raises(ReferenceFailed, match="reference server failed to answer"):
        loop.run()
    kinds = [r.event.kind for r in read_trace(setup.run_dir / "trace.jsonl")]
    assert "decision" not in kinds and kinds[-1] == "run_finished"
    assert read_trace(setup.run_dir / "trace.jsonl")[-1].event.reason.startswith("error: ReferenceFailed")
    assert loop.pool.running == [] and stopped_once(loop)


@pytest.mark.slow
def test_a_win_must_repeat_in_an_independent_confirmation(run):
    # Candidate 1 is fast for its parity check and first benchmark, then slower than the incumbent: measured in runs
    # of this test, 18-49 requests come before the benchmark (parity's prompts, long requests and margins, the
    # warmup) and a pass of this workload is 32: its first benchmark of 8 pairs ends by request 305, so after 310 it
    # is slow for the whole confirmation but at most its first two passes. Candidate 2 is fast throughout.
    fading = mode("exact", 0.0025, slow_after=310, slow_delay_s=0.02)
    setup, loop = run({
        "1-fading.patch": new_file_patch("vllm/fake_mode_1.json", fading, "faster once"),
        "2-fast.patch": new_file_patch("vllm/fake_mode_2.json", mode("exact", 0.0025), "faster"),
    }, acceptance={"min_speedup": 1.02, "confidence": 0.95, "confirmations": 1},
        workload={"output_len": 48})  # passes of 0.1-0.5 s: a scheduling hiccup of a busy host is small beside them
    finished = loop.run()
    records = [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]
    reports = {(e.candidate, e.confirmation): e for e in records if e.kind == "benchmark"}
    assert sorted(reports) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert reports[1, 0].ci_low > 1.02 and reports[1, 1].speedup < 1.0  # it passed once, then did not
    got = decisions(setup)
    assert got[1].verdict == "discard" and got[1].reason.startswith("confirmation 1 of 1: not faster")
    assert got[2].verdict == "keep" and got[2].reason.startswith("confirmation 1 of 1: speedup")
    assert got[2].speedup == reports[2, 1].speedup  # the estimate recorded is the confirmation's
    assert finished.kept == 1 and audit(setup.run_dir).commits == 1
    confirming = [e for e in records if e.kind == "sample" and e.confirmation == 1]
    assert len(confirming) == 32 and {e.candidate for e in confirming} == {1, 2}  # 8 pairs each


WEDGE_BENCHMARK = {"warmup_requests": 2, "repetitions": 8, "request_timeout_s": 60, "stall_timeout_s": 2,
                   "max_client_busy": 1.0}
"""A stream silent for 2 s fails its pass (tests/fake_vllm.py's FAKE_FREEZE stops a server after N requests)."""


def into_second_pass(task) -> int:
    """The streamed requests the baseline's production server answers before it is halfway into the second pass
    of the first benchmark: parity's prompts, the audit's A/A (a warm-up, then its passes), the benchmark's
    warm-up, one pass and half of the next."""
    size, warmup = bench.pass_size(task), task.benchmark.warmup_requests
    return task.parity.num_prompts + warmup + bench.audit_calibration_passes(task) * size + warmup + size + size // 2


def two_fast(first: str) -> dict:
    """Two exact candidates, both faster than the baseline."""
    return {"1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.0025), first),
            "2-fast.patch": new_file_patch("vllm/fake_mode_2.json", mode("exact", 0.0025), "faster too")}


@pytest.mark.slow
def test_an_incumbent_that_freezes_mid_benchmark_is_replaced_and_the_candidate_measured_again(run, monkeypatch):
    """Seen on the H200: the incumbent's production server stopped sending tokens in the middle of a pass, with
    256 requests in flight. Its stream goes silent past benchmark.stall_timeout_s; the candidate is not blamed:
    the incumbent is replaced and the candidate benchmarked again, and the failed attempt leaves no record."""
    setup, loop = run({"1-fast.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.0025), "faster")},
                      benchmark=WEDGE_BENCHMARK)
    monkeypatch.setenv("FAKE_FREEZE", f"baseline-2:{into_second_pass(setup.task)}")  # read as each server starts
    finished = loop.run()
    records = [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]
    (restart,) = [e for e in records if e.kind == "incumbent_restarted"]
    assert (restart.candidate, restart.failed_server, restart.server) == (1, "baseline-2", "incumbent-r1")
    assert "the incumbent's server baseline-2 failed in repetition 1" in restart.reason
    assert "stalled: no token arrived on any of" in restart.reason and restart.seconds > 0
    assert restart.post_mortem["processes"] and restart.post_mortem["threads"] >= 2  # the frozen fake, as it was
    assert "threads (state:wait" in restart.reason
    report = next(e for e in records if e.kind == "benchmark" and e.confirmation == 0)
    assert sorted((s.role, s.repetition) for s in report.samples) == sorted(
        (role, k) for role in ("incumbent", "candidate") for k in range(8))
    decision = decisions(setup)[1]
    assert (decision.verdict, decision.stage) == ("keep", "decision"), decision.reason
    assert finished.kept == 1 and audit(setup.run_dir).commits == 1
    write_summary(setup.run_dir)
    restarts = json.loads((setup.run_dir / "summary.json").read_text())["incumbent_restarts"]
    assert [r["failed_server"] for r in restarts] == ["baseline-2"]
    assert loop.pool.running == [] and stopped_once(loop)


@pytest.mark.slow
def test_a_candidate_that_freezes_mid_benchmark_crashes_there_and_the_run_goes_on(run, monkeypatch):
    monkeypatch.setenv("FAKE_FREEZE", "candidate-1:10")  # 4 parity + 2 warm-up + 4 of its first pass
    setup, loop = run(two_fast("fast, then wedged"), benchmark=WEDGE_BENCHMARK)
    finished = loop.run()
    got = decisions(setup)
    assert (got[1].verdict, got[1].stage) == ("crash", "benchmark"), got[1].reason
    assert "the candidate's server candidate-1 failed in repetition 0" in got[1].reason
    assert re.search(r"\(after \d+\.\d s, the harness ran \d+\.\d\d s of CPU.*; the server's processes: \w", got[1].reason)
    assert "1 process, " in got[1].reason and "threads" in got[1].reason
    assert (got[2].verdict, got[2].stage) == ("keep", "decision"), got[2].reason
    kinds = [r.event.kind for r in read_trace(setup.run_dir / "trace.jsonl")]
    assert "incumbent_restarted" not in kinds and finished.kept == 1
    # the wedged candidate cost its stall timeout (2 s of silence), not the 60 s request timeout: a cause, not a clock
    assert "stalled: no token arrived on any of" in got[1].reason, got[1].reason
    assert loop.pool.running == [] and stopped_once(loop)


@pytest.mark.slow
def test_an_incumbent_that_fails_again_beside_the_same_candidate_crashes_the_candidate(run, monkeypatch):
    """A candidate that could wedge its neighbour must not earn endless re-measurements: the second failure of
    the incumbent beside it ends it as a crash, and the run goes on with a replaced incumbent."""
    setup, loop = run(two_fast("faster"), benchmark=WEDGE_BENCHMARK)
    monkeypatch.setenv("FAKE_FREEZE", f"baseline-2:{into_second_pass(setup.task)},incumbent-r1:6")
    finished = loop.run()
    records = [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]
    restarts = [(e.candidate, e.failed_server, e.server) for e in records if e.kind == "incumbent_restarted"]
    assert restarts == [(1, "baseline-2", "incumbent-r1"), (1, "incumbent-r1", "incumbent-r2")]
    got = decisions(setup)
    assert (got[1].verdict, got[1].stage) == ("crash", "benchmark") and "the second time" in got[1].reason
    assert (got[2].verdict, got[2].stage) == ("keep", "decision"), got[2].reason
    assert finished.kept == 1 and loop.pool.running == [] and stopped_once(loop)


@pytest.mark.parametrize("variant", ["held", "spinning", "sly", "unchecked"])
@pytest.mark.slow
@pytest.mark.serial  # CPU seconds of idle servers: nothing else may run beside it
def test_a_candidate_that_works_while_the_incumbent_is_measured(run, monkeypatch, variant):
    """The adversary: as fast as the incumbent on its own, but its server spins on every core whenever it has no
    request, so the incumbent's passes run slower and the candidate looks faster. By default (`held`) the harness
    freezes the idle side for each pass (benchmark.hold_idle): the spinners are frozen with it, the incumbent runs
    alone and the candidate is measured as it is, no faster. The second layer, with the hold off: before each
    pass the harness waits for both servers to go quiet (benchmark.settle_s): the spinner never does, is flagged
    restless, and its work during the incumbent's passes rejects it at the benchmark. The `sly` one spins only
    while the rest of the host is busy, so it is quiet whenever the harness waits; the counts during the passes
    still catch it. With benchmark.max_idle_cpu off too it fools the gate and is kept, and replay re-derives the
    check from the recorded counts."""
    monkeypatch.setenv("FAKE_CPU_BOUND", "1")  # the servers' per-token work is computed, so it competes for CPU
    burner = mode("exact", 0.01, idle_burn=6, **({"idle_burn_sly": True} if variant == "sly" else {}))
    setup, loop = run(
        {"1-burner.patch": new_file_patch("vllm/fake_mode_1.json", burner, "busy idle")},
        benchmark={"warmup_requests": 2, "repetitions": 6, "request_timeout_s": 60, "max_client_busy": 1.0,
                   "settle_s": 3.0, **({"max_idle_cpu": None} if variant == "unchecked" else {}),
                   **({} if variant == "held" else {"hold_idle": False})})
    finished = loop.run()
    decision = decisions(setup)[1]
    samples = [r.event.sample for r in read_trace(setup.run_dir / "trace.jsonl") if r.event.kind == "sample"]
    during_incumbent = [s.neighbour_cpu_s / s.seconds for s in samples if s.role == "incumbent"]
    during_candidate = [s.neighbour_cpu_s / s.seconds for s in samples if s.role == "candidate"]
    assert all(s.neighbour_held is (variant == "held") for s in samples)
    if variant == "held":
        assert max(during_incumbent) < 0.1 and max(during_candidate) < 0.1, (during_incumbent, during_candidate)
        assert (decision.verdict, decision.stage) == ("discard", "decision"), decision.reason
        assert decision.speedup < 1.2 and finished.kept == 0 and stopped_once(loop)
        return
    assert sum(during_incumbent) / len(during_incumbent) > 0.3 and max(during_candidate) < 0.1, \
        (during_incumbent, during_candidate)
    restless = [f for s in samples for f in s.flags if f.startswith("restless: candidate-1 still used")]
    waits = [s.settle_s for s in samples]
    if variant == "sly":  # quiet whenever the host is (flagged at most once, where something else was busy)
        assert len(restless) <= 1 and sorted(waits)[len(waits) // 2] < 1, waits
    else:
        long_waits = [w for w in waits if w >= 2]  # awaited once in each benchmark (a kept one is confirmed), no more
        assert 1 <= len(restless) == len(long_waits) <= (2 if variant == "unchecked" else 1), waits
        assert min(long_waits) >= 3, waits
    if variant != "unchecked":
        assert (decision.verdict, decision.stage) == ("discard", "benchmark"), decision.reason
        assert "CPU cores more while the incumbent was measured" in decision.reason and finished.kept == 0
    else:
        assert (decision.verdict, decision.stage) == ("keep", "decision"), decision.reason
        assert decision.speedup > 1.2 and finished.kept == 1 and audit(setup.run_dir).decisions == 1
        assert any("neighbour busy: the other side's server used" in f for s in samples for f in s.flags)
        records = read_trace(setup.run_dir / "trace.jsonl")  # the same evidence, judged with the check on
        records[0].event.task["benchmark"]["max_idle_cpu"] = 0.25
        with pytest.raises(TraceError, match="counted, though the candidate's server used"):
            check_decisions(records)
    assert loop.pool.running == [] and stopped_once(loop)


@pytest.mark.parametrize("hold", [True, False], ids=["held", "not-held"])
@pytest.mark.slow
@pytest.mark.serial  # servers that lose the time they are stopped (or woken late): nothing may run beside them
def test_a_candidate_that_stops_the_incumbent_while_it_is_measured(run, monkeypatch, hold):
    """The adversary: exact and no faster, but whenever it has no request in flight it stops every other server
    of the run half of each 100 ms (SIGSTOP and SIGCONT to the process groups that the pid files beside its home
    name): the incumbent's passes run at about half speed, and a stopped process spends no CPU, so the idle-work
    check sees nothing. Held (benchmark.hold_idle, the default), it is frozen before the incumbent's pass and the
    incumbent let run after it, so it is measured as it is: no faster. Not held, it fools the gate."""
    monkeypatch.setenv("FAKE_UNPACED", "1")  # a stopped server's lost time is lost, as a real one's is
    pauser = mode("exact", 0.01, stop_others=0.5)
    setup, loop = run({"1-pauser.patch": new_file_patch("vllm/fake_mode_1.json", pauser, "stops the others")},
                      benchmark={"warmup_requests": 2, "repetitions": 6, "request_timeout_s": 60,
                                 "max_client_busy": 1.0, "hold_idle": hold})
    finished = loop.run()
    decision = decisions(setup)[1]
    samples = [r.event.sample for r in read_trace(setup.run_dir / "trace.jsonl") if r.event.kind == "sample"]
    assert samples and all(s.neighbour_held is hold for s in samples)
    if hold:
        assert (decision.verdict, decision.stage) == ("discard", "decision"), decision.reason
        assert 0.8 < decision.speedup < 1.2 and finished.kept == 0, decision.reason
    else:
        assert decision.speedup > 1.4, decision.reason  # the stops slowed the incumbent: the gate was fooled
        assert max(s.neighbour_cpu_s / s.seconds for s in samples if s.role == "incumbent") < 0.1
    assert loop.pool.running == [] and stopped_once(loop)


@pytest.mark.parametrize("twin", ["alike", "faster"])
@pytest.mark.slow
@pytest.mark.paced  # a 4x keep and a 4x null of fake servers
def test_the_gate_is_tried_on_a_null_every_few_candidates_and_replay_rederives_it(run, monkeypatch, twin):
    """With a night's error budget and acceptance.null_every 2, after the second candidate's first benchmark the
    incumbent is benchmarked against a second server of itself at that candidate's level (`null_check`): alike, the
    gate keeps nothing; a twin that its host runs 4x faster (FAKE_PACE) is a false keep of the gate on a null,
    recorded as such. Replay re-derives the check and refuses a record whose verdict was turned."""
    if twin == "faster":
        monkeypatch.setenv("FAKE_PACE", "null-2:0.0025")
    same = mode("exact", 0.01)
    setup, loop = run({"1-same.patch": new_file_patch("vllm/fake_mode_1.json", same, "no faster"),
                       "2-same.patch": new_file_patch("vllm/fake_mode_2.json", same, "no faster either")},
                      acceptance={"night_alpha": 0.05, "null_every": 2, "min_speedup": 1.05},
                      workload={"output_len": 48})  # passes of ~0.5 s: a scheduling hiccup on a busy host is small
    finished = loop.run()
    records = read_trace(setup.run_dir / "trace.jsonl")
    events = [r.event for r in records]
    shares = [e for e in events if e.kind == "error_spent"]
    nulls = [e for e in events if e.kind == "null_check"]
    assert [s.index for s in shares] == [1, 2] and [n.index for n in nulls] == [2], [e.kind for e in events]
    null = nulls[0]
    assert not null.failed and null.report.confidence == pytest.approx(shares[1].confidence)
    assert null.false_keep is (twin == "faster"), (null.report.speedup, null.report.ci_low)
    if twin == "faster":  # paced 4x faster; a pass's fixed costs (client, event loop) on a loaded host are the
        assert null.report.speedup > 1.3  # same on both sides and compress the ratio: 1.77x at -n 4 beside others
    assert finished.kept == 0 and check_decisions(records) == 2
    turned = [r.model_copy(deep=True) for r in records]
    target = next(r for r in turned if r.event.kind == "null_check")
    target.event.false_keep = not target.event.false_keep
    with pytest.raises(TraceError, match=f"trace line {target.seq + 1}: the null check at index 2"):
        check_decisions(turned)
    assert loop.pool.running == [] and stopped_once(loop)


def registered_under(repo_path: Path, root: Path) -> list[str]:
    listing = git.Repo(repo_path).git.worktree("list", "--porcelain").splitlines()
    return [l.split(" ", 1)[1] for l in listing if l.startswith("worktree ") and str(root) in l]


def test_a_run_that_ends_leaves_no_worktree_registered_in_the_shared_checkout(run, monkeypatch):
    from agent.face.cli import run_loop

    setup, loop = run({"1-random.patch": new_file_patch("vllm/fake_mode_1.json", mode("random"), "different tokens"),
                       "2-fast.patch": new_file_patch("vllm/fake_mode_2.json", mode("exact", 0.0025), "faster")})
    seen = []
    real_evaluate = Worker.evaluate

    def evaluate(self, proposal, head):  # while the run goes on, its trees are there (the baseline's, the incumbent's)
        seen.append(len(registered_under(setup.repo.working_dir, setup.run_dir)))
        return real_evaluate(self, proposal, head)

    monkeypatch.setattr(Worker, "evaluate", evaluate)
    run_loop(setup, loop.proposer, quiet=True, sandbox=loop.pool.sandbox)
    assert seen and min(seen) >= 1
    assert registered_under(setup.repo.working_dir, setup.run_dir) == []
    assert not list((setup.run_dir / "worktrees").glob("*"))
    assert audit(setup.run_dir).finished  # the branch is untouched


def test_a_host_slow_to_start_the_baseline_does_not_blame_the_candidate(run):
    """Every server waits 3 s to start (a loaded host) and the no-op candidate's 3 s more, past
    engine.startup_timeout_s 5 s: its start may take 3x the baseline's slowest, and it is judged, not crashed."""
    import json as _json

    setup, loop = run({"1-noop.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", production_start_s=3,
                                                                                 parity_start_s=3), "a no-op")},
                      engine={"startup_timeout_s": 5, "env": {"FAKE_START_S": "3"}})
    loop.run()
    decision = decisions(setup)[1]
    assert decision.stage != "start", decision.reason
    starts = [_json.loads(l) for l in (setup.run_dir / "server_starts.jsonl").read_text().splitlines()]
    baseline = [s for s in starts if s["trusted"]]
    candidate = [s for s in starts if not s["trusted"] and s["server"].startswith("candidate")]
    assert baseline and all(s["timeout_from"] == "engine.startup_timeout_s" for s in baseline)
    assert candidate and all(s["outcome"] == "ok" and s["seconds"] > 5 and s["timeout_from"].startswith("3 x the "
                                                                                                      "baseline's start")
                             for s in candidate), candidate
