"""The LLM proposer against loopback servers that enforce real endpoints' request contracts (tests/fake_providers.py):
an OpenAI reasoning model, Gemini's OpenAI-compatible endpoint with thought signatures, Anthropic's OpenAI SDK
compatibility layer, and `vllm serve` with tool calling. Each contract both ways: the fake refuses the request that
provider refuses, and nightshift's request passes. Then what keeps a night going: outages waited out, an idle (not
total) timeout, every billed token counted, and settings that cannot work together refused at `validate`."""
from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
import yaml
from typer.testing import CliRunner

from agent.proposers.base import ProposerExhausted
from agent.proposers.clients import LlmRequestError, OpenAIModel, ReplayModel, billed_usage, tools_unsupported
from agent.proposers.llm import LlmProposer
from agent.world.task import TaskError, load_task, parse_task
from fake_openai_server import FakeOpenAI
from fake_providers import Anthropic, Gemini, OpenAIReasoning, Vllm
from scripted_models import sampler_expert
from tests.proposers.test_llm_proposer import VALID, Run, checkout, key, make_task, run_started  # noqa: F401 (fixtures)
from traces.log import TraceWriter
from traces.schema import LlmCall, ProposalInvalid

ROOT = Path(__file__).resolve().parents[2]


def tools_task(base_url: str, **proposer):
    return make_task(base_url, tools="native", **proposer)


def raw(server: FakeOpenAI, **body):
    """One request as another client would send it (not streamed): the contract's answer."""
    client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
    try:
        return client.chat.completions.create(model="m", messages=body.pop("messages", [{"role": "user",
                                                                                        "content": "hi"}]), **body)
    finally:
        client.close()


def bodies(server: FakeOpenAI) -> list[dict]:
    return [r["body"] for r in server.requests]


def unnumbered(script: list[dict]) -> list[dict]:
    """The script without tool call ids: the provider names its calls."""
    return [{**s, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in s.get("tool_calls", [])]}
            for s in script]


# ------------------------------------------------------------------------------------ OpenAI reasoning models
def test_openai_reasoning_contract_refuses_max_tokens_and_a_temperature():
    with FakeOpenAI(default={"text": "ok"}, contract=OpenAIReasoning()) as server:
        with pytest.raises(openai.BadRequestError, match="'max_tokens' is not supported with this model"):
            raw(server, max_tokens=100)
        with pytest.raises(openai.BadRequestError, match="'temperature' does not support 0"):
            raw(server, max_completion_tokens=100, temperature=0)
        with pytest.raises(openai.BadRequestError, match="Invalid value: 'extreme'"):
            raw(server, max_completion_tokens=100, reasoning_effort="extreme")
        assert raw(server, max_completion_tokens=100, reasoning_effort="high").choices[0].message.content == "ok"
        assert len(server.refused) == 3


def test_the_former_request_is_refused_by_a_reasoning_model(checkout, key):
    """What every run against a reasoning model met before: the default request (max_tokens, temperature 0)."""
    with FakeOpenAI(default={"text": VALID}, contract=OpenAIReasoning()) as server:
        model = OpenAIModel(server.base_url, "o-model", "NIGHTSHIFT_TEST_KEY", timeout_s=5)
        with pytest.raises(LlmRequestError, match="max_completion_tokens"):
            model.complete([{"role": "user", "content": "hi"}], temperature=0.0, max_tokens=100)
        model.close()


def test_a_reasoning_model_runs_a_whole_conversation_and_its_reasoning_tokens_are_billed(checkout, key):
    contract = OpenAIReasoning(reasoning_tokens=700)
    with FakeOpenAI(script=sampler_expert(), contract=contract) as server:
        run = Run(tools_task(server.base_url, temperature=None, max_tokens=None, max_completion_tokens=3000,
                             context_tokens=16000, reasoning_effort="high"), checkout)
        proposal = run.propose()
    assert server.refused == [] and "return logits.argmax(dim=-1)" in proposal.patch
    for body in bodies(server):
        assert "max_tokens" not in body and "temperature" not in body
        assert body["max_completion_tokens"] == 3000 and body["reasoning_effort"] == "high"
    calls = [e for e in run.events if isinstance(e, LlmCall)]
    assert len(calls) == 5 and all(c.usage["reasoning_tokens"] == 700 for c in calls)
    assert not any(isinstance(e, ProposalInvalid) for e in run.events)
    assert all(c.usage["completion_tokens"] > 700 for c in calls)  # the reasoning is inside the billed output
    assert run.proposer.tokens_out == sum(c.usage["completion_tokens"] for c in calls)
    expected = sum(c.usage["prompt_tokens"] * 2.0 + c.usage["completion_tokens"] * 8.0 for c in calls) / 1e6
    assert run.proposer.spend_usd == pytest.approx(expected)
    assert calls[0].params["max_completion_tokens"] == 3000 and "temperature" not in calls[0].params


def test_an_unset_temperature_stays_unset_on_a_fresh_conversation(checkout, key):
    stuck = [{"text": "", "tool_calls": [{"id": f"c{i}", "name": "list_dir", "arguments": {"path": "vllm"}}]}
             for i in range(4)]
    with FakeOpenAI(script=stuck + sampler_expert(), contract=OpenAIReasoning()) as server:
        run = Run(tools_task(server.base_url, temperature=None, max_tokens=None, max_completion_tokens=3000,
                             context_tokens=16000), checkout)
        run.propose()
    assert server.refused == [] and any(e.reason.startswith("stuck") for e in run.events
                                        if isinstance(e, ProposalInvalid))
    assert all("temperature" not in b for b in bodies(server))


# ---------------------------------------------------------------------------------------- Gemini, signatures
def test_gemini_contract_refuses_a_turn_without_its_thought_signature():
    tool = {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {}}}}
    with FakeOpenAI(script=[{"tool_calls": [{"name": "list_dir", "arguments": {}}]}],
                    default={"text": "done"}, contract=Gemini()) as server:
        first = raw(server, tools=[tool]).choices[0].message
        signed = first.model_dump(exclude_none=True)
        assert signed["tool_calls"][0]["extra_content"]["google"]["thought_signature"].startswith("sig-")
        stripped = json.loads(json.dumps(signed))
        del stripped["tool_calls"][0]["extra_content"]
        history = [{"role": "user", "content": "hi"}]
        answer = {"role": "tool", "tool_call_id": signed["tool_calls"][0]["id"], "content": "a b"}
        with pytest.raises(openai.BadRequestError, match="missing a thought_signature"):
            raw(server, tools=[tool], messages=[*history, stripped, answer])
        assert raw(server, tools=[tool], messages=[*history, signed, answer]).choices[0].message.content == "done"
        with pytest.raises(openai.BadRequestError, match="cannot both be set"):
            raw(server, reasoning_effort="low",
                extra_body={"extra_body": {"google": {"thinking_config": {"thinking_budget": 10}}}})


def test_gemini_signatures_go_back_verbatim_and_replay_keeps_them(checkout, key, tmp_path):
    writer = TraceWriter(tmp_path / "trace.jsonl")
    writer.append(run_started())
    with FakeOpenAI(script=sampler_expert(), contract=Gemini(thoughts_tokens=300)) as server:
        run = Run(tools_task(server.base_url, reasoning_effort="low"), checkout, writer=writer)
        proposal = run.propose()
    writer.close()
    assert server.refused == [] and proposal.patch
    turn2 = bodies(server)[1]["messages"]
    sent = [m for m in turn2 if m.get("role") == "assistant"][0]
    assert sent["tool_calls"][0]["extra_content"]["google"]["thought_signature"].startswith("sig-call_1_0")
    calls = [e for e in run.events if isinstance(e, LlmCall)]
    assert calls[0].message["tool_calls"][0]["extra_content"]["google"]["thought_signature"]
    # the thinking tokens are reported beside completion_tokens (the total holds them): billed all the same
    assert all(c.usage["reasoning_tokens"] == 300 and c.usage["total_tokens"] == c.usage["prompt_tokens"]
               + c.usage["completion_tokens"] for c in calls)
    assert all(c.usage["completion_tokens"] >= 300 for c in calls)
    # replay: the recorded messages (signatures included) come back, and the same conversation is rebuilt
    model = ReplayModel.from_trace(tmp_path / "trace.jsonl", strict=True)
    again = Run(tools_task("http://127.0.0.1:9/v1", reasoning_effort="low"), checkout, model=model)
    assert again.propose().patch == proposal.patch and model.mismatches == [] and model.remaining == 0
    replayed = [e for e in again.events if isinstance(e, LlmCall)]
    assert [c.messages for c in replayed] == [c.messages for c in calls]


def test_gemini_provider_fields_pass_through_extra_body(checkout, key):
    extra = {"extra_body": {"google": {"thinking_config": {"thinking_budget": 2048, "include_thoughts": False}}}}
    with FakeOpenAI(script=sampler_expert(), contract=Gemini()) as server:
        run = Run(tools_task(server.base_url, extra_body=extra), checkout)
        run.propose()
    assert server.refused == [] and all(b["extra_body"] == extra["extra_body"] for b in bodies(server))


# ------------------------------------------------------------------------------------------------- Anthropic
def test_anthropic_contract_refuses_n_and_a_thinking_budget_over_the_cap():
    with FakeOpenAI(default={"text": "ok"}, contract=Anthropic()) as server:
        with pytest.raises(openai.BadRequestError, match="n=1"):
            raw(server, n=2)
        thinking = {"thinking": {"type": "enabled", "budget_tokens": 4000}}
        with pytest.raises(openai.BadRequestError, match="greater than `thinking.budget_tokens`"):
            raw(server, max_completion_tokens=2000, extra_body=thinking)
        with pytest.raises(openai.BadRequestError, match="temperature` may only be set to 1"):
            raw(server, max_completion_tokens=8000, temperature=0, extra_body=thinking)
        assert raw(server, max_completion_tokens=8000, extra_body=thinking).choices[0].message.content == "ok"


def test_anthropic_with_extended_thinking_runs_a_whole_conversation(checkout, key):
    with FakeOpenAI(script=unnumbered(sampler_expert()), contract=Anthropic()) as server:
        run = Run(tools_task(server.base_url, temperature=None, max_tokens=None, max_completion_tokens=3000,
                             context_tokens=16000,
                             extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}}), checkout)
        proposal = run.propose()
    assert server.refused == [] and proposal.patch
    assert all(b["thinking"]["budget_tokens"] == 1024 and b["max_completion_tokens"] == 3000 for b in bodies(server))
    tool_ids = [m["tool_call_id"] for m in bodies(server)[-1]["messages"] if m.get("role") == "tool"]
    assert len(tool_ids) == 4 and all(i.startswith("toolu_") for i in tool_ids)  # one conversation throughout
    assert not any(isinstance(e, ProposalInvalid) for e in run.events)


# ---------------------------------------------------------------------------------------------- vllm serve
def test_vllm_contract_refuses_tools_without_auto_tool_choice_and_a_prompt_over_max_model_len():
    tool = {"type": "function", "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {}}}}
    with FakeOpenAI(default={"text": "ok"}, contract=Vllm(auto_tool_choice=False, max_model_len=50)) as server:
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            raw(server, tools=[tool])
        with pytest.raises(openai.BadRequestError, match="maximum context length is 50"):
            raw(server, max_tokens=60)
        assert raw(server, tools=[tool], tool_choice="required").choices[0].message.content == "ok"


def test_vllm_with_tool_calling_and_a_reasoning_parser(checkout, key):
    with FakeOpenAI(script=sampler_expert(), contract=Vllm(reasoning="let me think " * 20)) as server:
        run = Run(tools_task(server.base_url, api_key_env=None), checkout)
        proposal = run.propose()
    assert server.refused == [] and proposal.patch
    sent = [m for m in bodies(server)[1]["messages"] if m.get("role") == "assistant"][0]
    assert sent["reasoning_content"].startswith("let me think")  # the message as the server sent it


def test_vllm_without_tools_switches_to_text_and_another_400_naming_a_tool_does_not(checkout, key):
    with FakeOpenAI(script=[{"text": "", "tool_calls": [{"name": "list_dir", "arguments": {"path": "vllm"}}]},
                            {"status": 400, "message": "Invalid 'messages[3].tool_calls[0].id': string too long"},
                            *sampler_expert()],
                    contract=Vllm()) as server:
        run = Run(tools_task(server.base_url, attempts_per_proposal=2), checkout)
        run.propose()
    assert run.proposer.protocol == "native"
    reason = next(e.reason for e in run.events if isinstance(e, ProposalInvalid))
    assert "string too long" in reason and not reason.endswith("from now on)")
    assert bodies(server)[-1].get("tools")
    with FakeOpenAI(script=[{"text": VALID}], contract=Vllm(auto_tool_choice=False)) as server:
        run = Run(tools_task(server.base_url, attempts_per_proposal=2), checkout)
        run.propose()
    assert run.proposer.protocol == "text" and len(server.refused) == 1
    assert "tools" not in bodies(server)[-1]


def test_tools_unsupported_is_recognized_only_from_its_messages():
    yes = ['"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
           "registry.ollama.ai/library/x does not support tools", "tools param requires --jinja flag",
           "Unsupported parameter: 'tools' is not supported with this model."]
    no = ["Invalid 'messages[3].tool_calls[0].id': string too long", "messages with role 'tool' must be a response",
          "This model's maximum context length is 8192 tokens"]
    assert all(tools_unsupported(LlmRequestError(f"400 request refused: {m}")) for m in yes)
    assert not any(tools_unsupported(LlmRequestError(f"400 request refused: {m}")) for m in no)


# --------------------------------------------------------------------------------- nothing transient ends it
def test_an_outage_is_waited_out_with_growing_backoff(checkout, key):
    outage = [{"status": 503, "message": "overloaded"}] * 9
    with FakeOpenAI(script=[*outage, *sampler_expert()], contract=Vllm()) as server:
        sleeps: list[float] = []
        task = tools_task(server.base_url, max_retries=None, retry_backoff_s=1.0, retry_max_backoff_s=120,
                          budget={"wall_clock_s": 3600})
        run = Run(task, checkout)
        run.proposer._sleep = sleeps.append
        proposal = run.propose()
    assert proposal.patch and sleeps == [1, 2, 4, 8, 16, 32, 64, 120, 120]
    failed = [e for e in run.events if isinstance(e, LlmCall) and e.error]
    assert len(failed) == 9 and all("503 server error: overloaded" in e.error for e in failed)


def test_an_outage_past_the_run_wall_clock_ends_it_cleanly(checkout, key):
    with FakeOpenAI(default={"status": 503, "message": "down"}) as server:
        run = Run(tools_task(server.base_url, max_retries=None, retry_backoff_s=0.2), checkout)
        run.proposer.deadline = time.monotonic() + 1.5
        started = time.monotonic()
        with pytest.raises(ProposerExhausted, match="wall clock"):
            run.propose()
    assert time.monotonic() - started < 6
    assert any(isinstance(e, ProposalInvalid) and e.reason.startswith("LLM call failed: transient: 503")
               for e in run.events)


def test_conversations_ended_by_an_outage_are_recorded_and_not_counted(checkout, key):
    down = {"status": 500, "message": "upstream exploded"}
    with FakeOpenAI(script=[down, down, down, *sampler_expert()]) as server:
        run = Run(tools_task(server.base_url, max_retries=0, attempts_per_proposal=1), checkout)
        proposal = run.propose()
    invalid = [e.reason for e in run.events if isinstance(e, ProposalInvalid)]
    assert len(invalid) == 3 and all(r.startswith("LLM call failed: transient: 500") for r in invalid)
    assert proposal.patch


def test_a_long_answer_that_keeps_streaming_is_not_cut(checkout, key):
    with FakeOpenAI(script=[{"text": VALID, "chunk_delay": 0.25}]) as server:
        run = Run(make_task(server.base_url, request_timeout_s=1), checkout)
        started = time.monotonic()
        proposal = run.propose()
    assert time.monotonic() - started > 1.5 and proposal.patch  # longer than the idle timeout, never idle that long
    assert [e.kind for e in run.events] == ["llm_call", "proposal"]


def test_an_answer_that_stalls_is_cut_and_its_tokens_are_counted(checkout, key):
    with FakeOpenAI(script=[{"text": VALID * 4, "stall": 3}, {"text": VALID}]) as server:
        run = Run(make_task(server.base_url, request_timeout_s=1), checkout)
        run.propose()
    cut, done = [e for e in run.events if isinstance(e, LlmCall)]
    assert cut.error.startswith("transient: timeout: nothing received for 1s")
    assert cut.usage["estimated"] == 1 and cut.usage["prompt_tokens"] > 0 and cut.usage["completion_tokens"] > 0
    assert cut.cost_usd > 0
    assert run.proposer.spend_usd == pytest.approx(cut.cost_usd + done.cost_usd, rel=1e-4)
    assert run.proposer.tokens_used == sum(c.usage["prompt_tokens"] + c.usage["completion_tokens"] for c in (cut, done))


def test_billed_usage_counts_reasoning_either_way():
    inside = billed_usage({"prompt_tokens": 10, "completion_tokens": 50, "total_tokens": 60,
                           "completion_tokens_details": {"reasoning_tokens": 40}})
    beside = billed_usage({"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 60,
                           "completion_tokens_details": {"reasoning_tokens": 40}})
    no_total = billed_usage({"prompt_tokens": 10, "completion_tokens": 10,
                             "completion_tokens_details": {"reasoning_tokens": 40}})
    assert inside["completion_tokens"] == beside["completion_tokens"] == no_total["completion_tokens"] == 50
    assert billed_usage({"prompt_tokens": 3, "completion_tokens": 4}) == {"prompt_tokens": 3, "completion_tokens": 4,
                                                                        "total_tokens": 7}


# ---------------------------------------------------------------------------------------- validate and tasks
@pytest.mark.parametrize("proposer, budget, names", [
    ({"max_tokens": 12000, "context_tokens": 12000}, {}, ["proposer.max_tokens (12000)", "proposer.context_tokens"]),
    ({"max_tokens": None, "max_completion_tokens": 20000}, {},
     ["proposer.max_completion_tokens (20000)", "proposer.context_tokens (12000)"]),
    ({"max_tokens": 1000, "max_completion_tokens": 1000}, {},
     ["proposer.max_tokens or proposer.max_completion_tokens"]),
    ({"max_tokens": None}, {}, ["proposer.max_tokens or proposer.max_completion_tokens"]),
    ({"tools": "native", "tool_budget": {"tokens": 2000}}, {}, ["proposer.tool_budget.tokens (2000)",
                                                                "proposer.max_tokens (2048)"]),
    ({"tool_choice": "required"}, {}, ["proposer.tool_choice", "proposer.tools"]),
    ({}, {"max_llm_tokens": 2000}, ["budget.max_llm_tokens (2000)", "proposer.max_tokens (2048)"]),
    ({"price": {"output_per_mtok": 100.0}}, {"max_usd": 0.1}, ["budget.max_usd", "proposer.price"]),
])
def test_settings_that_cannot_work_together_are_refused_by_name(tmp_path, proposer, budget, names):
    data = yaml.safe_load((ROOT / "tasks" / "gemma4-tiny-cpu-llm.yaml").read_text())
    data["proposer"] = {k: v for k, v in data["proposer"].items()
                        if k not in ("max_tokens", "context_tokens", "tools", "tool_budget", "tool_choice")}
    data["proposer"].update(proposer)
    data["budget"].update(budget)
    with pytest.raises(TaskError) as info:
        parse_task(data, "t.yaml", ROOT / "tasks")
    for name in names:
        assert name in str(info.value)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**data, "model": {**data["model"], "synthetic": {
        **data["model"]["synthetic"], "config": str(ROOT / "tasks" / data["model"]["synthetic"]["config"])}}}))
    from agent.face.cli import app

    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code != 0 and names[0] in (result.output + str(result.exception))


@pytest.mark.parametrize("name", ["gemma4-e2b-llm.yaml", "gemma4-tiny-cpu-llm.yaml"])
def test_the_built_in_llm_tasks_validate_and_take_their_endpoint_from_the_environment(name, monkeypatch):
    from agent.face.cli import app

    result = CliRunner().invoke(app, ["validate", str(ROOT / "tasks" / name)])
    assert result.exit_code == 0, result.output
    task = load_task(ROOT / "tasks" / name)
    assert task.proposer.kind == "llm" and task.proposer.tools == "native"
    monkeypatch.setenv("NIGHTSHIFT_LLM_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("NIGHTSHIFT_LLM_MODEL", "some-model")
    monkeypatch.setenv("NIGHTSHIFT_LLM_KEY", "sk-test-0123456789abcdef")
    proposer = LlmProposer.from_task(task, profile="(none)")
    assert (proposer.model.base_url, proposer.model.name) == ("http://127.0.0.1:9/v1", "some-model")
    assert "sk-test-0123456789abcdef" in proposer.redactor.secrets


def test_the_e2b_llm_task_is_the_e2b_task_with_the_llm():
    e2b, llm = load_task(ROOT / "tasks" / "gemma4-e2b.yaml"), load_task(ROOT / "tasks" / "gemma4-e2b-llm.yaml")
    for section in ("target", "model", "engine", "workload", "parity", "benchmark", "acceptance", "audit",
                    "edit_surface", "sandbox"):
        assert getattr(e2b, section) == getattr(llm, section), section
    spec = llm.proposer
    assert spec.temperature is None and spec.max_completion_tokens and spec.max_tokens is None
    assert spec.answer_tokens < spec.context_tokens
