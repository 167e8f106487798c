"""Native CPU kernels: C sources built once per machine with its C compiler and loaded with ctypes.

Only :func:`int8_gemv` exists (``int8_gemv.c``: int8-weight products for decode, with AVX-512 VNNI).
The library is compiled on first use with ``$CC`` (default ``cc``) and ``-O3 -march=native -fopenmp``
into ``~/.cache/autodeploy/native/`` (``$XDG_CACHE_HOME``), under a name that hashes the source, the
flags and the CPU, so an upgrade or another machine sharing the home directory builds its own. It links
against the OpenMP runtime torch has already loaded, so it shares torch's threads.

Without a compiler, on a CPU without VNNI, or with ``AUTODEPLOY_NATIVE_KERNELS=0``, :func:`int8_gemv`
returns None and the callers use torch's kernels; the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from ...utils.cache import cache_dir
from ...utils.logger import ad_logger

DISABLE_ENV = "AUTODEPLOY_NATIVE_KERNELS"
_SOURCE = Path(__file__).with_name("int8_gemv.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_kernel = None  # the library's int8_gemv, set by library()


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))  # first CPU's lines; the others repeat them


def _build(compiler: str) -> Path:
    """Compile the library unless an identical build is cached; returns its path."""
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), compiler.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:16]
    target = cache_dir() / "native" / f"int8_gemv-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # build beside the target, then rename: concurrent builds never load a half-written file
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", partial],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    ad_logger.info(f"native int8 kernel built in {time.perf_counter() - start:.1f} s: {target}")
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (with the reason logged once) where it cannot be used."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        ad_logger.info(f"native kernels disabled by {DISABLE_ENV}")
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        ad_logger.debug(f"native kernels: none for {platform.machine()}")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        ad_logger.info("native kernels unavailable: no C compiler (set CC); using torch's int8 kernels")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        ad_logger.warning(f"native kernels unavailable, using torch's int8 kernels: {err}")
        return None
    if not lib.int8_gemv_supported():
        ad_logger.info("native kernels unavailable: this CPU has no AVX-512 VNNI; using torch's int8 kernels")
        return None
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.int8_gemv.argtypes = [pointer, pointer, pointer, pointer, i64, i64, i64, ctypes.c_int]
    lib.int8_gemv.restype = ctypes.c_int
    global _kernel
    _kernel = lib.int8_gemv
    return lib


def int8_gemv_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether :func:`int8_gemv` takes these inputs (given the library): CPU float32 activations, a
    contiguous int8 weight whose row length is a multiple of 64 and bfloat16 scales. Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.int8
            and scale.dtype == torch.bfloat16 and weight.is_contiguous() and scale.is_contiguous()
            and weight.shape[1] % 64 == 0 and x.shape[-1] == weight.shape[1])


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (weight [N, K] * scale[:, None]).T`` in float32 (see ``int8_gemv.c`` for the
    numerics). The caller checks :func:`library` and :func:`int8_gemv_takes` first."""
    x = x.contiguous()
    rows, (cols, depth) = x.numel() // x.shape[-1], weight.shape
    out = torch.empty(*x.shape[:-1], cols, dtype=torch.float32)
    status = _kernel(x.data_ptr(), weight.data_ptr(), scale.data_ptr(), out.data_ptr(), rows, cols, depth,
                     torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"int8_gemv failed for x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return out
