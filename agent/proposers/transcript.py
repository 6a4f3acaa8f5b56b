"""One conversation as the model sees it, and what the trace keeps of it.

The messages follow the conversation's protocol:
- `native`, the OpenAI tools API: the endpoint's own assistant message goes back verbatim (a provider's fields, such
  as Gemini's thought signatures, included), and each call is answered by a `tool` message;
- `text`, for an endpoint without the tools API: an answer is one `CALL <tool> {json}` line, or edit blocks, which
  are a `propose`; each is answered by a `RESULT <tool>:` user message;
- `answer`, a conversation without read tools (`proposer.tools: off`): the whole answer is the proposal, and one that
  cannot be used is answered by agent/prompts/invalid.md.
When the conversation must fit its context, the oldest tool results are elided first (`fit`).

The trace keeps each LLM call's new messages, not the whole conversation (`CallLog`): those after the previous
call's request (`prefix`), naming the ones elided since (`elided`); clients.expand_messages rebuilds every request.
"""
from __future__ import annotations

import json
import re
from typing import Any

from agent import prompts
from agent.proposers import shims, tools
from agent.proposers.clients import ELIDED, Completion, Messages, Redactor, message_delta, messages_tokens
from agent.proposers.edits import summary_of
from traces.schema import ToolCall

CALL = re.compile(r"^\s*CALL\s+([A-Za-z_]\w*)\s*", re.M)


class Transcript:
    """The messages of one conversation (the list itself: a conversation continues in it), in its protocol."""

    def __init__(self, messages: Messages, protocol: str, candidate: int, redactor: Redactor, cap: str):
        self.messages, self.protocol, self.candidate, self.redactor = messages, protocol, candidate, redactor
        self.cap = cap
        """The answer's cap as the request sent it, e.g. `max_tokens (2048)`."""

    def offer(self) -> list[dict[str, Any]] | None:
        """The tools offered with each request: the API's definitions, natively; else none (they are in the text)."""
        return tools.definitions() if self.protocol == "native" else None

    def calls(self, completion: Completion) -> list[dict[str, Any]]:
        """The calls an answer makes: the API's tool calls, or those written in its text (one a turn in the text
        protocol: the model sees each answer before it goes on); with no read tools, the answer itself."""
        if self.protocol == "answer":
            return [{"id": "", "name": "answer", "arguments": completion.text,
                     "finish_reason": completion.finish_reason}]
        calls = list(completion.tool_calls) or parse_text_calls(completion.text or "")
        return calls if self.protocol == "native" else calls[:1]

    def assistant(self, completion: Completion, calls: list[dict[str, Any]]) -> None:
        native = self.protocol == "native"
        self.messages.append(assistant_message(
            self.protocol, completion.text, calls if native else [],
            completion.message if native and completion.tool_calls else None))

    def result(self, call: dict[str, Any], result: tools.Result) -> ToolCall | None:
        """Answers one call in the conversation; returns what the trace keeps of it (none for an answer, whose
        rejection the proposer records as unusable)."""
        if self.protocol == "answer":
            if result.patch is None:
                self.messages.append({"role": "user", "content": prompts.load("invalid").substitute(
                    reason=result.text)})
            return None
        call_id, name = str(call.get("id", "")), str(call.get("name", ""))
        self.messages.append(result_message(self.protocol, call_id, name, result.text))
        return ToolCall(candidate=self.candidate, call_id=call_id, name=name[:100],
                        arguments=self.redactor.text(str(call.get("arguments", "")))[:20_000],
                        result=self.redactor.text(result.text) or "", ok=result.ok)

    def nudge(self, completion: Completion) -> None:
        """An answer that called no tool is told so."""
        if completion.finish_reason == "length":
            why = f"your answer was cut off at {self.cap}: say less at a time"
        else:
            why = "your answer called no tool" + ("" if self.protocol == "native" else
                                                  " (answer with one CALL line, or edit blocks to propose)")
        self.messages += [{"role": "assistant", "content": completion.text or "(empty)"},
                          {"role": "user", "content": f"{why}. Call a tool; propose when you have a change."}]

    def fit(self, limit: int) -> bool:
        return fit(self.messages, limit, messages_tokens)


def assistant_message(protocol: str, text: str, calls: list[dict[str, Any]],
                      message: dict[str, Any] | None = None) -> dict[str, Any]:
    """The model's turn as the next request sends it back: the endpoint's own message where it made native calls."""
    if protocol != "native" or not calls:
        return {"role": "assistant", "content": text or "(empty)"}
    if message is not None and message.get("tool_calls"):
        return json.loads(json.dumps(message))
    return {"role": "assistant", "content": text or None,
            "tool_calls": [{"id": c.get("id", ""), "type": "function",
                            "function": {"name": c.get("name", ""), "arguments": c.get("arguments", "")}}
                           for c in calls]}


def result_message(protocol: str, call_id: str, name: str, text: str) -> dict[str, Any]:
    if protocol == "native":
        return {"role": "tool", "tool_call_id": call_id, "content": text}
    return {"role": "user", "content": f"RESULT {name}:\n{text}"}


def parse_text_calls(text: str) -> list[dict[str, str]]:
    """The tool calls of a text-protocol answer: `CALL name {json}` lines, or edit blocks as a propose; else calls
    written as JSON (shims.json_calls)."""
    if re.search(r"^\s*<{3,9}\s*(SEARCH|FUNCTION)\b", text, re.M):
        summary = summary_of(text, [])
        summary = summary if not summary.startswith("edit ") else "change proposed as blocks"
        return [{"id": "text_0", "name": "propose", "arguments": json.dumps({"summary": summary, "blocks": text})}]
    calls = []
    for n, match in enumerate(CALL.finditer(text)):
        rest = text[match.end():]
        arguments = "{}"
        if rest.startswith("{"):
            try:
                value, end = json.JSONDecoder().raw_decode(rest)
                arguments = json.dumps(value)
            except ValueError:
                arguments = rest.split("\n", 1)[0]
        calls.append({"id": f"text_{n}", "name": match.group(1), "arguments": arguments})
    return (calls or shims.json_calls(text))[:1]


def fit(messages: Messages, limit: int, size=messages_tokens, keep_last: int = 2) -> bool:
    """Elide the oldest tool results (in place, never the opening messages or the last `keep_last`) until the
    conversation's estimated size is within `limit`; False if it still is not."""
    for message in messages[2:max(2, len(messages) - keep_last)]:
        if size(messages) <= limit:
            break
        is_result = message.get("role") == "tool" or str(message.get("content") or "").startswith("RESULT ")
        if is_result and message.get("content") != ELIDED:
            message["content"] = ELIDED
    return size(messages) <= limit


class CallLog:
    """What the trace keeps of each LLM call's request: its messages after those of the previous recorded call (a
    failed attempt's too), which replay and resume rebuild from it (clients.expand_messages)."""

    def __init__(self) -> None:
        self.sent: Messages = []
        """The previous call's request as recorded (redacted)."""

    def delta(self, recorded: Messages) -> tuple[Messages, int, list[int]]:
        """(the new messages, how many came before them, the indexes among those elided since)."""
        prefix, elided = message_delta(self.sent, recorded)
        self.sent = recorded
        return recorded[prefix:], prefix, elided
