#!/usr/bin/env bash
# Build the specdec image from deploy/docker/Dockerfile (`make image`).
#
# Docker where a Docker engine answers, else podman (root, Debian 12: see deploy/podman/). The
# base is $PYTHON_IMAGE when it is local or a registry answers, else one made from Debian's
# packages (deploy/base-image.sh). With podman, torch comes from a folder of local wheels
# ($TORCH_WHEELS, filled with `pip download` on the first build) and the host's CA bundle is
# mounted into the build, so a build needs nothing but PyPI (HTTPS may be intercepted).
#
# Settings (environment; the Makefile passes its variables of the same names):
#   IMAGE            name:tag to build                  (specdec:<version in pyproject.toml>)
#   IMAGE_STAGE      Dockerfile stage                   (specdec: every service; or draft, target,
#                                                        orchestrator, gateway)
#   PYTHON_IMAGE     base image                         (python:3.11-slim-bookworm)
#   TORCH_INDEX_URL  index for torch                    (the Dockerfile's: PyTorch's CPU index;
#                                                        with local wheels: $PIP_INDEX_URL or PyPI)
#   TORCH_WHEELS     folder of torch wheels, or `none`  (.tools/wheels; podman only)
#   CA_BUNDLE        CA bundle mounted into RUN steps   (/etc/ssl/certs/ca-certificates.crt; podman only)
#   CONTAINER_ENGINE docker or podman                   (docker if its engine answers, else podman)
#   BUILD_ARGS       more `build` flags, e.g. "--build-arg TORCH_VARIANT=cu130"
# Prints the image's size and the build time at the end.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
log() { echo "image: $*" >&2; }

version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
torch_version="$(sed -n 's/.*"torch==\([^"]*\)".*/\1/p' pyproject.toml | head -1)"
IMAGE="${IMAGE:-specdec:$version}"
IMAGE_STAGE="${IMAGE_STAGE:-specdec}"
PYTHON_IMAGE="${PYTHON_IMAGE:-python:3.11-slim-bookworm}"
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
TORCH_WHEELS="${TORCH_WHEELS:-$root/.tools/wheels}"
host_python="${PYTHON:-}"
[ -n "$host_python" ] || { [ -x "$root/.venv/bin/python" ] && host_python="$root/.venv/bin/python" || host_python=python3; }

engine="${CONTAINER_ENGINE:-}"
if [ -z "$engine" ]; then
  if command -v docker >/dev/null 2>&1 && ! docker --version 2>/dev/null | grep -qi podman \
     && docker info >/dev/null 2>&1; then
    engine=docker
  elif command -v podman >/dev/null 2>&1; then
    engine=podman
  else
    log "neither a Docker engine nor podman: apt-get install podman buildah runc (see .ci/run)"
    exit 1
  fi
fi
if [ "$engine" = podman ]; then
  # runc and explicit ulimits, without touching the machine's own configuration.
  export CONTAINERS_CONF="${CONTAINERS_CONF:-$root/deploy/podman/containers.conf}"
fi
export ENGINE="$engine"
start=$SECONDS

base="$(PYTHON_IMAGE="$PYTHON_IMAGE" deploy/base-image.sh "$PYTHON_IMAGE")"

args=(build -f deploy/docker/Dockerfile --target "$IMAGE_STAGE" -t "$IMAGE"
      --build-arg "PYTHON_IMAGE=$base" --build-arg "TORCH_VERSION=$torch_version"
      --label "org.opencontainers.image.version=$version")
[ -z "${TORCH_INDEX_URL:-}" ] || args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")

if [ "$engine" = podman ]; then
  args+=(--network host --layers)
  if [ -f "$CA_BUNDLE" ]; then
    args+=(-v "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" --build-arg "PIP_CERT=/etc/ssl/certs/ca-certificates.crt")
  fi
  if [ "$TORCH_WHEELS" != none ] && ! ls "$TORCH_WHEELS"/torch-"$torch_version"*-cp311-*.whl >/dev/null 2>&1 \
     && ! "$host_python" -m pip --version >/dev/null 2>&1; then
    log "no pip here to download torch with ($host_python): torch comes from the index in the build"
    TORCH_WHEELS=none
  fi
  if [ "$TORCH_WHEELS" != none ]; then
    mkdir -p "$TORCH_WHEELS"
    if ! ls "$TORCH_WHEELS"/torch-"$torch_version"*-cp311-*.whl >/dev/null 2>&1; then
      log "pip download torch==$torch_version into $TORCH_WHEELS"
      "$host_python" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version 3.11 --platform manylinux_2_28_x86_64 --dest "$TORCH_WHEELS" "torch==$torch_version"
    fi
    # torch from the folder; its dependencies and everything else from PyPI.
    args+=(-v "$TORCH_WHEELS:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
    [ -n "${TORCH_INDEX_URL:-}" ] || args+=(--build-arg "TORCH_INDEX_URL=${PIP_INDEX_URL:-https://pypi.org/simple}")
  fi
fi
# shellcheck disable=SC2206
[ -z "${BUILD_ARGS:-}" ] || args+=($BUILD_ARGS)

log "$engine ${args[*]} ."
"$engine" "${args[@]}" .
elapsed=$((SECONDS - start))

size_bytes="$("$engine" image inspect --format '{{.Size}}' "$IMAGE")"
size_mb=$((size_bytes / 1000000))
log "built $IMAGE (stage $IMAGE_STAGE, base $base) with $engine in ${elapsed} s: ${size_mb} MB"
log "its layers that hold data (newest first):"
"$engine" history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" 2>/dev/null \
  | awk -F'\t' '$1 !~ /^0 ?B$/ { printf "  %10s  %.90s\n", $1, $2 }' >&2 || true
mkdir -p .tools
printf '%s\t%s\t%s MB\t%s s\t%s\n' "$(date -u +%FT%TZ)" "$IMAGE" "$size_mb" "$elapsed" "$engine" >> .tools/image-builds.tsv
