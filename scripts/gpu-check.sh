#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one short run (a few minutes), for a GPU machine that has
# this project installed (`make install` with a CUDA torch, or the image built with
# TORCH_VARIANT=cu130): the services' device handling, lossless output on the GPU, and a
# one-process measure of step and verify latency on the GPU for the default model.
#   bash scripts/gpu-check.sh [OUT_DIR]
set -euo pipefail
out="${1:-${OUT:-.}}"
python=${PYTHON:-python3}
"$python" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible to torch"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))
PY
PYTHONUNBUFFERED=1 "$python" -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_models.py -k "cuda or device" \
    2>&1 | tee "$out/gpu-tests.log"
# Verify cost against k on the GPU: the curve the draft-length controller feeds on.
PYTHONUNBUFFERED=1 "$python" - "$out/gpu-latency.json" <<'PY'
import json, sys, statistics, time
import torch
from specdec.runtime.kv import SessionCaches
from specdec.runtime.models import load_model

result = {}
for dtype in ("bfloat16", "float32"):
    loaded = load_model("default", dtype=dtype, device="cuda", progress=False)
    caches = SessionCaches(loaded.model, loaded.max_context)
    history = list(range(100, 400))
    with torch.inference_mode():
        caches.score("warm", history, [])
        row = {}
        for k in (0, 1, 2, 4, 8, 16):
            times = []
            for i in range(20):
                caches.rollback("warm", len(history))
                torch.cuda.synchronize(); start = time.perf_counter()
                caches.score("warm", history, list(range(500, 500 + k)))
                torch.cuda.synchronize(); times.append((time.perf_counter() - start) * 1e3)
            row[k] = statistics.median(times)
    result[dtype] = {"verify_ms_by_k": row, "device": loaded.describe_device()}
    print(dtype, {k: round(v, 2) for k, v in row.items()})
json.dump(result, open(sys.argv[1], "w"), indent=2)
PY
