#!/usr/bin/env bash
# The CPU judge at the task's plan, quiet or beside a busy neighbour that switches on and off at random
# (benchmarks/noise/neighbour.py): A/A benchmarks and a calibrated 5% step both ways (the 5%-slower server as the
# candidate, then as the incumbent), servers started once (`nightshift noise`). Prints the study's table and, beside
# a neighbour, how long the neighbour was busy.
#   bash benchmarks/noise/judge_study.sh quiet|neighbour AA REPEAT RUNS_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
condition=${1:?quiet or neighbour} aa=${2:?A/A benchmarks} repeat=${3:?tries each way} runs=${4:?runs folder}
case "$condition" in quiet|neighbour) ;; *) echo "condition must be quiet or neighbour, got $condition" >&2; exit 2;; esac
mkdir -p "$runs"
neighbour=
if [ "$condition" = neighbour ]; then
  python3 benchmarks/noise/neighbour.py --seed 0 --on 0.5 5 --off 0.5 5 2> "$runs/neighbour.log" &
  neighbour=$!
  trap 'kill "$neighbour" 2>/dev/null || true' EXIT
fi
status=0
nightshift noise --aa "$aa" --patch benchmarks/noise-checks/step-5pct-slower-vllm-0.32.0.patch --repeat "$repeat" \
  --both-ways --set audit.enabled=false --runs-dir "$runs" || status=$?
if [ -n "$neighbour" ]; then
  kill "$neighbour"; wait "$neighbour" || true; trap - EXIT
  cat "$runs/neighbour.log"
fi
exit "$status"
