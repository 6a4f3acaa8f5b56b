#!/usr/bin/env bash
# Builds the sandbox image from the top-level Dockerfile.
#   scripts/docker-image.sh                       # CPU: builds nightshift-base:cpu, then nightshift-sandbox:cpu
#   BASE_IMAGE=vllm/vllm-openai:v0.26.0 TAG=nightshift-sandbox:gpu \
#     HOST_SITE_PACKAGES=/path/to/site-packages scripts/docker-image.sh   # GPU (see docs/sandbox.md)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tag=${TAG:-nightshift-sandbox:cpu}
base=${BASE_IMAGE:-nightshift-base:cpu}
start=$(date +%s)
if [ "$base" = "nightshift-base:cpu" ] && [ "${REBUILD_BASE:-1}" = 1 -o -z "$(docker images -q "$base")" ]; then
  "$here/scripts/docker-base.sh" "$base"
fi
# No build context: the Dockerfile copies nothing in (the harness mounts the candidate tree and the recorder).
DOCKER_BUILDKIT=0 docker build -q --network none -t "$tag" --build-arg BASE_IMAGE="$base" \
  --build-arg HOST_SITE_PACKAGES="${HOST_SITE_PACKAGES:-}" - < "$here/Dockerfile" >/dev/null
echo "docker-image: $tag built in $(( $(date +%s) - start )) s, $(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.2f GB", $1/1e9}')"
