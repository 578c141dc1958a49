"""The project's C kernels (`csrc/*.c`): built for this machine, loaded once, and the linear one's entry point.

Two loops that torch's CPU operators leave far from the memory bandwidth on the shapes of decode
and verify passes, where a pass is a read of bytes (weights, then keys/values), not arithmetic:
`linear.c` (a projection of 1-48 rows: each weight read once for every row) and `attend.c` (all of
a pass's rows at one layer, each key/value read once for its grouped query heads; see
`native_attention`). Both run on torch's OpenMP threads.

Where the library comes from, in order:
1. `$SPECDEC_PREBUILT_KERNELS`: a folder of libraries built for portable instruction sets with
   `python -m specdec.runtime.native prebuild DIR` (container images do this in their build stage,
   so a runtime image needs no compiler); the best one this CPU runs, for exactly this source.
2. A build with the machine's C compiler (`cc -O3 -march=native -mtune=generic`: AVX2/FMA loops where the CPU has
   them), kept in a cache folder, once per source, compiler and CPU.
Neither: `unavailable` says why, and the engine keeps torch's operators (`--kernels auto`).

One OpenMP runtime: the library is linked against the libgomp torch loaded (`torch_openmp`), by
its path, with that folder as its run path, not against the system's (`-fopenmp` at link time
names `libgomp.so.1`). Where torch ships its runtime under the system's name (the CPU wheels:
`torch/lib/libgomp.so.1`) the loader would have shared it anyway; where it ships a renamed copy
(`libgomp-<hash>.so.1`, as manylinux wheels do), `-fopenmp` would load a second runtime, whose
thread pool competes with torch's for the same cores: its workers and torch's each spin after
their parallel regions, so the first kernel call after a torch operator waits for torch's
spinning threads to give the cores back. `library()` checks the process holds one runtime and
logs a warning otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import enum
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from specdec.runtime.engine_options import LINEAR_MAX_ROWS

log = logging.getLogger(__name__)

SOURCES = ("attend.c", "linear.c", "quant.c", "layer.c", "stack.c", "park.c")  # compiled and linked into one library
HEADERS = ("simd.h", "status.h", "kernels.h", "bf16.h", "attend_impl.h", "attend_loops.h")  # included by them
_FLAGS = ["-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=gnu11"]
NATIVE = ["-march=native", "-mtune=generic"]
"""This machine's instructions, generic scheduling: a compiler older than the CPU tunes for the
nearest CPU it knows (GCC 12 takes an AVX-512 AMD EPYC of family 26 for znver3) and schedules
AVX-512 code badly for it: the linear kernel's projections of 24 rows took 43.7 ms so and 32.2
with generic tuning (48 rows 69.6 / 52.8; attention the same), measured side by side."""
# Instruction sets a prebuilt library may target, best first, and the /proc/cpuinfo flags each needs
# (x86-64-v4 and -v3 as GCC defines them; the baselines need nothing beyond the architecture).
_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_ISAS: dict[str, list[tuple[str, set[str]]]] = {
    "x86_64": [("x86-64-v4", _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
               ("x86-64-v3", _V3),
               ("x86-64", set())],
    "aarch64": [("armv8-a", set())],
}

KINDS = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}

SANITIZE_ENV = "SPECDEC_KERNELS_SANITIZE"
"""Set to `address` to build the kernels with AddressSanitizer (tests only: the process must then run
with the compiler's libasan preloaded, `LD_PRELOAD=$(cc -print-file-name=libasan.so)`; see
`tests/unit/test_native_asan.py`). Such builds are cached apart from the others."""


def sanitize_flags() -> list[str]:
    """Compiler and linker flags `SANITIZE_ENV` asks for (none by default)."""
    kind = os.environ.get(SANITIZE_ENV, "")
    if not kind:
        return []
    if kind != "address":
        raise ValueError(f"${SANITIZE_ENV}={kind!r}: only 'address' is supported")
    return ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]


class KernelStatus(enum.IntEnum):
    """What the kernels' entry points return (`csrc/status.h`)."""

    OK = 0
    BAD_SHAPE = -1  # a size outside what the kernel takes
    NO_MEMORY = -2  # its scratch memory could not be allocated
    PREFIX_WRITE = -3  # a row's new keys/values would be stored inside its shared prefix
    OUT_OF_BOUNDS = -4  # the call would read or write past a buffer it was given


def raise_status(code: int, what: str) -> None:
    """Raise what a kernel's status `code` (not OK) means for a call of `what`: MemoryError where its
    scratch memory could not be had, ValueError for a call it refused."""
    status = KernelStatus(code)
    if status == KernelStatus.NO_MEMORY:
        raise MemoryError(f"{what} could not allocate its scratch memory")
    reason = {KernelStatus.BAD_SHAPE: "a size outside what the kernels take",
              KernelStatus.PREFIX_WRITE: "a row's new positions lie in its shared prefix (read-only)",
              KernelStatus.OUT_OF_BOUNDS: "it would read or write past its buffers"}
    raise ValueError(f"{what} refused the call: {reason.get(status, status.name)}")


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s storage from its first element on: what a kernel given its pointer may touch."""
    return int(tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size())


def cache_dir() -> Path:
    """Where built kernels are kept: $SPECDEC_CACHE_DIR, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec."""
    root = os.environ.get("SPECDEC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "specdec")
    return Path(root) / "kernels"


def _sources() -> dict[str, bytes]:
    folder = resources.files("specdec.runtime").joinpath("csrc")
    return {name: folder.joinpath(name).read_bytes() for name in (*HEADERS, *SOURCES)}


def source_hash() -> str:
    """Names a build of exactly these sources (a library built from other sources is never loaded)."""
    digest = hashlib.sha256()
    for name, text in _sources().items():
        digest.update(name.encode() + b"\0" + text + b"\0")
    return digest.hexdigest()[:16]


def _cpu() -> str:
    """What -march=native depends on: the CPU's model and feature flags (a cache shared by machines
    of different CPUs keeps one build for each)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


def _cpu_flags() -> set[str]:
    return {flag for line in _cpu().splitlines() if line.startswith(("flags", "Features"))
            for flag in line.split(":", 1)[1].split()}


def portable_isas() -> list[str]:
    """The instruction sets `prebuild` targets on this architecture, best first."""
    return [isa for isa, _ in _ISAS.get(platform.machine(), [])]


def runnable_isas() -> list[str]:
    """The portable instruction sets this CPU runs, best first."""
    flags = _cpu_flags()
    return [isa for isa, needs in _ISAS.get(platform.machine(), []) if needs <= flags]


def _prebuilt() -> Path | None:
    """The best library in $SPECDEC_PREBUILT_KERNELS that this CPU runs and these sources made."""
    folder = os.environ.get("SPECDEC_PREBUILT_KERNELS")
    if not folder:
        return None
    for isa in runnable_isas():
        path = Path(folder) / f"kernels-{source_hash()}-{isa}.so"
        if path.exists():
            return path
    return None


def _mapped_openmp() -> list[str]:
    """The OpenMP runtimes (libgomp, libiomp, libomp) mapped into this process, by path."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths = {line.split(None, 5)[-1] for line in maps.splitlines() if line.count(" ") >= 5}
    return sorted(p for p in paths if Path(p).name.startswith(("libgomp", "libiomp", "libomp")))


def torch_openmp() -> Path | None:
    """The OpenMP runtime torch runs its operators on (its libgomp, once torch is loaded), or None
    where torch uses none that the kernels can link (then they link the compiler's own)."""
    import torch.nn.functional  # noqa: F401 (torch's CPU library, and so its runtime, is loaded)

    for path in _mapped_openmp():
        if Path(path).name.startswith("libgomp") and Path(path).is_file():
            return Path(path)
    return None


def _link_openmp() -> list[str]:
    """The link arguments that bind the library to torch's OpenMP runtime (`torch_openmp`)."""
    runtime = torch_openmp()
    if runtime is None:
        return ["-fopenmp"]
    return [str(runtime), f"-Wl,-rpath,{runtime.parent}"]


@functools.lru_cache(maxsize=1)
def library() -> tuple[Any, str]:
    """The kernels (a ctypes library) and "", or None and why there are none."""
    target = _prebuilt()
    if target is None:
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not compiler or not shutil.which(compiler):
            return None, "no C compiler (cc) on the PATH, and no prebuilt kernels ($SPECDEC_PREBUILT_KERNELS)"
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
        flags = " ".join(_FLAGS + NATIVE + sanitize_flags() + _link_openmp())
        key = hashlib.sha256("\0".join([source_hash(), flags, version, _cpu()]).encode())
        target = cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
        if not target.exists():
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                _build(compiler, NATIVE, target)
            except (OSError, subprocess.CalledProcessError) as e:
                detail = getattr(e, "stderr", "") or str(e)
                return None, f"building the native kernels failed: {detail.strip()[-2000:]}"
    try:
        lib = load(target)
    except OSError as e:  # e.g. a cache directory mounted noexec
        return None, f"loading the native kernels failed: {e}"
    log.info("native kernels: %s", target)
    runtimes = _mapped_openmp()
    if len(runtimes) > 1:
        log.warning("%d OpenMP runtimes in this process (%s): the kernels' threads and torch's compete for the "
                    "cores", len(runtimes), ", ".join(runtimes))
    return lib, ""


def load(path: Path) -> Any:
    """The library at `path`, its entry points typed (`library()` finds which one to load)."""
    lib = ctypes.CDLL(str(path))
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    for kind in KINDS.values():
        fn = getattr(lib, f"specdec_attend_{kind}")
        fn.restype = i32
        fn.argtypes = [i32, ptr, i32, ptr, i32, i32, i32, i32, i64, ptr, ptr, ptr, ptr, ctypes.c_double, i32]
    lib.specdec_linear_f32.restype = i32
    lib.specdec_linear_f32.argtypes = [i32, i32, i32, ptr, i64, i64, ptr, i64, ptr, i64, i64, i32]
    f32 = ctypes.c_float
    for kind in ("f32", "bf16"):
        for name, argtypes in (("rms_norm", [i32, i32, ptr, i64, ptr, i64, ptr, f32, ptr, i64, i32]),
                               ("rope", [i32, i32, i32, ptr, i64, ptr, ptr, i64, i32]),
                               ("silu_mul", [i32, i32, ptr, i64, ptr, i64, i32])):
            fn = getattr(lib, f"specdec_{name}_{kind}")
            fn.restype, fn.argtypes = i32, argtypes
    lib.specdec_llama_layers_f32.restype = i32
    lib.specdec_llama_layers_f32.argtypes = [i32, ptr, *[i32] * 6, *[ptr] * 9, i32, ptr, i32, ptr, ctypes.c_double,
                                             i32]
    lib.specdec_park_ticket.restype = ctypes.c_uint64
    lib.specdec_park_ticket.argtypes = []
    lib.specdec_park.restype = i32
    lib.specdec_park.argtypes = [ctypes.c_uint64, i32, i32]
    lib.specdec_unpark.restype = None
    lib.specdec_unpark.argtypes = []
    return lib


def _build(compiler: str, arch: list[str], target: Path) -> None:
    """Compile, then link without -ffast-math (linking with it would set flush-to-zero for the whole
    process), into a temporary file renamed into place: concurrent builders do not collide."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for name, text in _sources().items():
            (Path(tmp) / name).write_bytes(text)
        sanitize = sanitize_flags()
        for name in SOURCES:
            objects.append(name.removesuffix(".c") + ".o")
            subprocess.run([compiler, *_FLAGS, *arch, *sanitize, "-c", name, "-o", objects[-1]], cwd=tmp, check=True,
                           capture_output=True, text=True)
        subprocess.run([compiler, "-shared", *sanitize, *objects, "-o", "kernels.so", *_link_openmp(), "-lmvec",
                        "-lm"],
                       cwd=tmp, check=True, capture_output=True, text=True)
        os.replace(Path(tmp) / "kernels.so", target)
        log.info("built the native kernels into %s", target)


def prebuild(folder: Path, compiler: str = "cc") -> list[Path]:
    """Build the kernels into `folder` for every portable instruction set of this architecture (what
    $SPECDEC_PREBUILT_KERNELS points at where no compiler runs); returns the libraries."""
    isas = portable_isas()
    if not isas:
        raise RuntimeError(f"no portable instruction sets are known for {platform.machine()}")
    folder.mkdir(parents=True, exist_ok=True)
    built = []
    for isa in isas:
        built.append(folder / f"kernels-{source_hash()}-{isa}.so")
        _build(compiler, [f"-march={isa}"], built[-1])
    return built


def unavailable(device: torch.device, dtype: torch.dtype) -> str:
    """Why the kernels cannot run for tensors of `dtype` on `device` ("" when they can)."""
    if device.type != "cpu":
        return f"the native kernels run on a CPU, not {device.type}"
    if dtype not in KINDS:
        return f"the native kernels run float32, float64 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    return library()[1]


def linear(x: torch.Tensor, weights: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """`out` `[m, sum n_i]` = `x` `[m, k]` times each `weights[i]` `[n_i, k]` transposed, side by side
    (the fused q/k/v or gate/up of a layer, read where the model keeps them); float32, m <= LINEAR_MAX_ROWS."""
    lib, why = library()
    if lib is None:
        raise RuntimeError(why)
    m, k = x.shape
    if x.stride(1) != 1 or out.stride(1) != 1 or m > LINEAR_MAX_ROWS:
        raise ValueError(f"the linear kernel takes at most {LINEAR_MAX_ROWS} rows with contiguous features")
    if x.dtype != torch.float32 or out.dtype != torch.float32 or out.shape[0] != m:
        raise ValueError(f"the linear kernel takes float32 x [m, k] and out [m, n], got {x.dtype} {tuple(x.shape)} "
                         f"and {out.dtype} {tuple(out.shape)}")
    if sum(w.shape[0] for w in weights) != out.shape[1]:
        raise ValueError(f"weights of {sum(w.shape[0] for w in weights)} rows in all fill {out.shape[1]} columns")
    column, threads = 0, torch.get_num_threads()
    x_bytes, out_bytes = storage_bytes(x), storage_bytes(out)
    for w in weights:
        if not w.is_contiguous() or w.ndim != 2 or w.shape[1] != k or w.dtype != torch.float32:
            raise ValueError("the linear kernel takes contiguous float32 weights [n, k]")
        status = lib.specdec_linear_f32(m, w.shape[0], k, x.data_ptr(), x.stride(0), x_bytes, w.data_ptr(),
                                        storage_bytes(w), out.data_ptr() + 4 * column, out.stride(0),
                                        out_bytes - 4 * column, threads)
        if status != KernelStatus.OK:
            raise ValueError(f"the linear kernel refused a [{m}, {k}] x [{w.shape[0]}, {k}] product "
                             f"({KernelStatus(status).name})")
        column += w.shape[0]
    return out


class Parking:
    """The model thread's OpenMP workers asleep while it has nothing to run (`csrc/park.c`).

    After a parallel region libgomp's workers spin for the next one (about 3 ms here) before they
    sleep; when the model thread goes idle that spinning holds the cores that the next request's
    own path needs (the service's event loop; the caller and the draft on a shared machine). The
    batcher hands `park` to the model thread when it goes idle and calls `unpark` before it gives
    that thread anything else. `ticket` is taken before the park is handed over, so an unpark that
    comes before the park starts is not missed."""

    TIMEOUT_MS = 1000  # a park ends by itself after this (the workers then spin, then sleep, as before)

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def ticket(self) -> int:
        return int(self._lib.specdec_park_ticket())

    def park(self, ticket: int) -> None:
        """On the model thread: its team's threads sleep until an unpark after `ticket`."""
        self._lib.specdec_park(ticket, torch.get_num_threads(), self.TIMEOUT_MS)

    def unpark(self) -> None:
        self._lib.specdec_unpark()


def parking() -> Parking | None:
    """`Parking` on the kernels' library; None where there is none (the workers then spin as before)."""
    lib, _ = library()
    return None if lib is None else Parking(lib)


class LayerOps:
    """The elementwise work of a Llama layer in float32 or bfloat16 (`csrc/layer.c`, the `dtype` given
    here), one C call each, on tensors of that dtype the caller shaped and laid out (rows `[t, n]`,
    features contiguous: checked by the pass once, not here on every call)."""

    DTYPES = {dtype: kind for dtype, kind in KINDS.items() if kind != "f64"}  # layer.c has no float64 entry points

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        lib, why = library()
        if lib is None:
            raise RuntimeError(why)
        kind = self.DTYPES.get(dtype)
        if kind is None:
            raise ValueError(f"the native layer kernels take {' or '.join(map(str, self.DTYPES))}, not {dtype}")
        self.dtype = dtype
        self._norm, self._rope, self._silu = (getattr(lib, f"specdec_{name}_{kind}")
                                              for name in ("rms_norm", "rope", "silu_mul"))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                 delta: torch.Tensor | None = None) -> torch.Tensor:
        """`x += delta` (in place, when given), then `out` = RMSNorm(x) * weight; all `[t, n]` of the ops'
        dtype (`weight` `[n]`)."""
        t, n = x.shape
        rc = self._norm(t, n, x.data_ptr(), x.stride(0), delta.data_ptr() if delta is not None else None,
                        delta.stride(0) if delta is not None else 0, weight.data_ptr(), eps, out.data_ptr(),
                        out.stride(0), torch.get_num_threads())
        if rc:
            raise ValueError(f"rms_norm refused [{t}, {n}] ({KernelStatus(rc).name})")
        return out

    def rope(self, qk: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first `heads` heads of each row of `qk` `[t, >= heads * head_dim]` in place by the
        row's `cos`, `sin` `[t, head_dim]` (transformers' `x * cos + rotate_half(x) * sin`)."""
        rc = self._rope(qk.shape[0], heads, head_dim, qk.data_ptr(), qk.stride(0), cos.data_ptr(), sin.data_ptr(),
                        cos.stride(0), torch.get_num_threads())
        if rc:
            raise ValueError(f"rope refused {heads} heads of {head_dim} ({KernelStatus(rc).name})")

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` `[t, n]` = silu(gate) * up, where `gate_up` `[t, 2n]` holds them side by side."""
        t, n = out.shape
        rc = self._silu(t, n, gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0),
                        torch.get_num_threads())
        if rc:
            raise ValueError(f"silu_mul refused [{t}, {n}] ({KernelStatus(rc).name})")
        return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.runtime.native", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("prebuild", help="build the kernels for this architecture's portable instruction "
                                "sets into FOLDER (then set SPECDEC_PREBUILT_KERNELS=FOLDER)")
    build.add_argument("folder", type=Path)
    build.add_argument("--cc", default=os.environ.get("CC", "cc"), help="C compiler (default: $CC or cc)")
    args = parser.parse_args()
    for path in prebuild(args.folder, args.cc):
        print(path)


if __name__ == "__main__":
    main()
