"""One conversation of the LLM proposer, after mini-swe-agent's loop: ask the model, carry out the calls its answer
makes, answer each, and go on until a change is accepted or the conversation ends.

The loop is all here; its parts are each in a module of their own: the budget (agent/proposers/budget.py: what the
conversation may still spend), the transcript (agent/proposers/transcript.py: the messages in the endpoint's protocol,
and what the trace keeps of each call) and the tools (agent/proposers/tools.py: the read-only looks and `propose`, or,
in a conversation without read tools, the answer itself). What opens a conversation, and what follows one that ended,
is the proposer's (agent/proposers/llm.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from agent.proposers.budget import Allowance
from agent.proposers.clients import Completion, LlmError, Messages, tools_unsupported
from agent.proposers.shims import Repeats
from agent.proposers.tools import TOOLS, Answer, Result, Toolbox
from agent.proposers.transcript import Transcript
from traces.schema import AnyEvent

FAILED = "LLM call failed: "
TEXT_FALLBACK = " (tools are offered as text from now on)"
"""Ends the reason of a conversation whose endpoint refused the tools API: the proposer offers them as text after."""


class Ended(Exception):
    """The conversation ended without an accepted change; the message is why, as its `proposal_invalid` says."""


@dataclass
class Agent:
    ask: Callable[[Messages, float | None, list[dict[str, Any]] | None], Completion]
    """One model call (the proposer's `ask`: retried through outages, recorded, its tokens counted). An LlmError
    from it ends the conversation; ProposerExhausted ends the proposal."""
    transcript: Transcript
    tools: Toolbox | Answer
    allowance: Allowance
    record: Callable[[AnyEvent], None]
    repeats: Repeats = field(default_factory=lambda: Repeats(set(TOOLS)))

    def run(self, temperature: float | None) -> Result:
        """Turns until a change is accepted (its Result); raises Ended when the conversation ends without one."""
        while True:
            if why := self.allowance.exceeded(self.transcript):
                raise Ended(why)
            try:
                completion = self.ask(self.transcript.messages, temperature, self.transcript.offer())
            except LlmError as exc:  # an endpoint without the tools API says so: tools as text from now on
                fallback = self.transcript.protocol == "native" and tools_unsupported(exc)
                raise Ended(FAILED + exc.record() + (TEXT_FALLBACK if fallback else "")) from None
            self.allowance.turn(completion.usage)
            calls = self.transcript.calls(completion)
            if not calls:
                self.transcript.nudge(completion)
                self.allowance.take()  # a turn without a call counts as one
                continue
            self.transcript.assistant(completion, calls)
            accepted: Result | None = None
            for call in calls:
                result = self.carry_out(call, accepted)
                if (event := self.transcript.result(call, result)) is not None:
                    self.record(event)
                if result.final:
                    raise Ended(result.text)
                if result.patch is not None and accepted is None:
                    accepted = result
            if accepted is not None:
                return accepted
            if why := self.repeats.stuck():
                raise Ended(why)

    def carry_out(self, call: dict[str, Any], accepted: Result | None) -> Result:
        """One call's answer: skipped after an accepted change or past the allowance, a pointer for a repeat, else the
        tool's answer; with the calls left counted down near the end."""
        if accepted is not None:
            return Result("skipped: a change was already accepted in this answer", ok=False)
        if not self.allowance.take():
            return Result(f"skipped: {self.allowance.spent}", ok=False)
        pointer = self.repeats.pointer(str(call.get("name", "")), call.get("arguments", ""), self.allowance.used)
        return self.allowance.countdown(Result(pointer, ok=False) if pointer is not None else self.tools.run(call))
