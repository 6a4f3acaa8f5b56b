"""Request contracts of real OpenAI-compatible endpoints, for the loopback server of tests/fake_openai_server.py.

Each contract refuses, with the provider's status and the gist of its message, the requests that provider refuses,
and shapes its answers the way that provider sends them. Written from the providers' public documentation of their
chat completions endpoints:

- `OpenAIReasoning`: OpenAI's reasoning models take `max_completion_tokens` and refuse `max_tokens` (400,
  unsupported_parameter); they take only the default temperature, 1 (400, unsupported_value, for any other); they
  take `reasoning_effort`; their reasoning tokens are billed as output and counted inside `completion_tokens`
  (usage.completion_tokens_details.reasoning_tokens says how many).
- `Gemini`: Gemini's OpenAI-compatible endpoint returns a thought signature on the first tool call of an answer, as
  `extra_content.google.thought_signature`; a later request whose history holds that call without its signature is
  refused (400): the caller must send it back exactly as received. `reasoning_effort` and the `thinking_config` of
  `extra_body.google` cannot be set together. Its usage counts the thinking tokens beside `completion_tokens`
  (total_tokens includes them).
- `Anthropic`: Anthropic's OpenAI SDK compatibility layer: `n` must be 1; `temperature` is capped at 1, not
  refused; `reasoning_effort` is ignored; extended thinking comes through `thinking` in the body, whose
  `budget_tokens` must be at least 1024 and below the answer's cap, and allows no temperature other than 1; its
  tool call ids are `toolu_...`.
- `Vllm`: `vllm serve`: tools with the default ("auto") tool choice are refused unless the server was started with
  --enable-auto-tool-choice and --tool-call-parser; a prompt plus the answer's cap over max_model_len is refused;
  the chat template reads earlier tool calls' arguments as JSON; a reasoning parser streams `reasoning_content`.

Every contract also checks what all of them refuse: a `tool` message that answers no tool call of an earlier
assistant message.
"""
from __future__ import annotations

import itertools
import json
from typing import Any

from fake_openai_server import _words

Refusal = dict[str, Any]


def refuse(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> Refusal:
    return {"status": status, "message": message, "param": param, "code": code}


class Contract:
    """What every chat completions endpoint refuses; the base of the provider contracts."""

    name = "openai-compatible"

    def check(self, body: dict[str, Any]) -> Refusal | None:
        answered: set[str] = set()
        for i, message in enumerate(body.get("messages") or []):
            if message.get("role") == "assistant":
                answered |= {c.get("id") for c in message.get("tool_calls") or []}
            elif message.get("role") == "tool" and message.get("tool_call_id") not in answered:
                return refuse(f"Invalid parameter: messages[{i}] with role 'tool' must be a response to a preceding "
                              f"message with 'tool_calls'", f"messages.[{i}].role")
        return None

    def shape(self, step: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        return step


class OpenAIReasoning(Contract):
    name = "openai-reasoning"
    EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

    def __init__(self, reasoning_tokens: int = 700):
        self.reasoning_tokens = reasoning_tokens

    def check(self, body: dict[str, Any]) -> Refusal | None:
        if "max_tokens" in body:
            return refuse("Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                          "'max_completion_tokens' instead.", "max_tokens", "unsupported_parameter")
        if "temperature" in body and body["temperature"] != 1:
            return refuse(f"Unsupported value: 'temperature' does not support {body['temperature']} with this model. "
                          "Only the default (1) value is supported.", "temperature", "unsupported_value")
        if "reasoning_effort" in body and body["reasoning_effort"] not in self.EFFORTS:
            return refuse(f"Invalid value: '{body['reasoning_effort']}'. Supported values are: "
                          f"{', '.join(repr(e) for e in self.EFFORTS)}.", "reasoning_effort", "invalid_value")
        return super().check(body)

    def shape(self, step: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """Reasoning tokens billed inside completion_tokens; the reasoning itself is never shown."""
        text = str(step.get("text", ""))
        calls = step.get("tool_calls") or []
        visible = len(text.split()) + (len(json.dumps(calls).split()) if calls else 0)
        prompt = _words(body.get("messages", []))
        completion = visible + self.reasoning_tokens
        step["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion,
                         "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}
        return step


class Gemini(Contract):
    name = "gemini"

    def __init__(self, thoughts_tokens: int = 300):
        self.thoughts_tokens = thoughts_tokens
        self.signatures: dict[str, str] = {}
        """Tool call id -> the signature sent with it."""
        self._ids = itertools.count(1)

    def check(self, body: dict[str, Any]) -> Refusal | None:
        extra = body.get("extra_body") if isinstance(body.get("extra_body"), dict) else {}
        google = extra.get("google") or {}
        if body.get("reasoning_effort") is not None and google.get("thinking_config") is not None:
            return refuse("reasoning_effort and thinking_config cannot both be set")
        for i, message in enumerate(body.get("messages") or []):
            for position, call in enumerate(message.get("tool_calls") or []):
                expected = self.signatures.get(call.get("id"))
                sent = ((call.get("extra_content") or {}).get("google") or {}).get("thought_signature")
                if expected is not None and sent != expected:
                    name = (call.get("function") or {}).get("name")
                    return refuse(f"Function call is missing a thought_signature in functionCall parts. This is "
                                  f"required for tools to work correctly. Additional data, function call "
                                  f"`default_api:{name}`, position {position + 1} of messages[{i}].",
                                  code="INVALID_ARGUMENT")
        return super().check(body)

    def shape(self, step: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        calls = [dict(c) for c in step.get("tool_calls") or []]
        for n, call in enumerate(calls):
            call["id"] = call.get("id") or f"function-call-{next(self._ids)}"
            if n == 0:  # the first call of an answer carries the signature (parallel calls: only the first)
                signature = f"sig-{call['id']}-" + "Q" * 40
                self.signatures[call["id"]] = signature
                call["extra"] = {"extra_content": {"google": {"thought_signature": signature}}}
        if calls:
            step["tool_calls"] = calls
        text = str(step.get("text", ""))
        prompt = _words(body.get("messages", []))
        visible = len(text.split()) + (len(json.dumps(calls).split()) if calls else 0)
        step["usage"] = {"prompt_tokens": prompt, "completion_tokens": visible,
                         "total_tokens": prompt + visible + self.thoughts_tokens,
                         "completion_tokens_details": {"reasoning_tokens": self.thoughts_tokens}}
        return step


class Anthropic(Contract):
    name = "anthropic"

    def __init__(self):
        self._ids = itertools.count(1)

    def check(self, body: dict[str, Any]) -> Refusal | None:
        if body.get("n", 1) != 1:
            return refuse("n: only n=1 is supported", "n")
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            budget = int(thinking.get("budget_tokens") or 0)
            cap = body.get("max_completion_tokens", body.get("max_tokens"))
            if budget < 1024:
                return refuse("thinking.budget_tokens: Input should be greater than or equal to 1024")
            if cap is not None and budget >= int(cap):
                return refuse("`max_tokens` must be greater than `thinking.budget_tokens`")
            if body.get("temperature") not in (None, 1, 1.0):
                return refuse("`temperature` may only be set to 1 when thinking is enabled")
        return super().check(body)

    def shape(self, step: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        calls = [dict(c) for c in step.get("tool_calls") or []]
        for call in calls:
            call["id"] = call.get("id") or f"toolu_{next(self._ids):024d}"
        if calls:
            step["tool_calls"] = calls
        return step


class Vllm(Contract):
    name = "vllm"

    def __init__(self, auto_tool_choice: bool = True, max_model_len: int = 32768, reasoning: str = ""):
        self.auto_tool_choice = auto_tool_choice
        self.max_model_len = max_model_len
        self.reasoning = reasoning

    def check(self, body: dict[str, Any]) -> Refusal | None:
        if body.get("tools") and body.get("tool_choice", "auto") == "auto" and not self.auto_tool_choice:
            return refuse('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        for i, message in enumerate(body.get("messages") or []):
            for call in message.get("tool_calls") or []:
                try:
                    json.loads((call.get("function") or {}).get("arguments") or "")
                except ValueError:
                    return refuse(f"messages[{i}]: the arguments of tool call {call.get('id')!r} are not valid JSON")
        prompt = _words(body.get("messages", []))
        cap = body.get("max_completion_tokens", body.get("max_tokens")) or 0
        if prompt + cap > self.max_model_len:
            return refuse(f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                          f"{prompt + cap} tokens ({prompt} in the messages, {cap} in the completion). Please reduce "
                          f"the length of the messages or completion.")
        return super().check(body)

    def shape(self, step: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        if self.reasoning and "reasoning" not in step:
            step["reasoning"] = self.reasoning
        return step
