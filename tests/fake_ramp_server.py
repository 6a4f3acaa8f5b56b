"""A streaming /v1/completions stand-in with a known pace: each request streams `max_tokens` ids, one every
`delay_s * (1 + prompt[0] % 10)` seconds, whatever else is in flight; so `lanes` requests of the fast kind
produce lanes / delay_s tokens per second, and a slow request sent last makes a long drain."""
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, delay_s = int(sys.argv[1]), float(sys.argv[2])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        step = delay_s * (1 + body["prompt"][0] % 10)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        start = time.perf_counter()
        for i in range(body["max_tokens"]):
            time.sleep(max(0.0, start + (i + 1) * step - time.perf_counter()))
            self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, 'token_ids': [5]}]})}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
