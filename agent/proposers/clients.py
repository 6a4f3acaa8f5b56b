"""LLM backends for the LLM proposer: one Protocol, three plain classes.

- `OpenAIModel` talks to any OpenAI-compatible endpoint (a hosted provider or a local
  `vllm serve`) through the `openai` client, streaming, with a hard deadline per request.
- `ReplayModel` feeds back the responses recorded in a trace's `llm_call` events, in order,
  so that `nightshift replay` reruns the loop without any LLM (as SWE-agent's replay model).
- `FakeModel` is deterministic and needs nothing: demos and tests.

`Model.complete` makes exactly one attempt and raises a typed `LlmError` on failure;
`complete_with_retries` adds tenacity's bounded exponential backoff for transient errors.
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from traces.schema import LlmCall

Messages = list[dict[str, Any]]


# ----------------------------------------------------------------------------------------- errors
class LlmError(Exception):
    """One failed attempt at an LLM call. `kind` prefixes the message recorded in the trace."""

    kind = "error"
    transient = False

    def __init__(self, message: str, status: int | None = None, usage: dict[str, int] | None = None):
        super().__init__(message)
        self.status = status
        self.usage: dict[str, int] = dict(usage or {})
        """What the failed attempt was billed, as far as can be told: a cut or timed-out answer's prompt and the
        tokens streamed before the cut (estimated, `estimated: 1`); empty for a refusal (4xx, 5xx, 429)."""

    def record(self) -> str:
        return f"{self.kind}: {self}"


class LlmTransientError(LlmError):
    """429, 5xx, timeouts, refused connections, broken streams: worth another try after a pause."""

    kind = "transient"
    transient = True


class LlmRequestError(LlmError):
    """The endpoint refused this one request (e.g. 400: prompt too long). Recorded and skipped."""

    kind = "request"


class LlmFatalError(LlmError):
    """The LLM can not be used at all in this run (bad key, unknown model): stop with this message."""

    kind = "fatal"


class LlmAuthError(LlmFatalError):
    """401 or 403: the key is missing, wrong, or not allowed to use this model."""

    kind = "auth"


class ReplayExhausted(Exception):
    """The recorded run (or the fake model's script) had no more LLM calls. Not an LlmError: it is
    no failed call, and nothing records or retries it."""


_ERROR_KINDS: dict[str, type[LlmError]] = {
    cls.kind: cls for cls in (LlmError, LlmTransientError, LlmRequestError, LlmFatalError, LlmAuthError)
}


def error_from_record(text: str) -> LlmError:
    kind, _, message = text.partition(": ")
    cls = _ERROR_KINDS.get(kind, LlmError)
    return cls(message if kind in _ERROR_KINDS else text)


# ------------------------------------------------------------------------------------- responses
@dataclass
class Completion:
    text: str
    finish_reason: str | None
    usage: dict[str, int] = field(default_factory=dict)
    model: str = ""
    latency_s: float = 0.0
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    """Native tool calls of the answer: {id, name, arguments}, arguments as the JSON text the model wrote."""
    message: dict[str, Any] | None = None
    """The assistant message as the endpoint sent it, provider fields included (a tool call's `extra_content`,
    a reasoning text): what the next turn sends back. None where the model has none to give (fakes, old traces)."""


@dataclass
class Price:
    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0

    def cost(self, usage: dict[str, int]) -> float:
        return (usage.get("prompt_tokens", 0) * self.input_per_mtok
                + usage.get("completion_tokens", 0) * self.output_per_mtok) / 1e6


def estimate_tokens(text: str) -> int:
    """A cheap, tokenizer-free estimate (about 3.5 characters a token for code and English)."""
    return max(1, int(len(text) / 3.5)) if text else 0


_COUNTED = {"role", "content", "tool_calls", "tool_call_id", "name"}


def messages_tokens(messages: Messages) -> int:
    total = 0
    for m in messages:
        total += estimate_tokens(str(m.get("content") or "")) + estimate_tokens(str(m.get("tool_calls") or "")) + 4
        extra = {k: v for k, v in m.items() if k not in _COUNTED and v}
        if extra:  # provider fields kept verbatim (a reasoning text, signatures) are sent back too
            total += estimate_tokens(json.dumps(extra, default=str))
    return total


def billed_usage(raw: dict[str, Any]) -> dict[str, int]:
    """The usage an endpoint reported, with every billed output token in `completion_tokens`: OpenAI counts the
    reasoning tokens inside completion_tokens, some OpenAI-compatible endpoints report them beside it (then the
    total says so); `reasoning_tokens` is kept where reported."""
    def num(value: Any) -> int:
        try:
            return max(0, int(value or 0))
        except (TypeError, ValueError):
            return 0

    prompt, completion = num(raw.get("prompt_tokens")), num(raw.get("completion_tokens"))
    total = num(raw.get("total_tokens"))
    details = raw.get("completion_tokens_details") or {}
    reasoning = num(details.get("reasoning_tokens") if isinstance(details, dict) else 0)
    if total:
        completion = max(completion, total - prompt)
    elif reasoning > completion:  # reported beside the answer, with no total to tell: they cannot be inside it
        completion += reasoning
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if reasoning:
        usage["reasoning_tokens"] = reasoning
    return usage


_TOOLS_UNSUPPORTED = re.compile(
    r"enable-auto-tool-choice|tool-call-parser|does not support tools|tools? (?:are|is) not supported"
    r"|unsupported parameter:? '?tools'?|'tools' is not supported|tool use is not supported"
    r"|tool calling is not supported|does not support (?:function|tool) calling|--jinja", re.I)


def tools_unsupported(error: "LlmError") -> bool:
    """Whether a refused request says the endpoint does not take the tools API at all (vLLM without
    --enable-auto-tool-choice, a model without tool support, llama.cpp without --jinja), as opposed to any other 400
    whose text happens to name a tool (a bad tool message, a prompt too long)."""
    return isinstance(error, LlmRequestError) and bool(_TOOLS_UNSUPPORTED.search(str(error)))


class Model(Protocol):
    name: str
    params: dict[str, Any]
    """What goes into each `LlmCall.params` besides the per-call ones (never a secret)."""

    def complete(self, messages: Messages, *, temperature: float | None, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> Completion:
        """One attempt, offering `tools` (OpenAI function definitions) when given; a temperature of None is not
        sent. Raises LlmError (or a subclass) when it fails."""


# --------------------------------------------------------------------------------------- secrets
_SECRET_PATTERNS = [
    re.compile(r"\bsk-[A-Za-z0-9_\-]{12,}"),
    re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9_\-\.=]{12,}"),
    re.compile(r"(?i)\b(api[_-]?key|authorization|x-api-key)(\"?\s*[:=]\s*\"?)[A-Za-z0-9_\-\.=]{8,}"),
]


class Redactor:
    """Filters secrets out of everything that goes into the trace: the configured key, verbatim,
    and anything shaped like a bearer token or an `sk-...` key."""

    def __init__(self, secrets: Iterable[str | None] = ()):
        self.secrets = sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True)

    def text(self, value: str | None) -> str | None:
        if value is None:
            return None
        for secret in self.secrets:
            value = value.replace(secret, "[REDACTED]")
        value = _SECRET_PATTERNS[0].sub("[REDACTED]", value)
        value = _SECRET_PATTERNS[1].sub(lambda m: f"{m.group(1)} [REDACTED]", value)
        value = _SECRET_PATTERNS[2].sub(lambda m: f"{m.group(1)}{m.group(2)}[REDACTED]", value)
        return value

    def obj(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.obj(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.obj(v) for v in value]
        return value


# ----------------------------------------------------------------------------------- OpenAIModel
def transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library errors a broken stream raises past openai's own: `httpx.HTTPError` under openai 1.x,
    `httpx2.HTTPError` under the openai releases built on httpx2 (whichever of the two is installed)."""
    import importlib

    found = []
    for name in ("httpx", "httpx2"):
        try:
            found.append(importlib.import_module(name).HTTPError)
        except (ImportError, AttributeError):
            continue
    return tuple(found)


class OpenAIModel:
    """Any OpenAI-compatible chat completions endpoint, streamed, one attempt per `complete`.

    The key is read from the environment variable named `api_key_env` when the model is made and is kept only in
    memory. `timeout_s` is an idle timeout: the socket's connect and read timeouts, so an endpoint that is down or
    goes silent (before its answer or between two chunks) never hangs the run, while a long answer that keeps
    streaming is never cut; `answer_timeout_s`, when set, also caps one answer's whole duration.

    The request carries the task's fields as the endpoint wants them: the answer's cap under `token_field`
    (`max_tokens` or `max_completion_tokens`), `reasoning_effort` when set, no temperature when it is None, and
    `extra_body` merged into the JSON. The assistant message is rebuilt from the stream with every field the
    endpoint sent (a tool call's `extra_content` with Gemini's thought signature, a reasoning text), so that the
    next turn can send it back verbatim."""

    def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY",
                 timeout_s: float = 120.0, extra_body: dict[str, Any] | None = None, tool_choice: str = "auto",
                 token_field: str = "max_tokens", reasoning_effort: str | None = None,
                 answer_timeout_s: float | None = None):
        import openai

        self.name = model
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.timeout_s = float(timeout_s)
        self.answer_timeout_s = float(answer_timeout_s) if answer_timeout_s else None
        self.extra_body = dict(extra_body or {})
        self.tool_choice = tool_choice
        """Sent with every request that offers tools; "auto" is the API's default and is not sent."""
        if token_field not in ("max_tokens", "max_completion_tokens"):
            raise ValueError(f"token_field must be max_tokens or max_completion_tokens, not {token_field!r}")
        self.token_field = token_field
        self.reasoning_effort = reasoning_effort
        key = os.environ.get(api_key_env) if api_key_env else None
        self.redactor = Redactor([key])
        self.params = {"base_url": self.base_url, "api_key_env": api_key_env, "timeout_s": self.timeout_s,
                       "stream": True, **({"tool_choice": tool_choice} if tool_choice != "auto" else {}),
                       **({"reasoning_effort": reasoning_effort} if reasoning_effort else {}),
                       **({"answer_timeout_s": self.answer_timeout_s} if self.answer_timeout_s else {}),
                       **({"extra_body": self.redactor.obj(self.extra_body)} if self.extra_body else {})}
        self._client = openai.OpenAI(
            base_url=self.base_url, api_key=key or "EMPTY", max_retries=0,
            # openai's own Timeout: httpx's before openai 2, httpx2's after (which refuses an httpx.Timeout)
            timeout=openai.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)),
        )

    def close(self) -> None:
        self._client.close()

    def request(self, messages: Messages, temperature: float | None, max_tokens: int,
                tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The keyword arguments of `chat.completions.create` for one request."""
        kwargs: dict[str, Any] = {"model": self.name, "messages": messages, "stream": True,
                                  "stream_options": {"include_usage": True}, self.token_field: max_tokens}
        if temperature is not None:
            kwargs["temperature"] = temperature
        if self.reasoning_effort:
            kwargs["reasoning_effort"] = self.reasoning_effort
        if tools:
            kwargs["tools"] = tools
            if self.tool_choice != "auto":
                kwargs["tool_choice"] = self.tool_choice
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        return kwargs

    def complete(self, messages: Messages, *, temperature: float | None, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> Completion:
        import openai

        started = time.monotonic()
        text: list[str] = []
        reasoning: list[str] = []
        extras: dict[str, Any] = {}
        calls: dict[int, dict[str, Any]] = {}
        finish_reason: str | None = None
        usage: dict[str, int] = {}
        served_model = ""
        accepted = False  # the endpoint took the request (its answer began): the prompt is billed

        def spent() -> dict[str, int]:
            """A failed attempt's bill: the usage if it came, else an estimate of the prompt and what streamed."""
            if usage:
                return dict(usage)
            if not accepted:
                return {}
            streamed = "".join(text) + "".join(reasoning) + "".join(c["arguments"] for c in calls.values())
            out = {"prompt_tokens": messages_tokens(messages), "completion_tokens": estimate_tokens(streamed),
                   "estimated": 1}
            out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
            return out

        try:
            stream = self._client.chat.completions.create(**self.request(messages, temperature, max_tokens, tools))
            accepted = True
            try:
                for chunk in stream:
                    if self.answer_timeout_s is not None and time.monotonic() - started > self.answer_timeout_s:
                        raise LlmTransientError(f"timeout: the answer took over answer_timeout_s "
                                                f"{self.answer_timeout_s:g}s", usage=spent())
                    served_model = chunk.model or served_model
                    if chunk.usage is not None:
                        usage = billed_usage(chunk.usage.model_dump())
                    for choice in chunk.choices or []:
                        delta = choice.delta
                        if delta is not None:
                            if delta.content:
                                text.append(delta.content)
                            for key, value in (delta.model_extra or {}).items():
                                if key in ("reasoning_content", "reasoning") and isinstance(value, str):
                                    reasoning.append(value)
                                _merge(extras, key, value)
                            for piece in delta.tool_calls or []:
                                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": "",
                                                                      "type": "function", "extra": {},
                                                                      "function_extra": {}})
                                call["id"] = piece.id or call["id"]
                                call["type"] = piece.type or call["type"]
                                for key, value in (piece.model_extra or {}).items():
                                    _merge(call["extra"], key, value)
                                if piece.function is not None:
                                    call["name"] += piece.function.name or ""
                                    call["arguments"] += piece.function.arguments or ""
                                    for key, value in (piece.function.model_extra or {}).items():
                                        _merge(call["function_extra"], key, value)
                        if choice.finish_reason:
                            finish_reason = choice.finish_reason
            finally:
                stream.close()
        except LlmError:
            raise
        except (openai.AuthenticationError, openai.PermissionDeniedError) as exc:
            raise LlmAuthError(
                f"{exc.status_code} from {self.base_url}: the endpoint refused the key "
                f"(${self.api_key_env or '<no key variable>'} "
                f"{'is set' if self.api_key_env and os.environ.get(self.api_key_env) else 'is not set'}): "
                f"{self._detail(exc)}", exc.status_code) from None
        except openai.NotFoundError as exc:
            raise LlmFatalError(f"404 from {self.base_url}: model {self.name!r} or the endpoint was not found: "
                                f"{self._detail(exc)}", 404) from None
        except openai.RateLimitError as exc:
            raise LlmTransientError(f"429 rate limited: {self._detail(exc)}", 429) from None
        except openai.APITimeoutError:
            raise LlmTransientError(f"timeout: nothing received for {self.timeout_s:g}s (request_timeout_s)",
                                    usage=spent() or _prompt_only(messages)) from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise LlmTransientError(f"connection failed: {type(cause).__name__}: {cause}", usage=spent()) from None
        except openai.APIStatusError as exc:
            if exc.status_code >= 500 or exc.status_code in (408, 409):
                raise LlmTransientError(f"{exc.status_code} server error: {self._detail(exc)}",
                                        exc.status_code) from None
            raise LlmRequestError(f"{exc.status_code} request refused: {self._detail(exc)}",
                                  exc.status_code) from None
        except openai.APIError as exc:  # an error event inside the stream
            raise LlmTransientError(f"stream error: {exc}", usage=spent()) from None
        except (*transport_errors(), ConnectionError, TimeoutError) as exc:
            timed_out = "timeout" in type(exc).__name__.lower()
            what = f"timeout: nothing received for {self.timeout_s:g}s (request_timeout_s)" if timed_out else \
                f"broken stream: {type(exc).__name__}: {exc}"
            raise LlmTransientError(what, usage=spent()) from None
        if finish_reason is None:
            raise LlmTransientError("broken stream: it ended without a finish_reason", usage=spent())
        content = "".join(text)
        if not usage:
            usage = spent() or {"prompt_tokens": messages_tokens(messages), "completion_tokens": 0, "estimated": 1}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        tool_calls = [{"id": calls[i]["id"] or f"call_{i}", "name": calls[i]["name"],
                       "arguments": calls[i]["arguments"]} for i in sorted(calls)]
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if tool_calls else ""),
                                   **{k: v for k, v in extras.items() if k not in ("role", "content", "tool_calls")}}
        if tool_calls:
            message["tool_calls"] = [
                {"id": call["id"], "type": calls[i]["type"] or "function",
                 "function": {"name": call["name"], "arguments": call["arguments"], **calls[i]["function_extra"]},
                 **calls[i]["extra"]}
                for i, call in zip(sorted(calls), tool_calls)]
        return Completion(text=content, finish_reason=finish_reason, usage=usage,
                          model=served_model or self.name, latency_s=time.monotonic() - started,
                          tool_calls=tool_calls, message=message)

    @staticmethod
    def _detail(exc: Exception) -> str:
        body = getattr(exc, "body", None)
        if isinstance(body, dict):
            inner = body.get("error")
            message = inner.get("message") if isinstance(inner, dict) else body.get("message")
            if message:
                return str(message)[:500]
        return str(exc)[:500]


def _merge(into: dict[str, Any], key: str, value: Any) -> None:
    """One streamed field into the message being rebuilt: text pieces are joined, objects merged key by key, other
    values kept as last sent (a None never replaces a value)."""
    if value is None:
        return
    have = into.get(key)
    if isinstance(have, str) and isinstance(value, str):
        into[key] = have + value
    elif isinstance(have, dict) and isinstance(value, dict):
        for k, v in value.items():
            _merge(have, k, v)
    else:
        into[key] = json.loads(json.dumps(value, default=str)) if isinstance(value, (dict, list)) else value


def _prompt_only(messages: Messages) -> dict[str, int]:
    """A request that timed out before its answer began may still have been read (and billed) by the endpoint."""
    prompt = messages_tokens(messages)
    return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt, "estimated": 1}


# ----------------------------------------------------------------------------------- ReplayModel
ELIDED = "(elided to fit proposer.context_tokens: an earlier tool result; call the tool again if you need it)"
"""What an elided tool result reads (agent/proposers/tools.py `fit`)."""


def message_delta(previous: Messages, current: Messages) -> tuple[int, list[int]]:
    """(prefix, elided): how many of `current`'s first messages are `previous`'s, some perhaps with their content
    elided since (those indexes). An `llm_call` records `current[prefix:]` with both."""
    elided: list[int] = []
    n = 0
    for n, (old, new) in enumerate(zip(previous, current)):
        if old == new:
            continue
        if new.get("content") == ELIDED and {**old, "content": ELIDED} == new:
            elided.append(n)
            continue
        return n, [i for i in elided if i < n]
    n = min(len(previous), len(current))
    return n, elided


def expand_messages(calls: Iterable[LlmCall]) -> list[Messages]:
    """Each recorded call's whole request, in order: a call with `prefix` takes that many of the previous call's
    messages (eliding those it names) and appends its own; one without (every trace written before deltas) is
    whole as it stands."""
    out: list[Messages] = []
    previous: Messages = []
    for call in calls:
        head = json.loads(json.dumps(previous[:call.prefix])) if call.prefix else []
        for i in call.elided:
            if i < len(head):
                head[i]["content"] = ELIDED
        previous = head + json.loads(json.dumps(call.messages))
        out.append(previous)
    return out


class ReplayModel:
    """Feeds back a recorded run's LLM answers (and failures) in order; no endpoint needed.

    Give it the `llm_call` events of a trace (or the trace path). Each `complete` returns the
    next recorded response, or raises the recorded error again, so the proposer takes the same
    path it took when the run was recorded. With `strict`, the messages must also be the same."""

    def __init__(self, calls: Iterable[LlmCall], name: str | None = None, strict: bool = False):
        self.calls = list(calls)
        self.requests = expand_messages(self.calls)
        """Each call's whole request, rebuilt from the trace's deltas."""
        self.position = 0
        self.strict = strict
        self.name = name or (self.calls[0].model if self.calls else "replay")
        self.params = {"replay": True}
        self.mismatches: list[int] = []

    @classmethod
    def from_trace(cls, path: Path, **kwargs: Any) -> "ReplayModel":
        from traces.log import read_trace

        return cls([r.event for r in read_trace(Path(path)) if isinstance(r.event, LlmCall)], **kwargs)

    @property
    def remaining(self) -> int:
        return len(self.calls) - self.position

    def complete(self, messages: Messages, *, temperature: float | None, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> Completion:
        if self.position >= len(self.calls):
            raise ReplayExhausted(f"the recorded run made only {len(self.calls)} LLM call(s)")
        call, request = self.calls[self.position], self.requests[self.position]
        self.position += 1
        if [m.get("content") for m in messages] != [m.get("content") for m in request]:
            self.mismatches.append(self.position - 1)
            if self.strict:
                raise ReplayExhausted(f"replay diverged at LLM call {self.position}: the messages differ")
        if call.error is not None:
            error = error_from_record(call.error)
            error.usage = dict(call.usage)
            raise error
        return Completion(text=call.response or "", finish_reason=call.finish_reason, usage=dict(call.usage),
                          model=call.model, latency_s=0.0, tool_calls=[dict(c) for c in call.tool_calls],
                          message=json.loads(json.dumps(call.message)) if call.message is not None else None)


# ------------------------------------------------------------------------------------- FakeModel
class FakeModel:
    """A deterministic stand-in for an LLM, for demos and tests.

    With `responses`, it answers them in order (cycling). Without, it writes a harmless, valid
    edit: it takes the first file shown in full in the prompt and inserts a comment line after
    that file's first line that is not blank, so the patch applies, builds and keeps parity."""

    def __init__(self, responses: list[str] | None = None, name: str = "fake", cycle: bool = True):
        self.responses = list(responses or [])
        self.cycle = cycle
        self.name = name
        self.params = {"fake": True}
        self.calls = 0

    def complete(self, messages: Messages, *, temperature: float | None, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> Completion:
        index = self.calls
        self.calls += 1
        if self.responses:
            if index >= len(self.responses) and not self.cycle:
                raise ReplayExhausted("the fake model has no more scripted responses")
            text = self.responses[index % len(self.responses)]
        else:
            text = self._edit_from_prompt(str(messages[-1].get("content", "")), index)
        text = text[: max_tokens * 4]
        usage = {"prompt_tokens": messages_tokens(messages), "completion_tokens": estimate_tokens(text)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return Completion(text=text, finish_reason="stop", usage=usage, model=self.name, latency_s=0.0)

    _FILE = re.compile(r"^### FILE (\S+)(?: \(lines (\d+)-(\d+)\))?\n```[a-z]*\n(.*?)\n```", re.M | re.S)

    def _edit_from_prompt(self, prompt: str, index: int) -> str:
        for match in self._FILE.finditer(prompt):
            path, body = match.group(1), match.group(4)
            for line in body.splitlines():
                if line.strip():
                    return (f"SUMMARY: note on {path} (fake model, proposal {index + 1})\n\n{path}\n"
                            f"<<<<<<< SEARCH\n{line}\n=======\n{line}\n# nightshift fake model note {index + 1}\n"
                            f">>>>>>> REPLACE\n")
        return "I have no file to edit."


def complete_with_retries(model: Model, messages: Messages, *, temperature: float | None, max_tokens: int,
                          max_retries: int | None, backoff_s: float, deadline_s: float | None = None,
                          tools: list[dict[str, Any]] | None = None,
                          on_failure: Callable[[LlmError, float], None] = lambda e, s: None,
                          sleep: Callable[[float], None] = time.sleep, max_backoff_s: float = 30.0,
                          clock: Callable[[], float] = time.monotonic) -> Completion:
    """`model.complete`, retried with tenacity on transient errors: exponential backoff (backoff_s, 2x, ... at most
    max_backoff_s), at most `max_retries` retries (None: no count), and no pause that would pass `deadline_s`
    seconds from the first attempt (with max_retries None, the deadline is what ends an outage's wait).
    `on_failure(error, latency)` sees every failed attempt, transient or not, before it is retried or raised."""
    import tenacity

    if max_retries is None and deadline_s is None:
        raise ValueError("an unbounded count of retries needs a deadline")
    started = clock()
    slept = [0.0]

    def elapsed() -> float:  # a sleep that does not pass the clock's time (a test's) still counts
        return max(clock() - started, slept[0])

    def pause_for(seconds: float) -> None:
        slept[0] += seconds
        sleep(seconds)

    def attempt() -> Completion:
        t0 = time.monotonic()
        try:
            if tools:
                return model.complete(messages, temperature=temperature, max_tokens=max_tokens, tools=tools)
            return model.complete(messages, temperature=temperature, max_tokens=max_tokens)
        except LlmError as exc:
            on_failure(exc, time.monotonic() - t0)
            raise

    first = min(backoff_s, max_backoff_s)
    growing = tenacity.wait_exponential(multiplier=first, min=first, max=max_backoff_s)

    def wait(state: tenacity.RetryCallState) -> float:
        pause = growing(state)
        if deadline_s is not None:
            pause = min(pause, max(0.0, deadline_s - elapsed()))
        return pause

    def out_of_time(state: tenacity.RetryCallState) -> bool:
        return deadline_s is not None and elapsed() >= deadline_s

    stop = tenacity.stop_any(tenacity.stop_after_attempt(max_retries + 1) if max_retries is not None
                             else tenacity.stop_never, out_of_time)
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, LlmError) and e.transient),
        stop=stop, wait=wait, sleep=pause_for, reraise=True,
    )
    return retrying(attempt)
