#!/usr/bin/env bash
# Make sure a Python base image for deploy/docker/Dockerfile exists locally, and print its name.
#
#   deploy/base-image.sh [IMAGE]        IMAGE defaults to $PYTHON_IMAGE or python:3.11-slim-bookworm
#
# 1. IMAGE is already in local storage: use it.
# 2. A registry answers: pull it (a short name is looked up on docker.io).
# 3. Otherwise (no registry reachable, as on the CI machines) build an equivalent base from
#    Debian's own packages with mmdebstrap (Debian 12 "bookworm": Python 3.11, like the official
#    3.11 image) and import it as $LOCAL_BASE (default localhost/specdec-python:3.11-bookworm).
#    ~40 s and ~100 MB; it is made once and kept, so later builds reuse it.
#
# ENGINE: podman (default) or docker. Step 3 needs root and mmdebstrap.
set -euo pipefail

engine="${ENGINE:-podman}"
image="${1:-${PYTHON_IMAGE:-python:3.11-slim-bookworm}}"
local_base="${LOCAL_BASE:-localhost/specdec-python:3.11-bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security_mirror="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
log() { echo "base-image: $*" >&2; }

if "$engine" image inspect "$image" >/dev/null 2>&1; then
  log "using local $image"
  echo "$image"
  exit 0
fi

# Qualify a short name the way Docker does, so that pulling does not depend on registries.conf.
qualified="$image"
first="${image%%/*}"
if [ "$first" = "$image" ]; then
  qualified="docker.io/library/$image"
elif [[ "$first" != *.* && "$first" != *:* && "$first" != localhost ]]; then
  qualified="docker.io/$image"
fi
if [ "${SPECDEC_NO_PULL:-0}" != 1 ] && [[ "$qualified" != localhost/* ]] \
   && timeout "${PULL_TIMEOUT_S:-120}" "$engine" pull -q "$qualified" >/dev/null 2>&1; then
  log "pulled $qualified"
  echo "$qualified"
  exit 0
fi

if "$engine" image inspect "$local_base" >/dev/null 2>&1; then
  log "$image is not reachable; using the local Debian base $local_base"
  echo "$local_base"
  exit 0
fi

command -v mmdebstrap >/dev/null || { log "no registry answers and mmdebstrap is missing (apt-get install mmdebstrap)"; exit 1; }
log "$image is not reachable: building $local_base from Debian $suite packages with mmdebstrap"
work="$(mktemp -d "${TMPDIR:-/tmp}/specdec-base.XXXXXX")"
trap 'rm -rf "$work"' EXIT
start=$SECONDS
# minbase: essential packages and apt only; passwd for useradd. Documentation, manuals and
# translations are never unpacked; mmdebstrap removes apt's lists and caches at the end.
mmdebstrap --quiet --variant=minbase \
  --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --customize-hook='rm -rf "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old "$1"/var/log/*' \
  "$suite" "$work/rootfs.tar" \
  "deb $mirror $suite main" "deb $mirror $suite-updates main" "deb $security_mirror $suite-security main"
"$engine" import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' \
  --message "mmdebstrap $suite minbase + python3 (deploy/base-image.sh)" \
  "$work/rootfs.tar" "$local_base" >/dev/null
log "built $local_base in $((SECONDS - start)) s"
echo "$local_base"
