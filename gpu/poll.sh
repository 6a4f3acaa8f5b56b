#!/usr/bin/env bash
# Wait up to $1 seconds (or until the pipeline is done), then copy results to $OUT and print a table.
T=${1:-500}; R=/tmp/ns/res; end=$((SECONDS + T))
while [ $SECONDS -lt $end ] && ! grep -q ALLDONE $R/progress.txt 2>/dev/null; do sleep 3; done
tar czf $OUT/res.tgz -C /tmp/ns res pipeline.log 2>/dev/null
python3 "$(dirname "$0")/summarize.py" $R || true
tail -n 12 $R/progress.txt
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
