#!/usr/bin/env python3
"""`vllm serve` measurements: stock concurrency sweep, serving-path diagnosis, interleaved flags search.

    python3 gpu/serve_bench.py MODEL_DIR RESULT_DIR [--phase stock|flags|all]
        [--util 0.3] [--reps 3] [--flags-conc 256] [--flags-prompts 384]

Servers: `python3 -m vllm.entrypoints.cli.main serve MODEL --dtype bfloat16 --max-model-len 2048
--seed 0 --gpu-memory-utilization UTIL --port P [flags]`, all other settings at the `vllm serve`
defaults. UTIL < 0.9 (the default) so that the baseline and the candidates can be resident at once
and be measured interleaved; the KV cache is far larger than the load needs (see the logs).
Benchmarks: `vllm bench serve --backend vllm --dataset-name random --random-input-len 1024
--random-output-len 256 --ignore-eos --max-concurrency C --num-prompts N --seed S`; a new seed for
every run so the prefix cache never hits across runs. Server-side /metrics are read before and
after each run (mean inter-token latency, TTFT, tokens per engine step).
Diagnosis at c=256 (same server): bench serve (text prompts, streamed, one SSE chunk per token),
an own aiohttp client sending token-id prompts with stream=false, and the same with stream=true.
Flags phase: candidate servers are started next to the baseline; for rep in 1..reps each server
gets one bench run at flags_conc, in rotated order, with the same seed within a rep. Speedup =
exp(mean log ratio) of candidate/baseline total tok/s per rep, with a t-interval (95%).
Parity through the server (same batches: one request at a time, greedy, token ids returned) for
each candidate against the baseline.
"""
import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request

V = [sys.executable, "-m", "vllm.entrypoints.cli.main"]
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def log(*x):
    print(f"[serve {time.strftime('%H:%M:%S')}]", *x, flush=True)


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Server:
    def __init__(self, name, model, port, util, flags, rdir):
        self.name, self.model, self.port, self.flags = name, model, port, flags
        self.logf = open(os.path.join(rdir, f"server_{name}.log"), "w")
        cmd = V + ["serve", model, "--dtype", "bfloat16", "--max-model-len", "2048", "--seed", "0",
                   "--gpu-memory-utilization", str(util), "--port", str(port)] + flags
        log(name, " ".join(cmd[2:]))
        self.t0 = time.time()
        self.p = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.startup_s = None

    def wait(self, timeout=900):
        while time.time() - self.t0 < timeout:
            if self.p.poll() is not None:
                raise RuntimeError(f"server {self.name} exited with {self.p.returncode}")
            try:
                http_get(f"http://127.0.0.1:{self.port}/health", 2)
                self.startup_s = round(time.time() - self.t0, 1)
                log(self.name, f"ready in {self.startup_s}s")
                return self
            except Exception:  # noqa: BLE001
                time.sleep(2)
        raise TimeoutError(self.name)

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)

    def metrics(self):
        try:
            text = http_get(f"http://127.0.0.1:{self.port}/metrics")
        except Exception:  # noqa: BLE001
            return {}
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(vllm:[a-z_]+?)(_sum|_count|_total)?(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m and not m.group(1).endswith("_bucket"):
                k = m.group(1) + (m.group(2) or "")
                out[k] = out.get(k, 0.0) + float(m.group(4))
        return out


def metric_delta(before, after):
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    res = {}
    for name, key in (("server_itl_ms", "vllm:inter_token_latency_seconds"),
                      ("server_ttft_ms", "vllm:time_to_first_token_seconds"),
                      ("server_tpot_ms", "vllm:request_time_per_output_token_seconds")):
        if d.get(key + "_count"):
            res[name] = round(1000 * d[key + "_sum"] / d[key + "_count"], 2)
    k = "vllm:iteration_tokens_total"
    if d.get(k + "_count"):
        res["engine_steps"] = int(d[k + "_count"])
        res["tokens_per_step"] = round(d[k + "_sum"] / d[k + "_count"], 1)
    return res


def bench(srv, rdir, tag, conc, prompts, seed, inp, outp):
    fn = f"bench_{tag}.json"
    cmd = V + ["bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{srv.port}",
               "--model", srv.model, "--dataset-name", "random", "--random-input-len", str(inp),
               "--random-output-len", str(outp), "--num-prompts", str(prompts), "--ignore-eos",
               "--seed", str(seed), "--save-result", "--result-dir", rdir, "--result-filename", fn,
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm"]
    if conc:
        cmd += ["--max-concurrency", str(conc)]
    before = srv.metrics()
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t
    with open(os.path.join(rdir, f"bench_{tag}.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode or not os.path.isfile(os.path.join(rdir, fn)):
        log(tag, "bench failed", r.returncode, (r.stderr or r.stdout)[-800:])
        return {"tag": tag, "error": r.returncode}
    j = json.load(open(os.path.join(rdir, fn)))
    keep = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in j.items()
            if isinstance(v, (int, float)) and not k.startswith("p")}
    keep.update({k: round(j[k], 2) for k in j if re.match(r"^p(50|90|99)_(ttft|tpot|itl)_ms$", k)})
    res = {"tag": tag, "server": srv.name, "concurrency": conc, "prompts": prompts, "seed": seed,
           "wall_s": round(wall, 1), **{k: keep.get(k) for k in (
               "total_token_throughput", "output_throughput", "request_throughput", "median_ttft_ms",
               "mean_ttft_ms", "median_tpot_ms", "mean_tpot_ms", "median_itl_ms", "p99_itl_ms",
               "total_input_tokens", "total_output_tokens", "duration", "completed")},
           **metric_delta(before, srv.metrics())}
    log(tag, json.dumps(res))
    return res


async def _client(port, model, prompts, max_tokens, conc, stream, return_ids=False):
    import aiohttp

    sem = asyncio.Semaphore(conc)
    outs = [None] * len(prompts)
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def one(i, sess):
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0.0, "stream": stream, "return_token_ids": return_ids}
        async with sem:
            async with sess.post(url, json=body) as r:
                if not stream:
                    j = await r.json()
                    c = j["choices"][0]
                    outs[i] = c.get("token_ids") if return_ids else j["usage"]["completion_tokens"]
                else:
                    n = 0
                    async for line in r.content:
                        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                            n += 1
                    outs[i] = n

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as sess:
        await asyncio.gather(*(one(i, sess) for i in range(len(prompts))))
    return outs


def tokid_run(srv, tag, conc, n, seed, inp, outp, stream):
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 262144) for _ in range(inp)] for _ in range(n)]
    before = srv.metrics()
    t = time.time()
    outs = asyncio.run(_client(srv.port, srv.model, prompts, outp, conc, stream))
    dt = time.time() - t
    res = {"tag": tag, "server": srv.name, "client": "aiohttp token-id prompts", "stream": stream,
           "concurrency": conc, "prompts": n, "wall_s": round(dt, 2),
           "total_token_throughput": round(n * (inp + outp) / dt, 1), "output_throughput": round(n * outp / dt, 1),
           "stream_chunks_mean" if stream else "completion_tokens_mean": round(sum(outs) / len(outs), 1),
           **metric_delta(before, srv.metrics())}
    log(tag, json.dumps(res))
    return res


def seq_parity(servers, n=32, max_tokens=64, seed=11):
    rng = random.Random(seed)
    prompts = [[2] + [rng.randrange(4, 262144) for _ in range(rng.randrange(16, 200))] for _ in range(n)]
    toks = {}
    for s in servers:
        t = time.time()
        toks[s.name] = [asyncio.run(_client(s.port, s.model, [p], max_tokens, 1, False, True))[0] for p in prompts]
        log("seq parity", s.name, f"{time.time() - t:.1f}s")
    base = servers[0].name
    return {s.name: {"identical": sum(a == b for a, b in zip(toks[base], toks[s.name])), "of": n}
            for s in servers[1:]}, toks[base]


def tinterval(logs):
    n = len(logs)
    m = sum(logs) / n
    if n < 2:
        return math.exp(m), None, None
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / (n - 1))
    h = T975.get(n - 1, 1.96) * sd / math.sqrt(n)
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("rdir")
    ap.add_argument("--phase", choices=["stock", "flags", "all"], default="all")
    ap.add_argument("--util", type=float, default=0.3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--flags-conc", type=int, default=256)
    ap.add_argument("--flags-prompts", type=int, default=384)
    ap.add_argument("--concs", default="16,64,256")
    ap.add_argument("--diag-conc", type=int, default=256)
    ap.add_argument("--diag-prompts", type=int, default=768)
    ap.add_argument("--cinf-prompts", type=int, default=1000)
    ap.add_argument("--candidates", default='{"stream8": ["--stream-interval", "8"], '
                                             '"mnbt16k": ["--max-num-batched-tokens", "16384"]}')
    a = ap.parse_args()
    os.makedirs(a.rdir, exist_ok=True)
    out_path = os.path.join(a.rdir, "serve.json")
    res = json.load(open(out_path)) if os.path.isfile(out_path) else {}

    def save():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=2)

    io = (a.input_len, a.output_len)
    servers = []
    try:
        base = Server("base", a.model_dir, 8000, a.util, [], a.rdir)
        servers.append(base)
        base.wait()
        res["base_startup_s"] = base.startup_s
        if a.phase in ("stock", "all"):
            res["stock"] = []
            for i, c in enumerate(int(x) for x in a.concs.split(",")):
                res["stock"].append(bench(base, a.rdir, f"stock_c{c}", c, max(3 * c, 64), 10 + i, *io))
                save()
            res["diag"] = [bench(base, a.rdir, "stock_cinf", 0, a.cinf_prompts, 20, *io)]
            save()
            dc, dn = a.diag_conc, a.diag_prompts
            res["diag"].append(tokid_run(base, f"tokid_nostream_c{dc}", dc, dn, 21, *io, stream=False))
            save()
            res["diag"].append(tokid_run(base, f"tokid_stream_c{dc}", dc, dn, 22, *io, stream=True))
            save()
        if a.phase in ("flags", "all"):
            cands = json.loads(a.candidates)
            port = 8001
            for name, flags in cands.items():
                s = Server(name, a.model_dir, port, a.util, flags, a.rdir)
                port += 1
                servers.append(s)
                s.wait()
            res["flags_startup_s"] = {s.name: s.startup_s for s in servers}
            runs = {s.name: [] for s in servers}
            res["flags_runs"] = []
            for rep in range(a.reps):
                order = servers[rep % len(servers):] + servers[:rep % len(servers)]
                for s in order:
                    r = bench(s, a.rdir, f"flags_{s.name}_r{rep}", a.flags_conc, a.flags_prompts, 100 + rep, *io)
                    runs[s.name].append(r.get("total_token_throughput"))
                    res["flags_runs"].append(r)
                    save()
            summary = {}
            for s in servers[1:]:
                logs = [math.log(c / b) for b, c in zip(runs["base"], runs[s.name]) if b and c]
                sp, lo, hi = tinterval(logs) if logs else (None, None, None)
                summary[s.name] = {"flags": s.flags, "speedup": sp and round(sp, 4), "ci95": [lo and round(lo, 4), hi and round(hi, 4)],
                                   "base_tok_s": runs["base"], "cand_tok_s": runs[s.name], "n": len(logs)}
            res["flags_summary"] = summary
            save()
            par, _ = seq_parity(servers)
            res["flags_parity_sequential_same_batches"] = par
            save()
    finally:
        for s in servers:
            s.stop()
        save()
    log("done")


if __name__ == "__main__":
    main()
