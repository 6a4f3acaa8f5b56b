#!/usr/bin/env bash
# The exact code patches 04 and 05 through the queue on the CPU task at its defaults (no --set), N times in a row,
# each run on its own branch; prints each run's decisions and writes them to runs.jsonl in the output folder (the second argument).
#   bash benchmarks/cpu-code-patches/repeat_queue.sh 5 /tmp/queue-repeats
set -euo pipefail
cd "$(dirname "$0")/../.."
n=${1:-5}
out=${2:-$(mktemp -d /tmp/queue-repeats.XXXXXX)}
mkdir -p "$out/patches"
cp benchmarks/cpu-code-patches/04-*.patch benchmarks/cpu-code-patches/05-*.patch "$out/patches/"
for i in $(seq 1 "$n"); do
  id="repeat-$(date +%s)-$i"
  began=$SECONDS
  nightshift run tasks/gemma4-tiny-cpu.yaml --proposer queue --patches "$out/patches" --runs-dir "$out/runs" \
    --run-id "$id" --quiet > "$out/$id.log" 2>&1 || echo "run $i exited $?"
  python3 - "$out/runs/$id" "$((SECONDS - began))" >> "$out/runs.jsonl" <<'PY'
import json, sys
from pathlib import Path
from traces import read_trace
trace = Path(sys.argv[1]) / "trace.jsonl"
if not trace.exists():  # the run did not start: its log says why
    print(json.dumps({"run": Path(sys.argv[1]).name, "seconds": int(sys.argv[2]), "error": "no trace"}))
    sys.exit(0)
records = read_trace(trace)
decisions = [r.event for r in records if r.event.kind == "decision"]
floor = next((r.event for r in records if r.event.kind == "noise_floor"), None)
print(json.dumps({"run": Path(sys.argv[1]).name, "seconds": int(sys.argv[2]),
                  "noise_floor": None if floor is None else {"sd": floor.log_ratio_sd, "mde": floor.mde_speedup, "mde_max": floor.mde_speedup_max, "pairs": floor.repetitions},
                  "decisions": [{"candidate": d.candidate, "verdict": d.verdict, "stage": d.stage,
                                 "speedup": d.speedup, "ci": [d.ci_low, d.ci_high], "reason": d.reason[:160]}
                                for d in decisions]}))
PY
  tail -1 "$out/runs.jsonl"
done
