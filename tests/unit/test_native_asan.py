"""The native kernels' tests again, with the kernels built with AddressSanitizer: a read or write past
any buffer they are given (a test's, torch's) fails the run, where without it a kernel could read
garbage and pass. `make test` runs this wherever the C compiler ships libasan (GCC and Clang on
Linux); elsewhere it is skipped.

The Python host is not instrumented, so the test runs pytest in a subprocess with the compiler's
libasan preloaded (`LD_PRELOAD`: ASan's runtime must come first) and
`SPECDEC_KERNELS_SANITIZE=address`, which makes `specdec.runtime.native` build (and prebuild) the
kernels with `-fsanitize=address` into a cache of their own. Leak checks are off (CPython and torch
keep memory to the end by design)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.runtime.native import SANITIZE_ENV

ROOT = Path(__file__).resolve().parents[2]
SANITIZED = [
    "tests/unit/test_native_attention.py",
    "tests/unit/test_native_kernels.py",
    "tests/unit/test_kv_integrity.py",
    "tests/unit/test_layer_stack.py",
    "tests/unit/test_quant_kernels.py",
]
NOT_UNDER_ASAN = (  # about processes and loading, not memory: slow under a preloaded runtime, nothing to find
    "not test_a_service_asked_for_what_its_machine_cannot_run and not test_prebuilt_kernels_load_without_a_compiler")


def libasan() -> str | None:
    """The C compiler's ASan runtime, if it has one and can build with it."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None
    found = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(found) or not Path(found).exists():
        return None
    probe = subprocess.run([compiler, "-fsanitize=address", "-shared", "-fPIC", "-x", "c", "-", "-o", os.devnull],
                           input="int f(int *p) { return p[1]; }\n", capture_output=True, text=True)
    return str(Path(found).resolve()) if probe.returncode == 0 else None


def test_the_native_kernel_tests_pass_under_address_sanitizer(tmp_path):
    runtime = libasan()
    if runtime is None:
        pytest.skip("the C compiler has no AddressSanitizer runtime (libasan)")
    env = {**os.environ, "LD_PRELOAD": runtime, SANITIZE_ENV: "address",
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
           "SPECDEC_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("SPECDEC_PREBUILT_KERNELS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "-k", NOT_UNDER_ASAN, *SANITIZED], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    report = run.stdout[-6000:] + run.stderr[-6000:]
    assert "AddressSanitizer" not in run.stdout + run.stderr, report
    assert run.returncode == 0, report
    assert " passed" in run.stdout, report
