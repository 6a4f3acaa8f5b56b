#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run). Five tiers, by what a test needs of the machine:
#   heavy       one at a time: what holds the machine (real vLLM servers, in every backend; Ray).
#               A real vLLM server's start is import-bound in one process at a time, so a core is mostly free:
#   wait-bound  beside it, two at a time (pytest-xdist, one file per worker): fake servers, git, subprocesses;
#   contained   then, still beside it, one at a time: the sandboxes' containment with stub servers (Docker,
#               namespaces and cgroups, and the namespace suite again as an unprivileged user), and real vLLM's
#               one start and one completion in each backend (no speed measured);
#   paced       after it, four at a time (test by test, the longest modules first, tests/conftest.py): runs of
#               fake servers judged by their speed (crash-and-resume, judgement, report), with effects many times
#               the noise. A fake server keeps its pace (tests/fake_vllm.py: token i is due i * delay after the
#               request), yet beside real vLLM 2-4 of these keeps failed in each of three clean-clone runs (the
#               last with paced fakes): their clients and servers starve for CPU there, and the heavy tier grew by
#               a fifth;
#   serial      last, one at a time with nothing beside it: what measures CPU time or the host's noise.
# Each tier prints its time and its slowest tests; the last line sums the tiers and the whole.
#   scripts/test.sh                      # the whole suite
#   scripts/test.sh --fast               # without the tests marked `slow`: for daily work
#   scripts/test.sh tests/test_x.py -x   # further arguments go to every tier
set -uo pipefail
cd "$(dirname "$0")/.."
select="not real_llm"
if [ "${1:-}" = --fast ]; then select="$select and not slow"; shift; fi
temp=${NIGHTSHIFT_TEST_TMP:-$(mktemp -d /tmp/nightshift-tests.XXXXXX)}
mkdir -p "$temp"
began_all=$SECONDS
tier() {  # tier NAME KEY PYTEST-ARGS...: runs one tier, writes its exit code and seconds to $temp/KEY.rc/.s
  local name=$1 key=$2 began=$SECONDS rc; shift 2
  python3 -m pytest -q -ra --durations=15 --basetemp="$temp/$key" "$@"
  rc=$?
  [ "$rc" = 5 ] && rc=0  # nothing of this tier selected
  echo "tests: $name tier took $(( SECONDS - began )) s (exit $rc)"
  echo "$rc" > "$temp/$key.rc"
  echo "$(( SECONDS - began ))" > "$temp/$key.s"
}
beside() {
  tier "wait-bound (-n ${NIGHTSHIFT_TEST_WORKERS:-2})" wait -n "${NIGHTSHIFT_TEST_WORKERS:-2}" --dist loadfile \
    -m "$select and not heavy and not serial and not paced and not contained" "$@"
  tier contained contained -p no:xdist -m "$select and contained and not heavy and not serial" "$@"
}
# The tiers beside the heavy one run at nice 10 (NIGHTSHIFT_BESIDE_NICE): nothing of theirs is judged by speed, and
# the heavy tier is the suite's critical path. On one 2-core Xeon, back to back: heavy 1,368 s with it, 2,020 s
# without (docs/tests.md)
( renice -n "${NIGHTSHIFT_BESIDE_NICE:-10}" -p "$BASHPID" > /dev/null; beside "$@" ) > "$temp/beside.log" 2>&1 &
beside_pid=$!
tier heavy heavy -p no:xdist -m "$select and heavy" "$@"
wait "$beside_pid"
echo "----- the tiers run beside the heavy one -----"
cat "$temp/beside.log"
tier "paced (-n ${NIGHTSHIFT_PACED_WORKERS:-4})" paced -n "${NIGHTSHIFT_PACED_WORKERS:-4}" --dist loadgroup \
  -m "$select and paced and not heavy and not serial" "$@"
tier serial serial -p no:xdist -m "$select and serial and not heavy" "$@"
status=0
for key in wait paced contained heavy serial; do
  rc=$(cat "$temp/$key.rc" 2>/dev/null || echo 2)
  [ "$rc" -gt "$status" ] && status=$rc
done
echo "tests: heavy $(cat "$temp/heavy.s") s; beside it wait-bound $(cat "$temp/wait.s") s, contained" \
     "$(cat "$temp/contained.s") s; then paced $(cat "$temp/paced.s") s, serial $(cat "$temp/serial.s") s;" \
     "whole suite $(( SECONDS - began_all )) s (exit $status)"
if [ "$status" = 0 ] && [ -z "${NIGHTSHIFT_TEST_TMP:-}" ]; then
  rm -rf "$temp"
else
  echo "tests: the tiers' folders (run folders, server logs) are kept in $temp"
fi
exit "$status"
