"""Counts over one or more `nightshift noise` studies (their noise.json): per label, how many benchmarks, how many
the rule kept, and how many the plain fixed-sample interval at the pairs the rule stopped at puts wholly above 1
(faster) or wholly below 1 (slower), and the effect as the engines ran it: the median ratio of the two sides'
seconds per engine step (`step`, incumbent over candidate, the median over the label's benchmarks).

The rule's own interval is a repeated confidence interval: at an early look it is as wide as the look's boundary,
so a candidate stopped for futility at 8 pairs reports an interval that says nothing of its direction. The plain
interval (the same location, standard error and degrees of freedom as the rule's looks, agent/stages/stats.py
look_statistics, with Student's t at the task's confidence) says whether the pairs measured show a slowdown; it
decides nothing, and at a stop the rule chose it is descriptive, not a confidence interval.

    python3 benchmarks/noise/detections.py RUN_DIR/noise.json [more noise.json ...] [--confidence 0.95]
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
from collections import defaultdict

import numpy as np
from scipy import stats

from agent.stages.stats import ESTIMATORS, TRIMMED, look_statistics, order_signs
from agent.studies.noise_study import pooled_sd


def plain_interval(row: dict, confidence: float, estimator: str = TRIMMED) -> tuple[float, float, float]:
    """The speedup and its plain (fixed-sample) interval over the row's pairs, by the rule's estimator."""
    logs = np.asarray(row["log_ratios"], dtype=float)
    signs = order_signs([s["role"] for s in row["samples"]])[:len(logs)]
    mu, se, df = (float(np.ravel(v)[0]) for v in look_statistics(logs[None, :], signs, len(logs), estimator))
    t = float(stats.t.isf((1 - confidence) / 2, df))
    return math.exp(mu), math.exp(mu - t * se), math.exp(mu + t * se)


def step_ratio(row: dict) -> float | None:
    """The incumbent's median seconds per engine step over the candidate's: the effect as the engines ran it
    (the passes' step counts from the servers' metrics); None where a pass has no step count."""
    per = {"incumbent": [], "candidate": []}
    for s in row["samples"]:
        if not s.get("engine_steps"):
            return None
        per[s["role"]].append(s["seconds"] / s["engine_steps"])
    return float(np.median(per["incumbent"]) / np.median(per["candidate"]))


def tally(rows: list[dict], confidence: float, estimator: str = TRIMMED) -> dict[str, dict]:
    out: dict[str, dict] = defaultdict(lambda: {"benchmarks": 0, "not_counted": 0, "kept": 0, "plain_faster": 0,
                                                "plain_slower": 0, "pairs": [], "sd": [], "steps": []})
    for row in rows:
        t = out[row["label"]]
        if "not_counted" in row:
            t["not_counted"] += 1
            continue
        _, low, high = plain_interval(row, confidence, estimator)
        t["benchmarks"] += 1
        t["kept"] += bool(row["accepted"])
        t["plain_faster"] += low > 1
        t["plain_slower"] += high < 1
        t["pairs"].append(row["pairs"])
        t["sd"].append(row["log_ratio_sd"])
        if (ratio := step_ratio(row)) is not None:
            t["steps"].append(ratio)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("studies", nargs="+", help="noise.json files (or their gzip)")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--estimator", choices=ESTIMATORS, default=TRIMMED, help="the rule's (the task's benchmark.estimator)")
    ap.add_argument("--rows", action="store_true", help="print every benchmark too")
    a = ap.parse_args()
    rows = []
    for path in a.studies:
        raw = open(path, "rb").read()  # as written, or gzipped as kept in benchmarks/results/raw
        rows += json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)["benchmarks"]
    if a.rows:
        for r in rows:
            if "not_counted" in r:
                print(f"{r['label']} #{r['index']}: not counted: {r['not_counted']}")
                continue
            speedup, low, high = plain_interval(r, a.confidence, a.estimator)
            ratio = step_ratio(r)
            print(f"{r['label']} #{r['index']}: rule {r['speedup']:.4f}x [{r['ci_low']:.4f}, {r['ci_high']:.4f}] "
                  f"{r['pairs']} pairs{' kept' if r['accepted'] else ''}; plain [{low:.4f}, {high:.4f}]"
                  + (f"; step time {ratio:.4f}x" if ratio else ""))
    print(f"{'label':<44} {'n':>3} {'kept':>4} {'faster':>6} {'slower':>6} {'pairs':>6} {'SD':>6} {'step':>7}")
    for label, t in tally(rows, a.confidence, a.estimator).items():
        n = t["benchmarks"]
        sd = pooled_sd(t["sd"])
        pairs = float(np.mean(t["pairs"])) if n else float("nan")
        steps = f"{float(np.median(t['steps'])):.4f}x" if t["steps"] else "-"
        extra = f"  ({t['not_counted']} not counted)" if t["not_counted"] else ""
        print(f"{label:<44} {n:>3} {t['kept']:>4} {t['plain_faster']:>6} {t['plain_slower']:>6} {pairs:>6.1f} "
              f"{sd:>6.3f} {steps:>7}{extra}")


if __name__ == "__main__":
    main()
