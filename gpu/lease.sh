#!/usr/bin/env bash
# `nightshift run` on the GPU machine, in one lease (see benchmarks/README.md for the call sequence).
#   stage PART        copy .payload/PART to /tmp/pl (parts survive while the machine stays warm);
#                     with .whl carried: install nightshift's missing wheels (and git, if absent)
#   launch [ARGS...]  install the payload, copy this checkout to /tmp/ns/repo, start
#                     `nightshift run $TASK ARGS...` detached, then poll
#   poll SECONDS      wait for the run (or SECONDS), pack $OUT/run.tgz, print the trace so far
#   stop              end the run now (SIGTERM: servers stopped, run_finished written), then poll
set -u
NS=/tmp/ns
TASK=${TASK:-tasks/gemma4-e2b.yaml}
env_setup() {
  export PYTHONPATH=${NS_PYTHONPATH-/tmp/site:/tmp/nsdeps} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1 NIGHTSHIFT_CACHE=$NS/cache
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  if [ -x /tmp/gitroot/usr/bin/git ]; then
    export PATH=/tmp/gitroot/usr/bin:$PATH GIT_EXEC_PATH=/tmp/gitroot/usr/lib/git-core
  fi
}
case "${1:-}" in
  stage)
    mkdir -p /tmp/pl $NS && cp -r ".payload/$2" /tmp/pl/
    if [ -d .whl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nsdeps .whl/*.whl
      command -v git >/dev/null || dpkg -x .whl/git.deb /tmp/gitroot
      env_setup; git --version
      python3 -c "import git, optuna, tenacity, typer, rich, scipy, httpx, yaml; print('harness imports ok')"
    fi
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader ;;
  launch)
    shift
    if [ -z "${SKIP_PAYLOAD:-}" ]; then
      bash /tmp/pl/p1/install.sh > $NS/install.log 2>&1 || { tail -20 $NS/install.log; exit 1; }
      tail -3 $NS/install.log
    fi
    rm -rf $NS/repo && mkdir -p $NS/runs $NS/res && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | (mkdir -p $NS/repo && tar -xf - -C $NS/repo)
    env_setup
    (cd $NS/repo && setsid nohup bash -c 'python3 -m agent.cli run "$@" > '$NS'/run.log 2>&1 < /dev/null & echo $! > '$NS'/run.pid;
        wait $!; echo "nightshift exit $?" >> '$NS'/run.log' _ "$TASK" --runs-dir $NS/runs --quiet "$@" > /dev/null 2>&1 &)
    if [ -n "${GRID:-}" ]; then  # margins of other checkpoint knobs, HF forward on the GPU, beside the run
      (cd $NS/repo && setsid nohup bash -c "python3 gpu/make_model.py /tmp/g4 --config tasks/models/gemma-4-e2b/config.json \
          && python3 gpu/synth_ckpt.py /tmp/g4 /tmp/g4x --grid --no-save --report $NS/res/grid.json" \
          > $NS/res/grid.log 2>&1 < /dev/null &)
    fi
    sleep 5
    exec bash "$0" poll "${POLL_S:-420}" ;;
  stop)
    kill -TERM "$(cat $NS/run.pid)" || true
    for _ in $(seq 60); do grep -q "nightshift exit" $NS/run.log 2>/dev/null && break; sleep 2; done
    exec bash "$0" poll 1 ;;
  poll)
    env_setup
    end=$((SECONDS + ${2:-420})); next=$((SECONDS + 60))
    pack() {
      run=$(ls -td $NS/runs/*/ 2>/dev/null | head -1)
      [ -n "$run" ] || return 0
      (cd $NS/repo && python3 gpu/pack_run.py "$run" "$NS/run.log" "$OUT/run.tgz") || true
    }
    while [ $SECONDS -lt $end ] && ! grep -q "nightshift exit" $NS/run.log 2>/dev/null; do
      sleep 5
      if [ $SECONDS -ge $next ]; then pack; next=$((SECONDS + 60)); fi
    done
    pack
    cp $NS/res/* "$OUT/" 2>/dev/null || true
    tail -n 25 $NS/run.log
    run=$(ls -td $NS/runs/*/ 2>/dev/null | head -1)
    [ -n "$run" ] && (cd $NS/repo && python3 gpu/trace_lines.py "$run")
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null || true ;;
  *) echo "usage: $0 stage PART | launch [nightshift run options] | poll SECONDS"; exit 2 ;;
esac
