"""A stand-in for `vllm serve` in a real process on loopback, for testing the loop's judgement.

Its behaviour comes from the source tree it is started on (the last of vllm/fake_mode*.json), so a queued
patch can turn it into a faster, cheating or nondeterministic candidate:
  exact   - tokens are a pure function of the prompt; `delay_s` per generated token (`slow_delay_s`
            once `slow_after` completions were served, if set)
  short   - like exact, but returns fewer tokens than asked when many requests are in flight
  random  - tokens differ on every call (not reproducible)
  crash   - exits at startup
  hang    - starts, then never answers a completion
"""
import hashlib
import json
import random
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

tree, port, import_log = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
mode_files = sorted((tree / "vllm").glob("fake_mode*.json"))
config = json.loads(mode_files[-1].read_text()) if mode_files else {"mode": "exact", "delay_s": 0.01}
if config["mode"] == "crash":
    sys.exit("fake_vllm: crashing at startup as configured")
import_log.write_text("".join(f"{p.relative_to(tree)}\n" for p in [tree / "vllm" / "__init__.py", *mode_files]))
in_flight = served = 0
lock = threading.Lock()


def next_token(prompt: list[int], i: int) -> int:
    if config["mode"] == "random":
        return random.randrange(4, 4096)
    digest = hashlib.sha256(json.dumps([prompt, i]).encode()).digest()
    return 4 + int.from_bytes(digest[:4], "little") % 4092


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        global in_flight, served
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if config["mode"] == "hang":
            time.sleep(3600)
        with lock:
            in_flight += 1
            served += 1
            crowded = in_flight > 2
            delay_s = config.get("delay_s", 0.002)
            if served > config.get("slow_after", served):
                delay_s = config["slow_delay_s"]
        try:
            count = body["max_tokens"]
            if config["mode"] == "short" and crowded:
                count = max(1, count // 2)
            if not body.get("stream", False):
                self.answer_whole(body, count)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(count):
                time.sleep(delay_s)
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": [next_token(body["prompt"], i)]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:
            with lock:
                in_flight -= 1
        self.close_connection = True

    def answer_whole(self, body: dict, count: int):
        tokens = [next_token(body["prompt"], i) for i in range(count)]
        choice = {"index": 0, "text": "", "token_ids": tokens}
        if body.get("logprobs"):
            choice["logprobs"] = {"top_logprobs": [
                {f"token_id:{t}": -0.25, f"token_id:{t + 1}": -0.25 - margin(body["prompt"], i)}
                for i, t in enumerate(tokens)]}
        payload = json.dumps({"choices": [choice]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def margin(prompt: list[int], i: int) -> float:
    """Between 0 and 2 nats, a pure function of the prompt and position."""
    return (next_token(prompt, i) % 200) / 100


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 256
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
