"""Native CPU kernels: sources built once per machine with its compilers, loaded into torch as the CPU
implementations of auto_deploy ops.

Every op these kernels implement has its schema, a plain-torch implementation and a fake implementation in
Python, so the op exists and runs everywhere; where a kernel builds and this CPU runs it, the kernel
replaces the plain-torch implementation for CPU tensors (``ops.cpp``):

- ``auto_deploy::int8_gemv`` (``custom_ops/quant_linear.py``): int8-weight products for decode, AVX-512
  VNNI (``int8_gemv.c``); the same arithmetic as its plain-torch implementation.
- ``auto_deploy::decode_attention`` (``custom_ops/cached_attention.py``): float32 attention of one new token
  per sequence over the paged KV cache, read in place, AVX-512 (``decode_attention.c``).
- ``auto_deploy::f32_linear`` (``custom_ops/linear.py``): float32 linear layers, a kernel for decode
  batches (up to 16 rows) that reads the weight in its own layout, AVX-512 (``f32_small_gemm.c``), and
  torch's linear for more rows.

``*_available()`` says whether a kernel runs here; callers use it to choose a path, never to ask whether an
op exists. The library is compiled on first use with ``$CC`` / ``$CXX`` (default ``cc`` / ``c++``), ``-O3
-march=native -fopenmp`` (``-march=$AUTODEPLOY_NATIVE_MARCH`` where set) and torch's headers into
``~/.cache/autodeploy/native/`` (``$XDG_CACHE_HOME``), under a name that hashes the sources, the flags, the
compilers, torch's version and the CPU, so an upgrade or another machine sharing the home directory builds
its own. It links against the OpenMP runtime torch
has loaded, so it shares torch's threads.

Without compilers, off x86, or with ``AUTODEPLOY_NATIVE_KERNELS=0``, :func:`library` returns None and every
op runs its plain-torch implementation; the reason is logged once.
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
_KERNEL_SOURCES = tuple(Path(__file__).with_name(name)
                        for name in ("int8_gemv.c", "decode_attention.c", "f32_small_gemm.c"))
_OP_SOURCE = Path(__file__).with_name("ops.cpp")
#: the target the kernels are compiled for: this CPU, unless ``AUTODEPLOY_NATIVE_MARCH`` names another (e.g.
#: ``x86-64-v3``, AVX2 + FMA: what runs on an AVX-512 machine as it would on an AVX2-only one)
MARCH_ENV = "AUTODEPLOY_NATIVE_MARCH"
_FLAGS = ["-O3", f"-march={os.environ.get(MARCH_ENV) or 'native'}", "-fopenmp", "-fPIC"]


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(wanted))  # first CPU's lines; the others repeat them


def _torch_build_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags for code that includes torch's headers and links its libraries."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compile_flags = ["-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    compile_flags += [f"-I{path}" for path in cpp_extension.include_paths()]
    link_flags = [f"-L{path}" for path in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    return compile_flags, link_flags


def _run(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {result.stderr.strip()[-800:]}")


def _build(cc: str, cxx: str) -> Path:
    """Compile the library unless an identical build is cached; returns its path."""
    compile_flags, link_flags = _torch_build_flags()
    parts = [*(source.read_bytes() for source in (*_KERNEL_SOURCES, _OP_SOURCE)),
             " ".join(_FLAGS + compile_flags).encode(), cc.encode(), cxx.encode(), torch.__version__.encode(),
             _cpu_identity().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / "native" / f"kernels-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    ad_logger.info(f"building the native kernels for this machine (once, a few seconds): {target}")
    start = time.perf_counter()
    # build in a scratch folder beside the target, then rename: concurrent builds never load a partial file
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        objects = [Path(scratch) / f"{source.stem}.o" for source in _KERNEL_SOURCES]
        for source, obj in zip(_KERNEL_SOURCES, objects):
            _run([cc, *_FLAGS, "-c", str(source), "-o", str(obj)])
        library_file = Path(scratch) / "library.so"
        _run([cxx, *_FLAGS, *compile_flags, "-shared", str(_OP_SOURCE), *map(str, objects), "-o",
              str(library_file), *link_flags])
        os.replace(library_file, target)
    ad_logger.info(f"native kernels built in {time.perf_counter() - start:.1f} s")
    return target


#: the library loaded into this process: its kernels register as the ops' CPU implementations, which cannot
#: be registered twice, so a process loads one build and keeps it
_loaded: ctypes.CDLL | None = None

#: kernel -> (the op it implements on CPU, what the CPU needs for it)
#: (in the argument order of ops.cpp's autodeploy_register_cpu_kernels)
_KERNELS = {"int8_gemv": ("int8_gemv", "AVX-512 VNNI"), "decode_attention": ("decode_attention", "AVX-512"),
            "f32_small_gemm": ("f32_linear", "AVX-512")}


def enabled() -> bool:
    """Whether the native kernels may be used (``AUTODEPLOY_NATIVE_KERNELS`` is not 0/false/no/off)."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, its kernels registered as the CPU implementations of their ops where this
    CPU runs them; None (with the reason logged once) where it cannot be built or loaded."""
    global _loaded
    if not enabled():
        ad_logger.info(f"native kernels disabled by {DISABLE_ENV}")
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        ad_logger.debug(f"native kernels: none for {platform.machine()}")
        return None
    if _loaded is None:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if cc is None or cxx is None:
            ad_logger.info("native kernels unavailable: no C/C++ compiler (set CC and CXX); using torch's kernels")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc, cxx)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            ad_logger.warning(f"native kernels unavailable, using torch's kernels: {err}")
            return None
        runs = {kernel: bool(getattr(lib, f"{kernel}_supported")()) for kernel in _KERNELS}
        if lib.autodeploy_register_cpu_kernels(*(int(run) for run in runs.values())) != 0:  # _KERNELS' order
            ad_logger.warning("native kernels unavailable, using torch's kernels: their registration failed")
            return None
        for kernel, (op, needs) in _KERNELS.items():
            if not runs[kernel]:
                ad_logger.info(f"native {kernel} unavailable: it needs {needs}, which this build or CPU lacks; "
                               f"auto_deploy::{op} runs its plain-torch implementation")
        _loaded = lib
    return _loaded


@functools.cache
def _runs_here(kernel: str) -> bool:
    """Whether the library loaded and ``kernel`` is registered (this CPU has what it needs)."""
    lib = library()
    return lib is not None and bool(getattr(lib, f"{kernel}_supported")())


def int8_gemv_available() -> bool:
    """Whether ``auto_deploy::int8_gemv`` runs the native kernel here (the library loaded, AVX-512 VNNI)."""
    return _runs_here("int8_gemv")


def decode_attention_available() -> bool:
    """Whether ``auto_deploy::decode_attention`` runs the native kernel here (the library loaded, AVX-512)."""
    return _runs_here("decode_attention")


def f32_linear_available() -> bool:
    """Whether ``auto_deploy::f32_linear`` runs the native kernel here (the library loaded, AVX-512)."""
    return _runs_here("f32_small_gemm")


def int8_gemv_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the ``int8_gemv`` kernel takes these inputs: CPU float32 activations, a
    contiguous int8 weight whose row length is a multiple of 64 and bfloat16 scales. Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.int8
            and scale.dtype == torch.bfloat16 and weight.is_contiguous() and scale.is_contiguous()
            and weight.shape[1] % 64 == 0 and x.shape[-1] == weight.shape[1])


def decode_attention_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the ``decode_attention`` kernel takes these inputs: CPU
    float32 query and contiguous caches with head sizes that are multiples of 16. Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    return (q.device.type == "cpu" and all(t.dtype == torch.float32 for t in (q, k_cache, v_cache))
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[-1] % 16 == 0 and v_cache.shape[-1] % 16 == 0)


#: up to this many rows ``auto_deploy::f32_linear`` uses the native kernel (``kSmallGemmMaxRows``)
F32_LINEAR_NATIVE_MAX_ROWS = 16


def f32_linear_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the ``f32_linear`` kernel takes these inputs: CPU float32
    activations, a contiguous float32 [N, K] weight with K a multiple of 16, and a float32 bias or none.
    Checks only dtypes, devices and shapes, so it also runs while torch.compile traces."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[1] % 16 == 0 and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu")))
