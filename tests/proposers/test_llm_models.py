"""The model classes without any server: FakeModel, ReplayModel, the redactor, retries, the config."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from agent.proposers.clients import (
    Completion, FakeModel, LlmAuthError, LlmError, LlmRequestError, LlmTransientError, Price, Redactor,
    ReplayExhausted, ReplayModel, complete_with_retries, error_from_record,
)
from agent.proposers.base import ProposalContext
from agent.proposers.llm import LlmProposer
from agent.world.task import TaskError, parse_task
from traces.schema import LlmCall


def task_dict(**proposer):
    return {
        "name": "t", "target": {"vllm_version": "0.32.0"}, "model": {"synthetic": {"config": "c.json"}},
        "workload": {"num_prompts": 1, "input_len": 4, "output_len": 4},
        "parity": {"num_prompts": 1, "input_len": 4, "max_tokens": 4},
        "edit_surface": {"include": ["vllm/*"]}, "budget": {"max_candidates": 2, "wall_clock_s": 10},
        "proposer": {"kind": "llm", "base_url": "http://127.0.0.1:1/v1", "model": "m", "profile": False, **proposer},
    }


def test_config_defaults_and_the_key_is_never_a_field():
    task = parse_task(task_dict())
    assert task.proposer.kind == "llm" and task.proposer.api_key_env == "OPENAI_API_KEY"
    assert task.proposer.repair_turns == 1 and task.proposer.price.input_per_mtok == 0
    with pytest.raises(TaskError, match="api_key_env"):
        parse_task(task_dict(api_key_env="sk-live-1234567890abcdef"))
    with pytest.raises(TaskError, match="repair_turns"):
        parse_task(task_dict(repair_turns=3))
    with pytest.raises(TaskError, match="api_key"):
        parse_task(task_dict(api_key="sk-live-1234567890abcdef"))


def test_price():
    assert Price(3.0, 15.0).cost({"prompt_tokens": 1_000_000, "completion_tokens": 100_000}) == pytest.approx(4.5)


def test_redactor():
    r = Redactor(["hunter2-secret"])
    text = "key hunter2-secret, sk-abcdefghijklmnopqrstu, Authorization: Bearer abcdefghijklmnop1234, api_key=zzzzzzzzzz"
    out = r.text(text)
    assert "hunter2" not in out and "sk-abc" not in out and "abcdefghijklmnop1234" not in out and "zzzzzzzzzz" not in out
    assert r.obj([{"content": "hunter2-secret"}]) == [{"content": "[REDACTED]"}]


def test_errors_round_trip_through_the_trace_text():
    for error in (LlmTransientError("429 rate limited"), LlmAuthError("401 nope"), LlmRequestError("400 too long")):
        again = error_from_record(error.record())
        assert type(again) is type(error) and str(again) == str(error)


def test_retries_are_bounded_and_only_for_transient_errors():
    class Flaky:
        name, params = "flaky", {}

        def __init__(self, errors):
            self.errors, self.calls = list(errors), 0

        def complete(self, messages, *, temperature, max_tokens):
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            return Completion("ok", "stop")

    sleeps, failures = [], []
    model = Flaky([LlmTransientError("500"), LlmTransientError("429")])
    out = complete_with_retries(model, [], temperature=0, max_tokens=1, max_retries=3, backoff_s=0.5,
                                on_failure=lambda e, s: failures.append(str(e)), sleep=sleeps.append)
    assert out.text == "ok" and model.calls == 3 and failures == ["500", "429"]
    assert sleeps == [0.5, 1.0]  # exponential
    model = Flaky([LlmTransientError("500")] * 10)
    with pytest.raises(LlmTransientError):
        complete_with_retries(model, [], temperature=0, max_tokens=1, max_retries=2, backoff_s=100, sleep=sleeps.append)
    assert model.calls == 3 and max(sleeps) <= 30  # capped
    model = Flaky([LlmAuthError("401")])
    with pytest.raises(LlmAuthError):
        complete_with_retries(model, [], temperature=0, max_tokens=1, max_retries=5, backoff_s=0.1, sleep=sleeps.append)
    assert model.calls == 1


def test_replay_model_plays_back_answers_and_errors_in_order():
    calls = [LlmCall(candidate=1, model="m", params={}, messages=[], response=None, finish_reason=None,
                     latency_s=0.1, error="transient: 429 rate limited"),
             LlmCall(candidate=1, model="m", params={}, messages=[], response="hi", finish_reason="stop",
                     usage={"prompt_tokens": 3, "completion_tokens": 1}, latency_s=0.2)]
    model = ReplayModel(calls)
    with pytest.raises(LlmTransientError, match="429"):
        model.complete([], temperature=0, max_tokens=1)
    out = model.complete([], temperature=0, max_tokens=1)
    assert (out.text, out.finish_reason, out.usage) == ("hi", "stop", {"prompt_tokens": 3, "completion_tokens": 1})
    with pytest.raises(ReplayExhausted):
        model.complete([], temperature=0, max_tokens=1)


def test_fake_model_makes_valid_edits_end_to_end(tmp_path: Path):
    root = tmp_path / "co"
    (root / "vllm/v1").mkdir(parents=True)
    (root / "vllm/v1/x.py").write_text("def f():\n    return 1\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    task = parse_task(task_dict())
    proposer = LlmProposer.from_task(task, model=FakeModel(), profile="(none)")
    events = []
    ctx = ProposalContext(task=task, candidate=1, checkout=root, incumbent_args={}, record=lambda e: events.append(e) or "")
    proposal = proposer.propose(ctx)
    assert [e.kind for e in events] == ["llm_call"] and "+# nightshift fake model note 1" in proposal.patch
    (root / "p.diff").write_text(proposal.patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=root, check=True)
    assert "# nightshift fake model note 1" in (root / "vllm/v1/x.py").read_text()
    ctx.candidate = 2
    assert proposer.propose(ctx).patch != proposal.patch  # never the same candidate twice


def test_llm_errors_know_nothing_of_proposers():
    from agent.proposers.base import ProposerExhausted

    for error in (LlmTransientError("x"), LlmAuthError("x"), ReplayExhausted("x")):
        assert not isinstance(error, ProposerExhausted)
    assert isinstance(LlmAuthError("x"), LlmError) and LlmAuthError("x").record() == "auth: x"
    assert not isinstance(ReplayExhausted("x"), LlmError)  # nothing retries or records it as a failed call
    assert ProposerExhausted("done").kind == "exhausted" and ProposerExhausted("bad key", kind="fatal").kind == "fatal"
