#!/usr/bin/env bash
# Builds the CPU base image locally (no registry): a Debian bookworm root file system made by
# debootstrap, plus this machine's Python at the same prefix with vLLM's CPU build and the
# distributions it requires (sandbox/image.py lists them), imported with `docker import`.
#   scripts/docker-base.sh [TAG]    # default TAG: nightshift-base:cpu
set -euo pipefail
tag=${1:-nightshift-base:cpu}
python=${PYTHON:-python3}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/nightshift-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
libs=libssl3,libffi8,libsqlite3-0,libnuma1,libgomp1,libncursesw6,libreadline8,libnsl2,libuuid1,libbz2-1.0,liblzma5,libexpat1,libtirpc3,passwd
start=$(date +%s)
echo "docker-base: debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include="$libs" bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
  || { tail -30 "$work/debootstrap.log" >&2; exit 1; }
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
echo "docker-base: rootfs ready after $(( $(date +%s) - start )) s; adding this Python"
prefix=$(cd "$here" && "$python" -m sandbox.image prefix)
(cd "$here" && "$python" -m sandbox.image files) | sed 's|^/||' \
  | tar -C / --no-recursion -cf - -T - | tar -C "$work/rootfs" -xpf -
chmod 755 "$work/rootfs/root"
echo "docker-base: importing $(du -sh "$work/rootfs" | cut -f1) as $tag"
tar -C "$work/rootfs" -cf - . | docker import \
  --change "ENV PATH=$prefix/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --change "ENV LANG=C.UTF-8" \
  --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "docker-base: $tag built in $(( $(date +%s) - start )) s"
