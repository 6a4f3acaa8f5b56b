"""What a candidate returns is the candidate's: output the reference cannot score rejects the candidate at the audit,
and only a reference that cannot answer the harness's own prompt stops the run.

The rule on hand-made outputs (agent/stages/token_audit.py `invalid_outputs`), and `run_audit` against an in-process
reference (httpx's MockTransport) that answers as vLLM does: HTTP 400 to an id it does not know, or nothing at all."""
import httpx
import pytest

from agent.replay.evidence import _check_audit
from agent.stages.parity import ReferenceFailed
from agent.stages.token_audit import Output, audit_passed, invalid_outputs, run_audit
from agent.world.task import Acceptance, Audit
from traces import TraceError

VOCAB = 4096
KNOWN = 4000
"""The reference's tokenizer knows ids below this; the model's config says 4096 (a padded vocabulary)."""


def outputs(n: int = 8, length: int = 16, change=None) -> list[Output]:
    out = [Output(0, i, [10 + i] * 4, [100 + i + k for k in range(length)]) for i in range(n)]
    if change:
        change(out)
    return out


class Reference:
    """A reference server in-process: top-1 everywhere, HTTP 400 for an id it does not know; `down` after
    `answers` requests (a dead reference: no answer at all)."""

    def __init__(self, answers: int | None = None, status: int = 400):
        self.answers, self.status, self.seen = answers, status, 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        if self.answers is not None and self.seen > self.answers:
            raise httpx.ConnectError("connection refused", request=request)
        prompt = httpx.Response(200, content=request.content).json()["prompt"]
        if any(not 0 <= t < KNOWN for t in prompt):
            return httpx.Response(self.status, json={"message": "Token id is out of vocabulary"})
        entries = [None] + [{str(t): {"logprob": -0.1, "rank": 1}} for t in prompt[1:]]
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": entries, "token_ids": [5]}]})

    def client(self, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle), base_url="http://reference")


RULE = Audit()


def audit(reference, mine, control=None, calibration=None):
    return run_audit(1, reference, mine, RULE, 10, 0.95, control, calibration, 0, vocab_size=VOCAB,
                     expected_tokens=16)


def test_honest_outputs_are_valid_and_pass():
    assert invalid_outputs(outputs(), VOCAB, 16) == []
    event = audit(Reference(), outputs(), outputs())
    assert audit_passed(event) and event.invalid == [] and event.tokens == 8 * 16


@pytest.mark.parametrize("token,kind", [(VOCAB, "vocabulary"), (262144, "vocabulary"), (-1, "vocabulary"),
                                        ("7", "malformed"), (3.0, "malformed"), (True, "malformed")])
def test_an_id_outside_the_vocabulary_or_not_an_integer_is_found_before_anything_is_sent(token, kind):
    def poison(out):
        out[5].tokens[9] = token
    reference = Reference()
    event = audit(reference, outputs(change=poison), outputs())
    assert not audit_passed(event) and event.verdict.test == "invalid"
    [entry] = event.invalid
    assert (entry.side, entry.kind, entry.request, entry.position) == ("candidate", kind, 5, 9)
    assert event.requests == 0 and reference.seen == 8  # only the control was scored
    assert kind in event.verdict.reason and "request 5" in event.verdict.reason


def test_a_wrong_count_of_tokens_is_the_candidates():
    def short(out):
        out[2].tokens = out[2].tokens[:12]
    [entry] = invalid_outputs(outputs(change=short), VOCAB, 16)
    assert (entry.kind, entry.limit) == ("count", 16) and "12 tokens where 16" in entry.detail
    assert audit(Reference(), outputs(change=short)).verdict.test == "invalid"


def test_ids_the_reference_refuses_are_the_candidates_once_it_answers_the_harnesss_own_prompt():
    """4050 is inside the model's vocabulary (4096) but not the tokenizer's (4000): the pre-check lets it through,
    the reference answers HTTP 400, and a probe with the harness's prompt alone shows the reference is up."""
    def refused(out):
        out[3].tokens[0] = 4050
    for status in (400, 500):  # a 5xx is asked again once, then weighed the same way
        event = audit(Reference(status=status), outputs(change=refused), outputs())
        assert event.verdict.test == "invalid" and [e.kind for e in event.invalid] == ["refused"]
        assert f"HTTP {status}" in event.invalid[0].detail and "answered the harness's own prompt" in event.invalid[0].detail
        assert event.control_verdict is None  # no A/A given here: the control is not judged


def test_a_reference_that_stops_answering_is_an_outage_not_the_candidates():
    with pytest.raises(ReferenceFailed, match="failed while auditing tokens"):
        audit(Reference(answers=3), outputs(), outputs())

    def refused(out):
        out[0].tokens[0] = 4050
    with pytest.raises(ReferenceFailed, match="does not answer the harness's own prompt either"):
        audit(Reference(answers=1), outputs(change=refused)[:1])  # refused, then down for the probe too


def test_a_control_with_invalid_outputs_fails_its_own_verdict_and_is_no_reference():
    calibration = run_audit(0, Reference(), outputs(), RULE, 10, 0.95, None, None, 0, True)
    def poison(out):
        out[1].tokens[4] = 99999
    event = audit(Reference(), outputs(), outputs(change=poison), calibration=calibration)
    assert audit_passed(event) and event.verdict.reference == "calibration"
    assert not event.control_verdict.passed and event.control_verdict.test == "invalid"
    assert [e.side for e in event.invalid] == ["control"]


def test_replay_re_derives_an_invalid_verdict_and_refuses_a_forged_one():
    def poison(out):
        out[5].tokens[9] = 5000
    event = audit(Reference(), outputs(change=poison), outputs())
    _check_audit(event, 7, RULE, Acceptance(), {})
    forged = event.model_copy(deep=True)
    forged.invalid[0].token = 17  # inside the vocabulary: the record does not say what it claims
    with pytest.raises(TraceError, match="trace line 7: .*is not what it says"):
        _check_audit(forged, 7, RULE, Acceptance(), {})
    hidden = event.model_copy(deep=True)
    hidden.invalid = []  # the invalid output dropped, the rejection kept: the verdict no longer follows
    with pytest.raises(TraceError, match="trace line 7: .*does not follow"):
        _check_audit(hidden, 7, RULE, Acceptance(), {})
