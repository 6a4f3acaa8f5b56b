#!/usr/bin/env bash
# The CPU judge at the task's plan, quiet, beside a busy neighbour that switches on and off at random
# (benchmarks/noise/neighbour.py), or beside the test suite (`scripts/test.sh` in a clone of this commit, stopped
# when the study ends): A/A benchmarks and a calibrated 5% step both ways (the 5%-slower server as the candidate,
# then as the incumbent), servers started once (`nightshift noise`). Prints the study's table and what the
# neighbour did meanwhile (how long it was busy; the suite's tiers that finished).
#   bash benchmarks/noise/judge_study.sh quiet|neighbour|suite AA REPEAT RUNS_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
condition=${1:?quiet, neighbour or suite} aa=${2:?A/A benchmarks} repeat=${3:?tries each way} runs=${4:?runs folder}
case "$condition" in quiet|neighbour|suite) ;;
  *) echo "condition must be quiet, neighbour or suite, got $condition" >&2; exit 2;; esac
mkdir -p "$runs"
runs=$(cd "$runs" && pwd)
neighbour=
if [ "$condition" = neighbour ]; then
  python3 benchmarks/noise/neighbour.py --seed 0 --on 0.5 5 --off 0.5 5 2> "$runs/neighbour.log" &
  neighbour=$!
  trap 'kill "$neighbour" 2>/dev/null || true' EXIT
elif [ "$condition" = suite ]; then
  rm -rf "$runs/suite-clone"
  git clone -q . "$runs/suite-clone"
  suite_began=$SECONDS
  # its own process group (setsid), so that the whole suite (pytest, its workers and servers) is stopped as one group
  (cd "$runs/suite-clone" && exec setsid bash scripts/test.sh) > "$runs/neighbour.log" 2>&1 &
  neighbour=$!
  trap 'kill -- "-$neighbour" 2>/dev/null || true' EXIT
fi
status=0
nightshift noise --aa "$aa" --patch benchmarks/noise-checks/step-5pct-slower-vllm-0.32.0.patch --repeat "$repeat" \
  --both-ways --set audit.enabled=false --runs-dir "$runs" || status=$?
if [ "$condition" = neighbour ]; then
  kill "$neighbour"; wait "$neighbour" || true; trap - EXIT
  cat "$runs/neighbour.log"
elif [ "$condition" = suite ]; then
  kill -- "-$neighbour" 2>/dev/null || true; wait "$neighbour" 2>/dev/null || true; trap - EXIT
  echo "the test suite ran beside the study for $(( SECONDS - suite_began )) s; its tiers that finished:"
  grep -a "tier took" "$runs/neighbour.log" || echo "  none"
fi
exit "$status"
