"""The agent loop alone, its parts given by hand: a scripted `ask` in place of the proposer's model call, a transcript,
the tools and an allowance. What a newcomer changes is one part; the loop drives any of them the same way."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.proposers.agent import FAILED, TEXT_FALLBACK, Agent, Ended
from agent.proposers.budget import Allowance
from agent.proposers.clients import Completion, LlmRequestError, LlmTransientError, Price, Redactor
from agent.proposers.tools import Answer, Result, Toolbox
from agent.proposers.transcript import Transcript
from tests.proposers.test_llm_proposer import NO_MATCH, VALID, checkout  # noqa: F401 (fixture)
from traces.schema import ToolCall

SURFACE = (["vllm/v1/*"], ["vllm/entrypoints/*"])
GREEDY = "def greedy(logits):\n    return logits.argmax(dim=-1)\n"


class ScriptedAsk:
    """The model call as the loop sees it: each call answers the next scripted completion (or raises it), and keeps
    the request it was given."""

    def __init__(self, *answers: Completion | Exception):
        self.answers, self.requests = list(answers), []

    def __call__(self, messages, temperature, offer) -> Completion:
        self.requests.append({"messages": json.loads(json.dumps(messages)), "temperature": temperature,
                              "offer": offer})
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def calls(*pairs: tuple[str, dict]) -> Completion:
    return Completion(text="", finish_reason="tool_calls", usage={"prompt_tokens": 10, "completion_tokens": 5},
                      tool_calls=[{"id": f"c{n}", "name": name, "arguments": json.dumps(args)}
                                  for n, (name, args) in enumerate(pairs)])


def agent(ask: ScriptedAsk, checkout: Path, protocol: str = "native", calls_allowed: int | None = 10,
          tools=None) -> tuple[Agent, list]:
    recorded: list = []
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    transcript = Transcript(opening, protocol, 1, Redactor(), "max_tokens (100)")
    allowance = Allowance(Price(), 100, "max_tokens", calls=calls_allowed)
    return Agent(ask=ask, transcript=transcript, tools=tools or Toolbox(checkout, *SURFACE), allowance=allowance,
                 record=recorded.append), recorded


def test_the_loop_asks_carries_out_answers_and_returns_the_accepted_change(checkout):
    ask = ScriptedAsk(calls(("list_dir", {"path": "vllm/v1/sample"})),
                      calls(("propose", {"summary": "argmax", "functions": [
                          {"path": "vllm/v1/sample/sampler.py", "name": "greedy", "code": GREEDY}]}),
                            ("read_file", {"path": "vllm/v1/sample/sampler.py"})))
    loop, recorded = agent(ask, checkout)
    result = loop.run(0.0)
    assert result.patch is not None and result.patch.files == ["vllm/v1/sample/sampler.py"]
    assert [(e.name, e.ok) for e in recorded] == [("list_dir", True), ("propose", True), ("read_file", False)]
    assert recorded[2].result == "skipped: a change was already accepted in this answer"
    assert all(isinstance(e, ToolCall) for e in recorded)
    second = ask.requests[1]
    assert {t["function"]["name"] for t in second["offer"]} >= {"read_file", "propose"}
    assert second["messages"][2]["tool_calls"][0]["function"]["name"] == "list_dir"
    assert second["messages"][3] == {"role": "tool", "tool_call_id": "c0", "content": recorded[0].result}
    assert loop.allowance.used == 2 and loop.allowance.tokens_spent == 30


def test_each_way_a_conversation_ends(checkout):
    read = ("read_file", {"path": "vllm/v1/sample/sampler.py"})
    loop, _ = agent(ScriptedAsk(calls(("list_dir", {})), calls(("grep", {"pattern": "x"}))), checkout,
                    calls_allowed=2)
    with pytest.raises(Ended, match=r"^budget: 2 tool calls \(tool_budget.calls\) without an accepted proposal$"):
        loop.run(0.0)
    loop, _ = agent(ScriptedAsk(*[calls(read)] * 4), checkout)
    with pytest.raises(Ended, match=r"^stuck: 3 repeated tool calls in a row"):
        loop.run(0.0)
    loop, _ = agent(ScriptedAsk(LlmTransientError("503 server error: down")), checkout)
    with pytest.raises(Ended) as ended:
        loop.run(0.0)
    assert str(ended.value) == FAILED + "transient: 503 server error: down"
    refused = LlmRequestError("400 request refused: \"auto\" tool choice requires --enable-auto-tool-choice")
    loop, _ = agent(ScriptedAsk(refused), checkout)
    with pytest.raises(Ended) as ended:
        loop.run(0.0)
    assert str(ended.value).endswith(TEXT_FALLBACK)


def test_a_conversation_without_read_tools_offers_none_and_its_answer_is_the_proposal(checkout):
    """`proposer.tools: off`: the same loop, the answer itself the only call. A rejected answer ends the turn with its
    reason, its reply (what was wrong) already in the conversation for a follow-up; no tool call is recorded."""
    seen: dict[str, int] = {}
    answer = Answer(checkout, *SURFACE, seen, "max_tokens (100)")
    ask = ScriptedAsk(Completion(text=NO_MATCH, finish_reason="stop"))
    loop, recorded = agent(ask, checkout, protocol="answer", calls_allowed=None, tools=answer)
    with pytest.raises(Ended, match=r"^match: block 1: the SEARCH text does not occur"):
        loop.run(0.0)
    assert ask.requests[0]["offer"] is None and recorded == []
    assert loop.transcript.messages[2] == {"role": "assistant", "content": NO_MATCH}
    assert loop.transcript.messages[3]["content"].startswith("Your answer could not be used: match: block 1")
    loop.ask = ScriptedAsk(Completion(text=VALID, finish_reason="stop"))
    result = loop.run(0.7)
    assert result.patch is not None and "return logits.argmax(dim=-1)" in result.patch.diff
    assert loop.transcript.messages[-1] == {"role": "assistant", "content": VALID}  # accepted: no reply after it
    loop.ask = ScriptedAsk(Completion(text=VALID[:40], finish_reason="length"))
    with pytest.raises(Ended, match=r"^truncated: the answer hit max_tokens \(100\)"):
        loop.run(0.7)


def test_a_tool_of_ones_own_runs_through_the_same_loop(checkout):
    """The loop asks nothing of its tools but `run(call) -> Result`: a tool set of one's own needs no change to it."""
    class Echo:
        def run(self, call):
            arguments = json.loads(call["arguments"])
            return Result(f"echo {arguments['word']}", patch=None if arguments["word"] != "done" else
                          Toolbox(checkout, *SURFACE).call("propose", {"summary": "s", "functions": [
                              {"path": "vllm/v1/sample/sampler.py", "name": "greedy", "code": GREEDY}]}).patch)

    ask = ScriptedAsk(calls(("echo", {"word": "hello"})), calls(("echo", {"word": "done"})))
    loop, recorded = agent(ask, checkout, tools=Echo())
    assert loop.run(None).patch is not None
    assert [e.result for e in recorded] == ["echo hello", "echo done"]
    assert [r["temperature"] for r in ask.requests] == [None, None]
