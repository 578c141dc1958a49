"""The attention kernel for short blocks (`csrc/attend.c`), built on this machine and called per layer.

Decode and verify rows bring 1-21 new positions each, against pasts of thousands. Attention there
is a read of every key and value of the past: bytes, not arithmetic. torch's operators do it one
row and one call at a time, and read at 5-7 GB/s here (`scaled_dot_product_attention` for a
decode row; two matmuls and a softmax for a block): over half of a pass at 8 sessions x 4096
positions. The kernel attends all short rows of a pass at one layer in ONE call: the work is
split over (row, key/value head, chunk of 256 positions) and spread on torch's OpenMP threads,
each key/value row is read once for the G query heads that share it, and partial softmaxes are
merged as flash-decoding does. Measured on 2 cores (bench/engine.py; attention of 30 layers):
8 rows x 4096 past x 3 positions 278 -> 128 ms, 16 rows x 2000 x 1 243 -> 89 ms.

The C source ships with the package and is compiled on first use with the machine's C compiler
(`cc -O3 -march=native`: AVX2/FMA loops where the CPU has them) into a cache directory, once per
source, compiler and CPU; without a compiler the engine keeps torch's path (`--attention auto`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MAX_QUERIES = 64
"""Most queries (query heads per key/value head x new positions) a row may bring to the kernel;
longer blocks (prefill chunks) are matmul-shaped and take torch's path."""

_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11"]
_KINDS = {torch.float32: "f32", torch.float64: "f64"}


class _Segment(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("kv_stride", ctypes.c_int64), ("layer_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("pos_stride", ctypes.c_int64), ("start", ctypes.c_int64),
                ("width", ctypes.c_int64)]


class _Row(ctypes.Structure):
    _fields_ = [("first_segment", ctypes.c_int32), ("segments", ctypes.c_int32), ("first_query", ctypes.c_int32),
                ("queries", ctypes.c_int32), ("past", ctypes.c_int64)]


def cache_dir() -> Path:
    """Where built kernels are kept: $SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    root = os.environ.get("SPECDEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specdec")
    return Path(root) / "kernels"


def _cpu() -> str:
    """What -march=native depends on: the CPU's model and feature flags (a cache shared by machines
    of different CPUs keeps one build for each)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


@functools.lru_cache(maxsize=1)
def _library() -> tuple[Any, str]:
    """The built kernel (a ctypes library) and "", or None and why it could not be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler or not shutil.which(compiler):
        return None, "no C compiler (cc) on the PATH"
    source = resources.files("specdec.runtime").joinpath("csrc/attend.c").read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), version.encode(), _cpu().encode()]))
    target = cache_dir() / f"attend-{key.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _build(compiler, source, target)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            return None, f"building the attention kernel failed: {detail.strip()[-2000:]}"
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:  # e.g. a cache directory mounted noexec
        return None, f"loading the attention kernel failed: {e}"
    for kind in _KINDS.values():
        fn = getattr(lib, f"specdec_attend_{kind}")
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_int64, ctypes.c_int64, ctypes.c_double]
    return lib, ""


def _build(compiler: str, source: bytes, target: Path) -> None:
    """Compile, then link without -ffast-math (linking with it would set flush-to-zero for the whole
    process), into a temporary file renamed into place: concurrent builders do not collide."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        (Path(tmp) / "attend.c").write_bytes(source)
        subprocess.run([compiler, *_FLAGS, "-c", "attend.c", "-o", "attend.o"], cwd=tmp, check=True,
                       capture_output=True, text=True)
        subprocess.run([compiler, "-shared", "-fopenmp", "attend.o", "-o", "attend.so", "-lmvec", "-lm"], cwd=tmp,
                       check=True, capture_output=True, text=True)
        os.replace(Path(tmp) / "attend.so", target)
        log.info("built the attention kernel into %s", target)


def unavailable(device: torch.device, dtype: torch.dtype) -> str:
    """Why the kernel cannot run for tensors of `dtype` on `device` ("" when it can)."""
    if device.type != "cpu":
        return f"the attention kernel runs on a CPU, not {device.type}"
    if dtype not in _KINDS:
        return f"the attention kernel runs float32 and float64, not {str(dtype).removeprefix('torch.')}"
    return _library()[1]


class Plan:
    """The kernel's description of a pass's short rows (built once per pass, used at every layer).

    `rows`: per row, its `SessionKV`, where its block starts in the packed queries, its length and
    its past. Every segment must be a view with a contiguous head_dim (`SessionKV`'s buffers are)."""

    def __init__(self, rows: Sequence[tuple[Any, int, int, int]]) -> None:
        segments: list[_Segment] = []
        described = []
        for kv, first_query, n, past in rows:
            first = len(segments)
            start = 0
            for view in (*kv.prefix, kv.data):
                width = view.shape[3] if view is not kv.data else past + n - kv.offset
                stride = view.stride()
                if stride[4] != 1:
                    raise ValueError("the attention kernel reads keys/values with a contiguous head_dim")
                segments.append(_Segment(view.data_ptr(), *stride[:4], start, width))
                start += width
            described.append(_Row(first, len(segments) - first, first_query, n, past))
        self.count = len(described)
        self.rows = (_Row * self.count)(*described)
        self.segments = (_Segment * len(segments))(*segments)


def attend(plan: Plan, layer: int, q: torch.Tensor, out: torch.Tensor, kv_heads: int, scale: float) -> None:
    """Attention of the plan's rows at `layer`: queries `q` `[T, H, D]` (any strides, D contiguous;
    query head h belongs to key/value head h // (H / kv_heads)) into `out` `[T, H, D]` (same), at
    the rows' positions; the rows' new keys/values must already be written."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(why)
    _, heads, dim = q.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or q.dtype != out.dtype:
        raise ValueError("the attention kernel needs q and out with a contiguous head_dim and one dtype")
    fn = getattr(lib, f"specdec_attend_{_KINDS[q.dtype]}")
    rc = fn(plan.count, ctypes.addressof(plan.rows), ctypes.addressof(plan.segments), layer, kv_heads,
            heads // kv_heads, dim, q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0),
            out.stride(1), scale)
    if rc == -1:
        raise ValueError(f"the attention kernel takes head_dim <= 256 and at most {MAX_QUERIES} queries a row")
    if rc:
        raise MemoryError("the attention kernel could not allocate its scratch memory")
