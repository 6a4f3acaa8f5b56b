#!/usr/bin/env bash
# The whole H200 measurement, run detached on the GPU machine after install.sh:
#   cp -r gpu /tmp/ns/ && setsid nohup bash /tmp/ns/gpu/pipeline.sh > /tmp/ns/pipeline.log 2>&1 < /dev/null &
# then `bash gpu/poll.sh SECONDS` in each following call (copies /tmp/ns/res to $OUT, prints a table).
# Steps run in priority order, one engine at a time; each writes JSON + a log into /tmp/ns/res.
set -u
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
G=/tmp/ns/gpu; R=/tmp/ns/res; mkdir -p $R
wait_gpu_free() {
  for _ in $(seq 30); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0; sleep 2
  done
  echo "$(date +%T) WARN gpu still busy: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')" >> $R/progress.txt
}
step() {
  local name=$1; shift
  echo "$(date +%T) START $name" >> $R/progress.txt
  local t=$(date +%s)
  "$@" > $R/$name.log 2>&1
  local rc=$?
  echo "$(date +%T) END $name rc=$rc $(( $(date +%s) - t ))s" >> $R/progress.txt
  wait_gpu_free
}
python3 -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)" > $R/versions.txt 2>&1
step make_model python3 $G/make_model.py /tmp/g4 --config $G/../tasks/models/gemma-4-e2b/config.json
step synth python3 $G/synth_ckpt.py /tmp/g4 /tmp/g4s --target-median 1.5 --report $R/synth.json
step off_plain python3 $G/offline.py /tmp/g4s $R/off_plain.json --mode plain --tp-prompts 1000 \
  --save-tokens $R/tok_plain.json --tag plain_defaults
step off_bi8k python3 $G/offline.py /tmp/g4s $R/off_bi8k.json --mode bi --tp-prompts 200 \
  --engine-args '{"max_num_batched_tokens": 8192}' --save-tokens $R/tok_bi8k.json \
  --compare-tokens $R/tok_plain.json --tag bi_mnbt8192
step serve python3 $G/serve_bench.py /tmp/g4s $R --phase all --util 0.3 --reps 3
step off_bi16k python3 $G/offline.py /tmp/g4s $R/off_bi16k.json --mode bi --tp-prompts 0 \
  --engine-args '{"max_num_batched_tokens": 16384}' --compare-tokens $R/tok_bi8k.json --tag bi_mnbt16384
echo "$(date +%T) ALLDONE" >> $R/progress.txt
