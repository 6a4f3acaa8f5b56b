"""An OpenAI-compatible chat completions server on loopback that serves scripted responses.

Each request to POST /v1/chat/completions takes the next step of the script:

    {"text": "...", "finish_reason": "stop"}     an answer (streamed as SSE when asked to)
    {"status": 429 | 500 | 401 | 403 | 404 | 400, "message": "..."}
    {"sleep": 5.0}                                 say nothing for that long, then answer "late"
    {"break_stream": True, "text": "..."}          stream part of the text, then drop the socket
    {"garbage": True}                              send bytes that are not an SSE/JSON answer
    {"tool_calls": [{"name": "read_file", "arguments": {...}}, ...], "text": ""}
                                                   call tools (OpenAI tools API; `arguments` a dict is sent as
                                                   its JSON, a string as it is), finish_reason "tool_calls"; a
                                                   call's `extra` (a dict) is sent as fields of the tool call
    {"reasoning": "...", "text": "..."}            stream a reasoning text first (delta `reasoning_content`)
    {"usage": {...}}                               these usage fields in place of the counted ones
    {"chunk_delay": 0.5, "text": "..."}            pause that long before each streamed chunk
    {"stall": 5.0, "text": "..."}                  stream half the text, say nothing for that long, then the rest

A `contract` (tests/fake_providers.py) makes the server enforce a provider's request rules: its `check(body)`
answers an error (`{"status", "message", "param", "code"}`) for a request the provider refuses, before any step
is taken (the refusals are kept in `server.refused`), and its `shape(step, body)` adds what the provider sends
(signatures, its way of counting usage).

A script can be a scripted model's whole exploration: `tests/scripted_models.py` has two.

Requests (headers and JSON body) are kept in `server.requests` for the tests to look at.
Usage is counted as whitespace-separated words (prompt) and words (completion).

    python tests/fake_openai_server.py --port 8999 --text "hello"   # by hand
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def _words(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "").split())
               + (len(json.dumps(m["tool_calls"]).split()) if m.get("tool_calls") else 0) for m in messages)


def _tool_calls(step: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"id": call.get("id", f"call_{i}"), "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"] if isinstance(call["arguments"], str)
                          else json.dumps(call["arguments"])}, **(call.get("extra") or {})}
            for i, call in enumerate(step.get("tool_calls") or [])]


class FakeOpenAI:
    def __init__(self, script: list[dict[str, Any]] | None = None, default: dict[str, Any] | None = None,
                 host: str = "127.0.0.1", port: int = 0, contract: Any = None):
        self.script = list(script or [])
        self.default = default
        self.contract = contract
        self.refused: list[dict[str, Any]] = []
        """The contract's refusals: {"body", "error"}."""
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> "FakeOpenAI":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeOpenAI":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def push(self, *steps: dict[str, Any]) -> None:
        with self.lock:
            self.script.extend(steps)

    def next_step(self) -> dict[str, Any]:
        with self.lock:
            if self.script:
                return self.script.pop(0)
        return self.default or {"status": 500, "message": "the fake server's script is used up"}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError:
                    body = {}
                with fake.lock:
                    fake.requests.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body})
                if not self.path.endswith("/chat/completions"):
                    self._json(404, {"error": {"message": f"no route {self.path}"}})
                    return
                refusal = fake.contract.check(body) if fake.contract is not None else None
                if refusal is not None:
                    with fake.lock:
                        fake.refused.append({"body": body, "error": refusal})
                    error = {k: v for k, v in refusal.items() if k != "status"}
                    error.setdefault("type", "invalid_request_error")
                    self._json(int(refusal.get("status", 400)), {"error": error})
                    return
                step = fake.next_step()
                if fake.contract is not None:
                    step = fake.contract.shape(dict(step), body)
                try:
                    self._serve(step, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _serve(self, step: dict[str, Any], body: dict[str, Any]) -> None:
                if "sleep" in step:
                    time.sleep(float(step["sleep"]))
                    step = {"text": step.get("text", "late")}
                status = int(step.get("status", 200))
                if status != 200:
                    kind = {401: "invalid_api_key", 403: "permission_denied", 429: "rate_limit_exceeded",
                            404: "model_not_found", 400: "invalid_request_error"}.get(status, "server_error")
                    headers_sent = False
                    if status == 429:
                        self.send_response(status)
                        self.send_header("Retry-After", "0")
                        payload = json.dumps({"error": {"message": step.get("message", "slow down"),
                                                        "type": kind, "code": kind}}).encode()
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        headers_sent = True
                    if not headers_sent:
                        self._json(status, {"error": {"message": step.get("message", f"scripted {status}"),
                                                      "type": kind, "code": kind}})
                    return
                if step.get("garbage"):
                    payload = b"<html>this is not an API</html>"
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream" if body.get("stream") else "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                text = str(step.get("text", ""))
                calls = _tool_calls(step)
                finish = step.get("finish_reason", "tool_calls" if calls else "stop")
                model = body.get("model", "fake-model")
                usage = {"prompt_tokens": _words(body.get("messages", [])),
                         "completion_tokens": len(text.split()) + len(json.dumps(calls).split()) if calls
                         else len(text.split())}
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                usage.update(step.get("usage") or {})
                if not body.get("stream"):
                    self._json(200, {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()),
                                     "model": model, "usage": usage,
                                     "choices": [{"index": 0, "finish_reason": finish,
                                                  "message": {"role": "assistant", "content": text or None,
                                                              **({"tool_calls": calls} if calls else {})}}]})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

                def event(payload: dict[str, Any]) -> None:
                    if step.get("chunk_delay"):
                        time.sleep(float(step["chunk_delay"]))
                    self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
                    self.wfile.flush()

                def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
                    return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

                event(chunk({"role": "assistant", "content": ""}))
                reasoning = str(step.get("reasoning", ""))
                for i in range(0, len(reasoning), 64):
                    event(chunk({"reasoning_content": reasoning[i:i + 64]}))
                pieces = [text[i:i + 64] for i in range(0, len(text), 64)]
                if step.get("break_stream"):
                    for piece in pieces[: max(1, len(pieces) // 2)]:
                        event(chunk({"content": piece}))
                    self.wfile.flush()
                    self.connection.shutdown(2)  # drop it mid-answer: no finish_reason, no [DONE]
                    return
                for n, piece in enumerate(pieces):
                    if step.get("stall") and n == len(pieces) // 2:
                        time.sleep(float(step["stall"]))
                    event(chunk({"content": piece}))
                for index, call in enumerate(calls):  # the id, name and provider fields first, then the arguments
                    extra = {k: v for k, v in call.items() if k not in ("id", "type", "function")}
                    event(chunk({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                                 "function": {"name": call["function"]["name"], "arguments": ""},
                                                 **extra}]}))
                    arguments = call["function"]["arguments"]
                    for i in range(0, len(arguments), 40):
                        event(chunk({"tool_calls": [{"index": index, "function": {"arguments": arguments[i:i + 40]}}]}))
                event(chunk({}, finish))
                if (body.get("stream_options") or {}).get("include_usage"):
                    event({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model, "choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description="A scripted OpenAI-compatible server on loopback.")
    ap.add_argument("--port", type=int, default=8999)
    ap.add_argument("--text", default="SUMMARY: nothing\n")
    ap.add_argument("--script", type=Path, help="a JSON list of steps, served in order, then --text")
    args = ap.parse_args()
    script = json.loads(args.script.read_text()) if args.script else []
    server = FakeOpenAI(script=script, default={"text": args.text}, port=args.port)
    print(f"serving {server.base_url}", flush=True)
    server.server.serve_forever()


if __name__ == "__main__":
    main()
