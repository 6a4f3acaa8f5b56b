#!/usr/bin/env bash
# Installs (if needed) and starts a Docker engine on this machine, as root; waits until it answers.
#   scripts/docker-engine.sh        # idempotent: does nothing when an engine already answers
set -euo pipefail
log=${DOCKERD_LOG:-/var/log/dockerd.log}
if docker info >/dev/null 2>&1; then
  echo "docker-engine: an engine already answers"; exit 0
fi
if ! command -v dockerd >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
fi
command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
nohup dockerd >"$log" 2>&1 &
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then echo "docker-engine: started (log: $log)"; exit 0; fi
  sleep 1
done
echo "docker-engine: dockerd did not answer within 60 s; last lines of $log:" >&2
tail -20 "$log" >&2
exit 1
