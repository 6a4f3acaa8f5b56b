"""benchmarks/noise/detections.py, the counts behind benchmarks/results/cpu-judge.md: re-derived from a recorded
study, and on made-up benchmarks whose answers are known."""
import importlib.util
import json
import math

import pytest

from tests.stand_in import ROOT

RAW = ROOT / "benchmarks" / "results" / "raw"


@pytest.fixture(scope="module")
def detections():
    spec = importlib.util.spec_from_file_location("detections", ROOT / "benchmarks" / "noise" / "detections.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark(label: str, logs: list[float], seconds: tuple[float, float], steps: tuple[int, int], kept=False):
    """A study's row: pairs in ABBA order, each pass `seconds` (incumbent, candidate) for `steps` engine steps."""
    samples = []
    for k in range(len(logs)):
        roles = ("incumbent", "candidate") if k % 2 == 0 else ("candidate", "incumbent")
        for role in roles:
            i = 0 if role == "incumbent" else 1
            samples.append({"role": role, "repetition": k, "seconds": seconds[i], "engine_steps": steps[i]})
    return {"label": label, "index": 0, "pairs": len(logs), "accepted": kept, "log_ratios": logs,
            "samples": samples, "log_ratio_sd": 0.0}


def test_the_published_counts_re_derive_from_the_second_quiet_study(detections):
    """cpu-judge.md: in the second quiet study 0 of 12 A/As kept, one with its plain interval wholly above 1 (#3,
    1.0607x [1.0140, 1.1095]); the 5% step reversed kept 7 of 11, 10 with the plain interval above 1."""
    rows = json.loads((RAW / "cpu-judge-quiet-20261206b.json").read_text())["benchmarks"]
    t = detections.tally(rows, 0.95)
    aa, reversed_ = t["A/A"], t["step-5pct-slower-vllm-0.32.0 reversed"]
    assert (aa["benchmarks"], aa["kept"], aa["plain_faster"], aa["plain_slower"]) == (12, 0, 1, 0)
    assert (reversed_["benchmarks"], reversed_["kept"], reversed_["plain_faster"]) == (11, 7, 10)
    [odd] = [r for r in rows if r["label"] == "A/A" and r["index"] == 3]
    speedup, low, high = detections.plain_interval(odd, 0.95)
    assert (round(speedup, 4), round(low, 4), round(high, 4)) == (1.0607, 1.014, 1.1095)


def test_made_up_benchmarks_get_the_known_answers(detections):
    """A clear 5% speedup (small spread) reads faster, its mirror slower, a zero-mean one neither; the step-time
    ratio is the incumbent's seconds per step over the candidate's; a benchmark not counted is set apart."""
    wiggle = [0.01 * math.sin(k) for k in range(16)]
    faster = benchmark("up", [0.05 + w for w in wiggle], (2.1, 2.0), (257, 257), kept=True)
    slower = benchmark("down", [-0.05 + w for w in wiggle], (2.0, 2.1), (257, 257))
    null = benchmark("null", [w - sum(wiggle) / 16 for w in wiggle], (2.0, 2.0), (257, 250))
    t = detections.tally([faster, slower, null, {"label": "null", "index": 1, "not_counted": "a stall"}], 0.95)
    assert (t["up"]["kept"], t["up"]["plain_faster"], t["up"]["plain_slower"]) == (1, 1, 0)
    assert (t["down"]["plain_faster"], t["down"]["plain_slower"]) == (0, 1)
    assert (t["null"]["benchmarks"], t["null"]["not_counted"], t["null"]["plain_faster"],
            t["null"]["plain_slower"]) == (1, 1, 0, 0)
    assert t["up"]["steps"] == [pytest.approx(2.1 / 2.0)]
    assert t["null"]["steps"] == [pytest.approx((2.0 / 257) / (2.0 / 250))]
    speedup, low, high = detections.plain_interval(faster, 0.95)
    assert low < speedup < high and low > 1 and speedup == pytest.approx(math.exp(0.05), rel=0.01)
    no_steps = benchmark("x", [0.0, 0.0], (2.0, 2.0), (0, 0))
    assert detections.step_ratio(no_steps) is None
