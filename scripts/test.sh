#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run): first the tests that mostly wait (fake servers, git, subprocesses)
# two at a time (pytest-xdist, one file per worker), then one at a time those marked `serial`: the ones that
# measure speed or CPU time (A/A, noise, speedup bounds, the idle-work check), and the ones that hold the
# machine (real vLLM servers, Docker, namespaces and cgroups, Ray).
#   scripts/test.sh                      # the whole suite
#   scripts/test.sh --fast               # without the tests marked `slow`: for daily work
#   scripts/test.sh tests/test_x.py -x   # further arguments go to both runs
set -uo pipefail
cd "$(dirname "$0")/.."
select="not real_llm"
if [ "${1:-}" = --fast ]; then select="$select and not slow"; shift; fi
status=0
tier() {
  local name=$1 began=$SECONDS rc; shift
  python3 -m pytest -q -ra --durations=25 "$@"
  rc=$?
  [ "$rc" = 5 ] && rc=0  # nothing of this tier selected
  echo "tests: $name tier took $(( SECONDS - began )) s (exit $rc)"
  [ "$rc" -gt "$status" ] && status=$rc
}
tier "wait-bound (-n ${NIGHTSHIFT_TEST_WORKERS:-2})" -n "${NIGHTSHIFT_TEST_WORKERS:-2}" --dist loadfile \
  -m "$select and not serial" "$@"
tier serial -p no:xdist -m "$select and serial" "$@"
exit "$status"
