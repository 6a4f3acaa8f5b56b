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

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

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


def messages_tokens(messages: Messages) -> int:
    return sum(estimate_tokens(str(m.get("content") or "")) + estimate_tokens(str(m.get("tool_calls") or ""))
               + 4 for m in messages)


class Model(Protocol):
    name: str
    params: dict[str, Any]
    """What goes into each `LlmCall.params` besides the per-call ones (never a secret)."""

    def complete(self, messages: Messages, *, temperature: float, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> Completion:
        """One attempt, offering `tools` (OpenAI function definitions) when given. Raises LlmError (or a
        subclass) when it fails."""


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

    The key is read from the environment variable named `api_key_env` when the model is made
    and is kept only in memory. Every request has a hard deadline of `timeout_s`: connect and
    read timeouts on the socket, plus a wall-clock check between streamed chunks, so an LLM
    that is down, silent or slow never hangs the run."""

    def __init__(self, base_url: str, model: str, api_key_env: str | None = "OPENAI_API_KEY",
                 timeout_s: float = 120.0, extra_body: dict[str, Any] | None = None, tool_choice: str = "auto"):
        import openai

        self.name = model
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.timeout_s = float(timeout_s)
        self.extra_body = dict(extra_body or {})
        self.tool_choice = tool_choice
        """Sent with every request that offers tools; "auto" is the API's default and is not sent."""
        key = os.environ.get(api_key_env) if api_key_env else None
        self.redactor = Redactor([key])
        self.params = {"base_url": self.base_url, "api_key_env": api_key_env, "timeout_s": self.timeout_s,
                       "stream": True, **({"tool_choice": tool_choice} if tool_choice != "auto" else {})}
        self._client = openai.OpenAI(
            base_url=self.base_url, api_key=key or "EMPTY", max_retries=0,
            # openai's own Timeout: httpx's before openai 2, httpx2's after (which refuses an httpx.Timeout)
            timeout=openai.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)),
        )

    def close(self) -> None:
        self._client.close()

    def complete(self, messages: Messages, *, temperature: float, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> Completion:
        import openai

        started = time.monotonic()
        deadline = started + self.timeout_s
        text: list[str] = []
        calls: dict[int, dict[str, str]] = {}
        finish_reason: str | None = None
        usage: dict[str, int] = {}
        served_model = ""
        try:
            stream = self._client.chat.completions.create(
                model=self.name, messages=messages, temperature=temperature, max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True}, extra_body=self.extra_body or None,
                **({"tools": tools} if tools else {}),
                **({"tool_choice": self.tool_choice} if tools and self.tool_choice != "auto" else {}),
            )
            try:
                for chunk in stream:
                    if time.monotonic() > deadline:
                        raise LlmTransientError(f"timeout: no complete answer within {self.timeout_s:g}s")
                    served_model = chunk.model or served_model
                    if chunk.usage is not None:
                        usage = {k: int(v) for k, v in chunk.usage.model_dump().items()
                                 if k in ("prompt_tokens", "completion_tokens", "total_tokens") and v is not None}
                    for choice in chunk.choices or []:
                        if choice.delta is not None and choice.delta.content:
                            text.append(choice.delta.content)
                        for piece in (choice.delta.tool_calls if choice.delta is not None else None) or []:
                            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                            call["id"] = piece.id or call["id"]
                            if piece.function is not None:
                                call["name"] += piece.function.name or ""
                                call["arguments"] += piece.function.arguments or ""
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
            raise LlmTransientError(f"timeout: no answer within {self.timeout_s:g}s") from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise LlmTransientError(f"connection failed: {type(cause).__name__}: {cause}") from None
        except openai.APIStatusError as exc:
            if exc.status_code >= 500 or exc.status_code in (408, 409):
                raise LlmTransientError(f"{exc.status_code} server error: {self._detail(exc)}",
                                        exc.status_code) from None
            raise LlmRequestError(f"{exc.status_code} request refused: {self._detail(exc)}",
                                  exc.status_code) from None
        except openai.APIError as exc:  # an error event inside the stream
            raise LlmTransientError(f"stream error: {exc}") from None
        except (*transport_errors(), ConnectionError, TimeoutError) as exc:
            raise LlmTransientError(f"broken stream: {type(exc).__name__}: {exc}") from None
        if finish_reason is None:
            raise LlmTransientError("broken stream: it ended without a finish_reason")
        content = "".join(text)
        if not usage:
            usage = {"prompt_tokens": messages_tokens(messages), "completion_tokens": estimate_tokens(content),
                     "estimated": 1}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        tool_calls = [{**calls[i], "id": calls[i]["id"] or f"call_{i}"} for i in sorted(calls)]
        return Completion(text=content, finish_reason=finish_reason, usage=usage,
                          model=served_model or self.name, latency_s=time.monotonic() - started, tool_calls=tool_calls)

    @staticmethod
    def _detail(exc: Exception) -> str:
        body = getattr(exc, "body", None)
        if isinstance(body, dict):
            inner = body.get("error")
            message = inner.get("message") if isinstance(inner, dict) else body.get("message")
            if message:
                return str(message)[:500]
        return str(exc)[:500]


# ----------------------------------------------------------------------------------- ReplayModel
class ReplayModel:
    """Feeds back a recorded run's LLM answers (and failures) in order; no endpoint needed.

    Give it the `llm_call` events of a trace (or the trace path). Each `complete` returns the
    next recorded response, or raises the recorded error again, so the proposer takes the same
    path it took when the run was recorded. With `strict`, the messages must also be the same."""

    def __init__(self, calls: Iterable[LlmCall], name: str | None = None, strict: bool = False):
        self.calls = list(calls)
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

    def complete(self, messages: Messages, *, temperature: float, max_tokens: int,
                 tools: list[dict[str, Any]] | None = None) -> Completion:
        if self.position >= len(self.calls):
            raise ReplayExhausted(f"the recorded run made only {len(self.calls)} LLM call(s)")
        call = self.calls[self.position]
        self.position += 1
        if [m.get("content") for m in messages] != [m.get("content") for m in call.messages]:
            self.mismatches.append(self.position - 1)
            if self.strict:
                raise ReplayExhausted(f"replay diverged at LLM call {self.position}: the messages differ")
        if call.error is not None:
            raise error_from_record(call.error)
        return Completion(text=call.response or "", finish_reason=call.finish_reason, usage=dict(call.usage),
                          model=call.model, latency_s=0.0, tool_calls=[dict(c) for c in call.tool_calls])


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

    def complete(self, messages: Messages, *, temperature: float, max_tokens: int,
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


def complete_with_retries(model: Model, messages: Messages, *, temperature: float, max_tokens: int,
                          max_retries: int, backoff_s: float, deadline_s: float | None = None,
                          tools: list[dict[str, Any]] | None = None,
                          on_failure: Callable[[LlmError, float], None] = lambda e, s: None,
                          sleep: Callable[[float], None] = time.sleep) -> Completion:
    """`model.complete`, retried with tenacity on transient errors: bounded exponential backoff
    (backoff_s, 2x, ... at most 16x backoff_s and 30 s), at most `max_retries` retries, and no
    retry that would start after `deadline_s` seconds. `on_failure(error, latency)` sees every
    failed attempt, transient or not, before it is retried or raised."""
    import tenacity

    def attempt() -> Completion:
        t0 = time.monotonic()
        try:
            if tools:
                return model.complete(messages, temperature=temperature, max_tokens=max_tokens, tools=tools)
            return model.complete(messages, temperature=temperature, max_tokens=max_tokens)
        except LlmError as exc:
            on_failure(exc, time.monotonic() - t0)
            raise

    stop = tenacity.stop_after_attempt(max_retries + 1)
    if deadline_s is not None:
        stop = stop | tenacity.stop_after_delay(deadline_s)
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, LlmError) and e.transient),
        stop=stop,
        wait=tenacity.wait_exponential(multiplier=min(backoff_s, 30.0), min=min(backoff_s, 30.0),
                                       max=min(30.0, backoff_s * 16)),
        sleep=sleep,
        reraise=True,
    )
    return retrying(attempt)
