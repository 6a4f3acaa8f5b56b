"""A stand-in for `vllm serve`, standard library only: after the candidate's act, it serves
/health, /v1/completions (fixed tokens) and /observed (what the act saw) on the `--uds` socket.

Planted as vllm/entrypoints/cli/stub_server.py of a hostile candidate tree (see plant.py)."""
import json
import os
import socketserver
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

OBSERVED: dict = {}


class Handler(BaseHTTPRequestHandler):
    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/observed":
            self._send(200, OBSERVED)
        else:
            self._send(404, {"error": self.path})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/v1/completions":
            return self._send(404, {"error": self.path})
        n = int(request.get("max_tokens", 4))
        self._send(200, {"object": "text_completion", "model": request.get("model"),
                         "choices": [{"index": 0, "text": " stub" * n, "token_ids": list(range(5, 5 + n)),
                                      "finish_reason": "length"}]})

    def address_string(self):
        return "unix"

    def log_message(self, fmt, *args):
        sys.stderr.write("stub: " + fmt % args + "\n")


class UnixHTTPServer(socketserver.UnixStreamServer):
    def get_request(self):
        request, _ = super().get_request()
        return request, ("unix", 0)


def serve(observed: dict) -> None:
    OBSERVED.update(observed)
    if "--uds" not in sys.argv:  # the local backend: a TCP port on the loopback
        port = int(sys.argv[sys.argv.index("--port") + 1])
        print("stub: serving on port", port, flush=True)
        with ThreadingHTTPServer(("127.0.0.1", port), Handler) as server:
            server.serve_forever()
    uds = sys.argv[sys.argv.index("--uds") + 1]
    io_dir = os.path.dirname(uds)
    try:
        with open(os.path.join(io_dir, "observed.json"), "w") as f:
            json.dump(observed, f)
    except OSError as exc:
        OBSERVED["observed_file_error"] = repr(exc)
    print("stub: serving on", uds, flush=True)
    with UnixHTTPServer(uds, Handler) as server:
        server.serve_forever()
