#!/usr/bin/env bash
# Wait up to $1 seconds (or until the pipeline is done), then copy results to $OUT and print a table.
# Results are re-packed into $OUT/res.tgz every 60 s, so a call cut short still brings some back.
# Also refreshes /tmp/ns/gpu/*.py from this checkout (python steps not yet started pick up fixes).
cp "$(dirname "$0")"/*.py /tmp/ns/gpu/ 2>/dev/null
T=${1:-500}; R=/tmp/ns/res; end=$((SECONDS + T)); next=$((SECONDS + 60))
pack() { tar czf $OUT/res.tgz.tmp -C /tmp/ns res pipeline.log 2>/dev/null && mv $OUT/res.tgz.tmp $OUT/res.tgz; }
while [ $SECONDS -lt $end ] && ! grep -q ALLDONE $R/progress.txt 2>/dev/null; do
  sleep 3
  if [ $SECONDS -ge $next ]; then pack; next=$((SECONDS + 60)); fi
done
pack
python3 "$(dirname "$0")/summarize.py" $R || true
tail -n 12 $R/progress.txt
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
