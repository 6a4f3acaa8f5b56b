"""Other plans for the CPU task, by simulation from its recorded A/A pairs: what the bound, the confidence and the
number of pairs buy in power on an exact 5%, and cost in false accepts.

    python3 benchmarks/noise/plans.py [--runs 20000] [--seed 0]

The pools are the A/A pairs of the recorded `nightshift noise` studies (quiet: raw/cpu-judge-quiet-20261206a and b;
beside the test suite: raw/cpu-judge-suite-20261206c), each A/A centred on its own mean (the study's hour is not
the candidate's) and used with its mirror image. A run draws its pairs from a pool and goes through the task's
group-sequential rule with the 20% trimmed mean (agent/stages/stats.py simulate); an effect is added to every pair's
log ratio. A single benchmark, as `nightshift noise` counts it (the queue's confirmation would square both rates).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from agent.stages.stats import TRIMMED, plan_looks, simulate  # noqa: E402

RAW = ROOT / "benchmarks/results/raw"
POOLS = {"quiet": ["cpu-judge-quiet-20261206a.json", "cpu-judge-quiet-20261206b.json"],
         "beside the test suite": ["cpu-judge-suite-20261206c.json"]}
PLANS = [  # (first look, most pairs, pairs between looks, confidence, min_speedup)
    (8, 40, 8, 0.95, 1.02),  # the task's
    (8, 40, 8, 0.95, 1.0), (8, 40, 8, 0.98, 1.0), (8, 40, 8, 0.99, 1.0),
    (16, 80, 16, 0.95, 1.02), (16, 80, 16, 0.99, 1.0)]


def pool(files: list[str]) -> np.ndarray:
    logs = []
    for name in files:
        for bench in json.loads((RAW / name).read_text())["benchmarks"]:
            if bench["label"] == "A/A" and bench.get("log_ratios"):
                x = np.asarray(bench["log_ratios"], dtype=float)
                logs.append(x - x.mean())
    x = np.concatenate(logs)
    return np.concatenate([x, -x])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print("| pool (pairs, SD) | looks | confidence | min_speedup | A/A accepted | a true 1.05x accepted | 1.04x | "
          "mean pairs (A/A / 1.05x) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, files in POOLS.items():
        p = pool(files)
        for first, most, every, confidence, bound in PLANS:
            looks = plan_looks(first, most, every)
            logs = rng.choice(p, size=(args.runs, most))
            signs = np.where(np.arange(most) % 2 == 0, 1.0, -1.0)
            alpha = (1 - confidence) / 2
            rates, used = [], []
            for effect in (1.0, 1.05, 1.04):
                accepted, pairs = simulate(logs + math.log(effect), signs, looks, alpha, bound, TRIMMED)
                rates.append(float(accepted.mean()))
                used.append(float(pairs.mean()))
            print(f"| {name} ({len(p) // 2}, {p.std():.3f}) | {looks[0]}..{looks[-1]} every {every} | {confidence} | "
                  f"{bound} | {rates[0]:.4f} | {rates[1]:.3f} | {rates[2]:.3f} | {used[0]:.0f} / {used[1]:.0f} |")


if __name__ == "__main__":
    main()
