"""The candidate owns its output, and the incumbent is checked in every benchmark: the loop end to end with fake
servers in real processes (tests/fake_vllm.py), the adversaries beside the honest candidates they must not harm.

- A candidate that returns, now and then under load, an id the reference cannot score is rejected at `audit` with
  that reason, and the run goes on to keep an honest faster candidate after it.
- A kept change exact through its own benchmark and confirmation that turns wrong after N requests is found at the
  next benchmark (or at the end-of-run audit): `incumbent_reverted`, a revert commit, the branch back at its last
  good tree, the cumulative speedup without it, `replay` re-deriving every step, the review saying so.
- Honest incumbents, exact or noisy, are never flagged."""
import git
import pytest

from agent.face.report import review_tables, write_summary
from agent.replay.chain import audit
from agent.replay.evidence import check_decisions
from tests.stand_in import REQUEST_TIMEOUT_S, decisions, mode, new_file_patch
from traces import TraceError, read_trace

pytestmark = [pytest.mark.paced, pytest.mark.slow]  # paced: keeps are measured speed of fake servers far apart; each a
# fake run of 30-90 s

CPU_RATE = 0.035
PAIRS = {"warmup_requests": 2, "repetitions": 8, "request_timeout_s": REQUEST_TIMEOUT_S, "max_client_busy": 1.0}
"""The fading candidates' benchmarks: a fixed 8 pairs of 8 requests (the stand-ins' own since). At 5, one starved
pass in a loaded paced tier turned a 4x keep's confirmation into 2.31x [0.80, 6.72] (the paired t of 5 pairs, 4
degrees of freedom: nothing is trimmed under 10)."""
WRONG_AFTER = 170
"""Requests a fading candidate serves right: its parity (about 10), its benchmark and its confirmation (2 + 8 x 8
each) come to about 140; the next benchmark, or the end-of-run audit (as many passes as a benchmark), takes it past
170 halfway through."""


def candidate(n: int, name: str, delay_s: float, subject: str, **config) -> tuple[str, str]:
    return f"{n}-{name}.patch", new_file_patch(f"vllm/fake_mode_{n}.json", mode(name, delay_s, **config), subject)


def events(setup, kind: str) -> list:
    return [r.event for r in read_trace(setup.run_dir / "trace.jsonl") if r.event.kind == kind]


def candidate_audits(setup) -> list:
    return [a for a in events(setup, "audit") if not a.calibration and not a.incumbent]


def with_baseline(setup, text: str) -> None:
    original = setup.baseline_tree

    def baseline():
        tree = original()
        (tree / "vllm" / "fake_mode.json").write_text(text)
        return tree
    setup.baseline_tree = baseline


def test_output_the_reference_cannot_score_rejects_the_candidate_and_the_run_goes_on(run):
    """Three faster candidates each slip, in one request of eight served under load, one id the reference cannot
    score: past the vocabulary (found before it is sent), negative (the same), and a special id the reference's
    tokenizer refuses with HTTP 400 though the model's config allows it (found by the probe). Each is rejected at
    the audit with that reason; the honest faster candidate after them is kept, and its incumbent never flagged."""
    setup, loop = run(dict([
        candidate(1, "poison", 0.0025, "faster, an id past the vocabulary now and then", poison_every=8),
        candidate(2, "poison", 0.0025, "faster, a negative id now and then", poison_every=8, poison_token=-1),
        candidate(3, "poison", 0.0025, "faster, an id the tokenizer refuses", poison_every=8, poison_token=2),
        candidate(4, "exact", 0.0025, "faster, same tokens"),
    ]))
    with_baseline(setup, mode("exact", 0.01, refuse_below=4))
    finished = loop.run()
    got = decisions(setup)
    stopped = [n for n in (1, 2, 3) if (got[n].verdict, got[n].stage) == ("discard", "audit")]
    assert stopped == [1, 2, 3], {n: (got[n].stage, got[n].reason) for n in got}
    assert "vocabulary" in got[1].reason and "262144" in got[1].reason
    assert "vocabulary" in got[2].reason and "token id -1" in got[2].reason
    assert "refused" in got[3].reason and "HTTP 400" in got[3].reason
    audits = {a.candidate: a for a in candidate_audits(setup)}
    assert [e.kind for e in audits[3].invalid] == ["refused"] * audits[3].invalid_count
    assert all(a.control_verdict.passed for a in audits.values())  # the honest incumbent is never flagged
    assert (got[4].verdict, got[4].stage) == ("keep", "decision"), got[4].reason
    assert finished.reason == "budget: candidates" or finished.candidates == 4
    assert not finished.resumable and finished.kept == 1
    final = [a for a in events(setup, "audit") if a.incumbent]
    assert [(a.candidate, a.verdict.passed) for a in final] == [(0, True)]  # the head audited at the end, passed
    assert final[0].commit == setup.workspace.head()
    result = audit(setup.run_dir)
    assert result.commits == 1 and result.reverts == 0 and result.finished


def test_a_kept_change_that_turns_wrong_later_is_found_at_the_next_benchmark_and_taken_back(run):
    """Candidate 1 is exact and faster through its own parity, benchmark and confirmation (about 140 requests), then
    wrong on every request past WRONG_AFTER. Candidate 2's benchmark finds the incumbent wrong, its audit on fresh prompts
    confirms it, the branch goes back to the base's tree by a revert commit, and candidate 2 (an honest refactor) is
    measured again beside the restored incumbent; candidate 3, honest and faster, is kept, and passes the end-of-run
    audit."""
    setup, loop = run(dict([
        candidate(1, "exact", 0.0025, "faster, wrong later", wrong_after=WRONG_AFTER),
        candidate(2, "exact", 0.01, "an honest refactor"),
        candidate(3, "exact", 0.0025, "faster, same tokens"),
    ]), budget={"max_candidates": 3}, benchmark=PAIRS)
    finished = loop.run()
    got = decisions(setup)
    assert got[1].verdict == "keep", got[1].reason
    flagged = [a for a in candidate_audits(setup) if a.control_verdict and not a.control_verdict.passed]
    assert [(a.candidate, a.control_verdict.test) for a in flagged] == [(2, "hard_bound")]
    [reverted] = events(setup, "incumbent_reverted")
    [commit] = [c for c in events(setup, "commit") if c.candidate == 1]
    assert (reverted.candidate, reverted.kept_by, reverted.failed_commit) == (2, 1, commit.commit)
    assert reverted.restored == setup.base_commit
    [revert] = events(setup, "reverted")
    repo = git.Repo(setup.repo.working_dir)
    assert repo.commit(revert.commit).tree == repo.commit(setup.base_commit).tree
    assert "Nightshift-Reverts: " + commit.commit in repo.commit(revert.commit).message
    [remeasured] = events(setup, "remeasured")
    assert (remeasured.candidate, remeasured.measured_against, remeasured.head_commit) == (2, commit.commit,
                                                                                          revert.commit)
    assert got[2].stage in ("decision", "benchmark") and got[2].verdict == "discard", got[2].reason
    assert got[3].verdict == "keep", got[3].reason
    assert finished.kept == 1 and finished.best_speedup == pytest.approx(got[3].speedup)
    later = [a for a in candidate_audits(setup) if a.candidate == 3]
    assert all(a.control_verdict.passed for a in later)  # the restored incumbent is honest and stays unflagged
    final = [a for a in events(setup, "audit") if a.incumbent and a.candidate == 0]
    assert [a.verdict.passed for a in final] == [True] and final[0].commit == setup.workspace.head()
    result = audit(setup.run_dir)
    assert (result.commits, result.reverts, result.finished) == (2, 1, True)
    write_summary(setup.run_dir)
    rendered = "\n".join(str(t.title) for t in review_tables(setup.run_dir))
    assert "taken back" in rendered


def test_the_end_of_run_audit_takes_back_a_head_that_turned_wrong_and_replay_re_derives_it(run):
    """The last keep turns wrong only after the run's last benchmark: the end-of-run audit of the branch head on fresh
    prompts finds it, the branch goes back, and the run reports nothing kept. Replay re-derives the revert, and
    refuses a trace whose revert has no failing audit behind it, or whose finished head was never audited."""
    setup, loop = run(dict([candidate(1, "exact", 0.0025, "faster, wrong later", wrong_after=WRONG_AFTER)]),
                      budget={"max_candidates": 1}, benchmark=PAIRS)
    finished = loop.run()
    assert decisions(setup)[1].verdict == "keep", decisions(setup)[1].reason
    [reverted] = events(setup, "incumbent_reverted")
    assert reverted.candidate == 0 and reverted.kept_by == 1 and "end of the run" in reverted.reason
    ends = [a for a in events(setup, "audit") if a.incumbent]  # failed, and failed again on fresh prompts
    assert [(a.candidate, a.confirmation, a.verdict.passed) for a in ends] == [(0, 0, False), (0, 1, False)]
    assert reverted.audit_seed == ends[1].sample_seed
    assert finished.kept == 0 and finished.best_speedup == pytest.approx(1.0)
    repo = git.Repo(setup.repo.working_dir)
    assert repo.commit(finished.head_commit).tree == repo.commit(setup.base_commit).tree
    result = audit(setup.run_dir)
    assert (result.commits, result.reverts) == (1, 1)

    records = read_trace(setup.run_dir / "trace.jsonl")
    check_decisions(records)
    forged = [r.model_copy(deep=True) for r in records]
    failing = next(r for r in forged if r.event.kind == "audit" and r.event.incumbent
                   and r.event.sample_seed == reverted.audit_seed)
    failing.event.incumbent = False  # the failing audit of the incumbent is no longer one
    line = next(r.seq + 1 for r in forged if r.event.kind == "incumbent_reverted")
    with pytest.raises(TraceError, match=f"trace line {line}: .*taken back, but the incumbent's audit"):
        check_decisions(forged)
    unchecked = [r for r in records if not (r.event.kind in ("audit", "incumbent_reverted", "reverted")
                                            and (getattr(r.event, "incumbent", True)))]
    with pytest.raises(TraceError, match="never audited on fresh prompts at its end"):
        check_decisions(unchecked)


@pytest.fixture
def noisy_run(tmp_path, fake_model):
    from tests.stand_in import loop_maker, stand_in_checkout
    checkout = stand_in_checkout(tmp_path / "noisy" / "checkout",
                                 {"vllm/fake_mode.json": mode("exact", 0.01, noise_rate=CPU_RATE)})
    return loop_maker(tmp_path, checkout, fake_model,
                      workload={"num_prompts": 16, "input_len": 16, "output_len": 32, "concurrency": 4},
                      acceptance={"min_speedup": 1.05, "confidence": 0.95, "confirmations": 0})


def test_honest_noisy_incumbents_are_never_flagged(noisy_run):
    """Honest numerics under load (near-ties flipped at the AMX CPU's rate) on both sides: faster candidates are kept,
    every benchmark judges the incumbent beside it, and none is flagged, nor the head at the end."""
    setup, loop = noisy_run(dict(candidate(n, "exact", delay, f"honest #{n}", noise_rate=CPU_RATE)
                                 for n, delay in enumerate([0.004, 0.004, 0.01, 0.004], 1)))
    finished = loop.run()
    got = decisions(setup)
    assert all(d.stage != "audit" for d in got.values()), {n: d.reason for n, d in got.items()}
    verdicts = [a.control_verdict for a in candidate_audits(setup)]
    assert len(verdicts) == 4 and all(v.passed for v in verdicts), [v.reason for v in verdicts if not v.passed]
    assert not events(setup, "incumbent_reverted") and finished.kept >= 1
    assert [a.verdict.passed for a in events(setup, "audit") if a.incumbent] == [True]
    check_decisions(read_trace(setup.run_dir / "trace.jsonl"))
