"""Checks that reach what the model serves, an audit that weighs how far off a token is, and one error budget for
the night: the candidate that tries to get past each, and the honest one each must not reject."""
import numpy as np

from agent.run import budget
from agent.stages.parity import long_reach, long_shapes
from agent.stages.token_audit import judge, magnitude_p
from agent.world.task import load_task, with_overrides
from tests.stand_in import ROOT
from traces.schema import AuditSide


def side(values, tokens=5120, requests=160):
    per = [0] * requests
    for i in range(len(values)):
        per[i % requests] += 1
    return AuditSide(requests=requests, tokens=tokens, non_top1=len(values), per_request=per,
                     request_tokens=[tokens // requests] * requests, values=list(values))


def honest(rng, count):
    return [round(float(v), 4) for v in rng.exponential(0.2, count)]


def test_the_longest_request_reaches_what_the_task_serves_and_shapes_change_per_seed():
    task = load_task(ROOT / "tasks" / "gemma4-tiny-cpu.yaml")
    reach = long_reach(task)
    w, v = task.workload, task.verify
    assert reach == min(task.model.max_model_len, max(w.input_len + w.output_len,
                                                      max(v.input_lens) + max(v.output_lens)))
    assert reach >= min(task.model.max_model_len, w.input_len + w.output_len)
    a, b = long_shapes(1, 4, 46, reach, 0.5), long_shapes(2, 4, 46, reach, 0.5)
    assert a[0].input_len + a[0].max_tokens == reach and not a[0].production and a[1].production
    assert [(s.input_len, s.max_tokens) for s in a] != [(s.input_len, s.max_tokens) for s in b]
    for s in a + b:
        assert 46 <= s.input_len + s.max_tokens <= reach and s.max_tokens >= (s.input_len + s.max_tokens) // 4 - 1
    small = with_overrides(task, model={"max_model_len": 128})
    assert long_reach(small) == 128


def test_errors_no_honest_run_made_are_rejected_inside_the_rate_allowance():
    """Adversaries: exact batching that spends the whole 2x rate allowance on errors of 3-5.9 nats (below the hard
    bound), and the harder one that spends a tenth of it just above the honest maximum. Honest: 200 draws of the
    same noise as the control, none rejected at the magnitude test's level more often than it states."""
    rng = np.random.default_rng(5)
    stopped = 0
    for trial in range(20):
        control, aa = side(honest(rng, 180)), side(honest(rng, 170))
        top = max(control.values + aa.values)
        spend_all = side(honest(rng, 180) + [round(float(v), 4) for v in rng.uniform(3, 5.9, 170)])
        sly = side(honest(rng, 250) + [round(top + 0.05 + 0.01 * i, 4) for i in range(30)])
        for adversary in (spend_all, sly):
            verdict = judge(adversary, control, aa, 6.0, 2.0, 0.95)
            stopped += not verdict.passed and verdict.test in ("magnitude", "rate")
    assert stopped == 40
    rejected = 0
    for trial in range(200):
        control, aa, candidate = side(honest(rng, 180)), side(honest(rng, 170)), side(honest(rng, 190))
        rejected += not judge(candidate, control, aa, 6.0, 2.0, 0.95).passed
    assert rejected <= 4, rejected  # 0.5% stated for magnitude plus the rate test's share


def test_magnitude_p_is_exact_for_small_cases():
    p, j = magnitude_p(side([5.0, 5.0]), [side([1.0, 1.0])])
    assert j == 2 and abs(p - 1 / 6) < 1e-12  # C(2,2)/C(4,2)
    assert magnitude_p(side([0.5]), [None, None]) == (1.0, 0)


def test_the_nights_budget_is_bounded_over_any_number_of_candidates_and_never_restarts():
    night = 0.05
    assert budget.spent_through(night, 10_000) < night
    shares = [budget.spend(night, c, i + 1) for i, c in enumerate(range(1, 101))]
    assert shares[-1].spent < night and all(s.alpha < night for s in shares)
    assert shares[0].alpha > shares[1].alpha  # spent candidate by candidate, each share smaller
    # a resume continues from the trace's count: a restart at index 1 would be a share the replay refuses
    assert budget.spend(night, 101, 101).alpha < shares[0].alpha
