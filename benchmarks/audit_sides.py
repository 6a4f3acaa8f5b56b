"""Collect the honest audit sides of a noise study (or any run) into a data file for agent/studies/audit_study.py.

    python3 benchmarks/audit_sides.py runs/noise-<id> tests/data/audit-vllm-cpu-amx.json

Every A/A benchmark's two sides (the second baseline copy, and the control beside it) and the run's own A/A
are kept: per-request counts of non-top-1 positions and every deficit, with the CPU's flags and the versions."""
import json
import platform
import sys
from pathlib import Path

from traces import read_trace


def main(run_dir: Path, out: Path) -> None:
    records = read_trace(run_dir / "trace.jsonl")
    started = records[0].event
    noise = json.loads((run_dir / "noise.json").read_text()) if (run_dir / "noise.json").exists() else {}
    aa = {r["index"] for r in noise.get("benchmarks", []) if r["label"] == "A/A"} if noise else None
    sides = []
    for index, record in enumerate(records):
        e = record.event
        if e.kind != "audit" or e.side is None:
            continue
        honest = e.calibration or aa is None or (e.candidate - 1) in range(len(aa))
        if not honest:
            continue
        for name, s in (("side", e.side), ("control", e.control)):
            if s is not None:
                sides.append({"audit": record.seq, "role": "a/a" if e.calibration else name, **s.model_dump()})
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    data = {"run_id": started.run_id, "vllm": started.vllm_version, "torch": started.torch_version,
            "cpu": platform.processor() or platform.machine(),
            "cpu_flags": sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512bw"))),
            "task": started.task["name"], "workload": started.task["workload"],
            "engine_args": started.task["engine"]["args"], "sides": sides}
    out.write_text(json.dumps(data, indent=0))
    tokens = sum(s["tokens"] for s in sides)
    flips = sum(s["non_top1"] for s in sides)
    print(f"{len(sides)} sides, {tokens} tokens, {flips} not top-1 ({flips / tokens:.2%}), "
          f"max deficit {max(max(s['values'], default=0) for s in sides):.3f} -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
