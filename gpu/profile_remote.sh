#!/usr/bin/env bash
# The LLM proposer's profile of the E2B task's incumbent (agent/proposers/profile.py: one wave under cProfile, one
# under torch.profiler with its CUDA activity) on the GPU machine, from the offline vLLM payload
# (../shared/gpu/build-payload.sh -> .payload/p1..pN) and the harness's wheels (gpu/fetch-wheels.sh -> .whl).
# Calls back to back (a machine is given back about 30 s after a call; /tmp survives between calls while it is warm):
#   stage PART     with .payload/PART in the tree: copied to /tmp/pl; the wheels found under .whl (in any folder within
#                  it, so that they can be spread over the parts' calls: one call takes at most 64 MiB) to /tmp/nsdeps
#   profile [S]    install the payload, copy this tree to /tmp/ns/repo, start the profile detached, then poll S s
#   poll S         wait up to S s for the profile; its log, summary and cached JSON to $RESULTS (default /tmp/ns/results)
set -u
NS=/tmp/ns
RESULTS=${RESULTS:-$NS/results}
TASK=${TASK:-tasks/gemma4-e2b.yaml}
env_setup() {
  export PYTHONPATH=/tmp/site:/tmp/nsdeps:$NS/repo HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
  export DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 NIGHTSHIFT_CACHE=$NS/cache
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}
case "${1:-}" in
  stage)
    mkdir -p /tmp/pl $NS && cp -r ".payload/$2" /tmp/pl/
    wheels=$(find .whl -name '*.whl' 2>/dev/null)
    if [ -n "$wheels" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nsdeps $wheels
    fi
    for m in numpy scipy plotly sqlalchemy optuna git typer; do
      PYTHONPATH=/tmp/nsdeps python3 -c "import $m" 2>/dev/null && echo "importable: $m" || echo "missing: $m"
    done
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader ;;
  profile)
    began=$SECONDS
    bash /tmp/pl/p1/install.sh > $NS/install.log 2>&1 || { tail -20 $NS/install.log; exit 1; }
    echo "payload installed in $((SECONDS - began)) s: $(tail -1 $NS/install.log)"
    rm -rf $NS/repo && mkdir -p $NS/repo $NS/cache
    git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C $NS/repo
    env_setup
    python3 -c "import git, typer, rich, scipy, httpx, yaml, pydantic, vllm; print('imports ok: vllm', vllm.__version__)" || exit 1
    (cd $NS/repo && setsid nohup bash -c "date +%s > $NS/profile.began; python3 -m agent.proposers.profile --task $TASK \
        --timeout 1500 > $NS/profile.log 2>&1 < /dev/null; echo \"profile exit \$?\" >> $NS/profile.log" > /dev/null 2>&1 &)
    sleep 5
    exec bash "$0" poll "${2:-420}" ;;
  poll)
    env_setup
    end=$((SECONDS + ${2:-420}))
    while [ $SECONDS -lt $end ] && ! grep -q "profile exit" $NS/profile.log 2>/dev/null; do sleep 5; done
    echo "profile running for $(( $(date +%s) - $(cat $NS/profile.began) )) s"
    mkdir -p "$RESULTS" && cp $NS/profile.log "$RESULTS/profile.log" 2>/dev/null
    find $NS/cache -name '*.json' -path '*profile*' -newer $NS/profile.began -exec cp {} "$RESULTS/" \; 2>/dev/null
    tail -c 6000 $NS/profile.log
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader ;;
  *) echo "usage: $0 stage PART | profile [SECONDS] | poll SECONDS"; exit 2 ;;
esac
