"""Turns instead of passes: do two servers measured in turns of a fraction of a second pair closer than passes?

The machine's speed moves 5-10% from one second to the next, at every scale from one engine step to a second
(cpu-judge.md, "How fast the machine's speed moves"), so two passes one after the other differ by that much
(per-pair SD 0.07-0.10). If the differences between adjacent stretches do not shrink with their length, more and
shorter pairs in the same time should give a narrower estimate. Here both servers are kept loaded (a closed-loop
client of LANES requests a side, fresh prompts of 64 tokens, 32 out), and the harness lets them run in turns: one
thawed, the other frozen (SIGSTOP/SIGCONT to the server's processes, found once), TURN seconds each, in ABBA
rounds. Each side's tokens (prompt tokens at a request's first token, output tokens as they arrive, by the
client's clock) are counted into the turn during which they arrived. A round's log ratio is B's tokens per
second of its two turns against A's. Turn lengths take blocks of BLOCK seconds in turn, each length first in one
cycle, so the hour's drift falls on all alike; printed, per length and metric (all tokens, output tokens), the
rounds' SD and the standard error that 180 s of such rounds would give.

    python3 benchmarks/noise-checks/duet_probe.py [aa|step] [BLOCK] [TURNS, e.g. 0.25,1,4] [CYCLES]

aa: two servers of one tree. step: B is the tree with step-5pct-slower-vllm-0.32.0.patch (1.053x slower by
construction). From the project root."""
import asyncio
import bisect
import json
import math
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.stages.completions import complete  # noqa: E402
from sandbox.host import hold_processes  # noqa: E402
from sandbox.local import LocalSandbox  # noqa: E402
from tests.real_vllm import probe_tree, real_vllm_spec  # noqa: E402

STEP_PATCH = ROOT / "benchmarks/noise-checks/step-5pct-slower-vllm-0.32.0.patch"
LANES, INPUT, OUTPUT = 8, 64, 32


def step_tree(base: Path, tree: Path) -> Path:
    from agent.stages.build import build
    slow = base / "tree-step5"
    if not slow.exists():
        subprocess.run(["git", "-C", str(tree), "worktree", "add", "--detach", str(slow), "HEAD"], check=True)
        subprocess.run(["git", "-C", str(slow), "apply", str(STEP_PATCH)], check=True)
        build(0, slow, [])
    return slow


class Held:
    """A server's processes found once (they do not change while it serves) and held by the sandbox's own
    hold_processes over that fixed set: the sandbox's `hold` finds them anew in /proc each time, and the turns'
    gaps were 45-154 ms with it."""
    def __init__(self, server):
        from sandbox.host import process_tree
        from sandbox.local import _group_members
        self.pids = set(_group_members(server.process.pid)) | process_tree(server.process.pid)

    def hold(self, frozen: bool) -> None:
        hold_processes(lambda: self.pids, frozen)


class Side:
    def __init__(self, name: str, server, seed: int):
        self.name, self.server, self.rng = name, server, random.Random(seed)
        self.events: list[tuple[float, int]] = []  # (arrival, tokens)

    async def lane(self, stop: asyncio.Event) -> None:
        async with self.server.client(300) as client:
            while not stop.is_set():
                prompt = [self.rng.randrange(4, 4000) for _ in range(INPUT)]
                done = await complete(client, prompt, OUTPUT)
                chunks = done.chunks
                if chunks:
                    self.events.append((chunks[0][0], -INPUT))  # prompt tokens: negative, told apart below
                self.events.extend(chunks)


GRACE_S = 0.05
"""Tokens that arrive this long after a side was frozen are still its turn's (bytes its server wrote before)."""


def count(events, turns, output_only=False):
    """Tokens into turns: each event to the turn during which it arrived (or within GRACE_S after its end); events
    outside every turn of this block (other blocks, the warm-up) are not counted."""
    starts = [t[0] for t in turns]
    out = [0] * len(turns)
    for when, n in events:
        i = bisect.bisect_right(starts, when) - 1
        if i >= 0 and when < turns[i][1] + GRACE_S and (n > 0 or not output_only):
            out[i] += abs(n)
    return out


async def main(kind: str, block_s: float, turn_lengths: list[float], cycles: int) -> dict:
    base, tree = probe_tree("step-excess-probe")
    tree_b = step_tree(base, tree) if kind == "step" else tree
    run_dir = base / f"duet-{uuid.uuid4().hex[:6]}"
    run_dir.mkdir()
    sandbox = LocalSandbox(None, run_dir)
    spec = real_vllm_spec(tree, "duet-a")
    args = {**spec.engine_args, "max_num_seqs": 4}
    a_server = sandbox.start(spec.model_copy(update={"engine_args": args}))
    b_server = sandbox.start(real_vllm_spec(tree_b, "duet-b").model_copy(update={"engine_args": args}))
    sides = {"A": Side("A", a_server, 1), "B": Side("B", b_server, 2)}
    blocks = []  # (turn length, {"A": [(t0, t1), ...], "B": [...]}) in the order run
    try:
        held = {"A": Held(a_server), "B": Held(b_server)}
        held["B"].hold(True)
        stop = asyncio.Event()
        lanes = [asyncio.create_task(s.lane(stop)) for s in sides.values() for _ in range(LANES)]
        for who in "AB":  # warm-up: each side alone for 5 s
            held[who].hold(False)
            await asyncio.sleep(5)
            held[who].hold(True)
        for cycle in range(cycles):
            k = cycle % len(turn_lengths)
            for turn in turn_lengths[k:] + turn_lengths[:k]:  # each length early and late in a cycle alike
                turns = {"A": [], "B": []}
                began, i = time.perf_counter(), 0
                while time.perf_counter() - began < block_s or i % 4:  # whole ABBA rounds
                    who = "ABBA"[i % 4]
                    held[who].hold(False)
                    t0 = time.perf_counter()
                    await asyncio.sleep(turn)
                    t1 = time.perf_counter()
                    held[who].hold(True)
                    turns[who].append((t0, t1))
                    i += 1
                blocks.append((turn, turns))
                print(f"cycle {cycle}: turns of {turn:g} s, {i // 4} rounds", flush=True)
        stop.set()
        for who in "AB":
            held[who].hold(False)
        await asyncio.wait(lanes, timeout=60)
    finally:
        a_server.hold(False)
        b_server.hold(False)
        a_server.stop()
        b_server.stop()
    result = {"kind": kind, "block_s": block_s, "cycles": cycles,
              "rows": [row(sides, blocks, turn, metric) for turn in turn_lengths for metric in ("total", "output")]}
    (run_dir / "duet.json").write_text(json.dumps({**result, "blocks": blocks,
                                                   "events": {w: sides[w].events for w in "AB"}}))
    return result


def row(sides, blocks, turn: float, metric: str) -> dict:
    """One turn length's ABBA rounds (A's two turns and B's two of each round): log(B's rate / A's rate)."""
    logs, totals = [], {"A": [0, 0.0], "B": [0, 0.0]}
    for length, turns in blocks:
        if length != turn:
            continue
        tok = {w: count(sides[w].events, turns[w], metric == "output") for w in "AB"}
        for r in range(len(turns["A"]) // 2):
            rate = {}
            for w in "AB":
                n = tok[w][2 * r] + tok[w][2 * r + 1]
                secs = sum(t1 - t0 for t0, t1 in turns[w][2 * r:2 * r + 2])
                rate[w] = n / secs
                totals[w][0] += n
                totals[w][1] += secs
            logs.append(math.log(rate["B"] / rate["A"]) if rate["A"] and rate["B"] else float("nan"))
    good = [x for x in logs if math.isfinite(x)]
    sd = statistics.stdev(good)
    return {"turn_s": turn, "metric": metric, "rounds": len(logs), "empty": len(logs) - len(good),
            "ratio": round(math.exp(statistics.fmean(good)), 4), "sd": round(sd, 4),
            "se_of_180s": round(sd / math.sqrt(180 / (4 * turn)), 4),
            "tokens_per_s": {w: round(totals[w][0] / totals[w][1], 1) for w in "AB"}}


def load_json(path: Path):
    """A probe's JSON as written, or gzipped as kept in benchmarks/results/raw."""
    import gzip
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def reanalyse(path: Path, turn_lengths: list[float]) -> list[dict]:
    """The rows again from a run's duet.json (or its gzip)."""
    data = load_json(path)
    blocks = [(length, turns) for length, turns in data["blocks"]]
    sides = {w: type("S", (), {"events": [tuple(e) for e in data["events"][w]]})() for w in "AB"}
    return [row(sides, blocks, turn, metric) for turn in turn_lengths for metric in ("total", "output")]


if __name__ == "__main__" and sys.argv[1:2] == ["reanalyse"]:
    for r in reanalyse(Path(sys.argv[2]), [float(x) for x in sys.argv[3].split(",")]):
        print(json.dumps(r))
elif __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "aa"
    block_s = float(sys.argv[2]) if len(sys.argv) > 2 else 40
    lengths = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "0.25,1,4").split(",")]
    cycles = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    out = asyncio.run(main(kind, block_s, lengths, cycles))
    for r in out["rows"]:
        print(json.dumps(r))

