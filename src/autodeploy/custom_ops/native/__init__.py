"""Native CPU kernels: sources built once per machine with its compilers and loaded into torch.

Three operators, registered from ``ops.cpp``:

- ``auto_deploy::int8_gemv``: int8-weight products for decode with AVX-512 VNNI (``int8_gemv.c``);
  :func:`int8_gemv_available` says whether this CPU runs it.
- ``auto_deploy::decode_attention``: float32 attention of one new token per sequence over the paged KV
  cache, read in place (``decode_attention.c``, AVX-512); :func:`decode_attention_available` says whether
  this CPU runs it.
- ``auto_deploy::f32_linear``: float32 linear layers, with a kernel for decode batches (up to 16 rows)
  that reads the weight in its own layout, AVX-512 (``f32_small_gemm.c``), and torch's linear for more
  rows; :func:`f32_linear_available` says whether this CPU runs it.

The library is compiled on first use with ``$CC`` / ``$CXX`` (default ``cc`` / ``c++``), ``-O3
-march=native -fopenmp`` and torch's headers (6-7 s on a 2-core x86 VM) into ``~/.cache/autodeploy/native/``
(``$XDG_CACHE_HOME``), under a name that hashes the sources, the flags, the compilers, torch's version and
the CPU, so an upgrade or another machine sharing the home directory builds its own. It links against the
OpenMP runtime torch has loaded, so it shares torch's threads.

Without compilers, off x86, or with ``AUTODEPLOY_NATIVE_KERNELS=0``, :func:`library` returns None; on a CPU
without a kernel's instructions, its ``*_available`` is False. Either way the callers use torch's kernels,
and the reason is logged once.
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
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]


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


#: the library loaded into this process: its operators register when the file is loaded, and an operator
#: cannot be registered twice, so a process loads one build and keeps it
_loaded: ctypes.CDLL | None = None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library (its operators registered), or None (with the reason logged once) where
    it cannot be built or loaded."""
    global _loaded
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
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
            path = _build(cc, cxx)
            _loaded = ctypes.CDLL(str(path))  # registers the operator
            torch.ops.load_library(str(path))  # and tells torch.ops about the file
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            ad_logger.warning(f"native kernels unavailable, using torch's kernels: {err}")
            return None

        @torch.library.register_fake("auto_deploy::int8_gemv")
        def _int8_gemv_fake(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)

        @torch.library.register_fake("auto_deploy::decode_attention")
        def _decode_attention_fake(q, k_cache, v_cache, input_pos, page_table, scale, sliding_window):
            return q.new_empty(*q.shape[:-1], v_cache.shape[-1])

        @torch.library.register_fake("auto_deploy::f32_linear")
        def _f32_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
            return x.new_empty(*x.shape[:-1], weight.shape[0])

    return _loaded


@functools.cache
def _runs_here(kernel: str, needs: str) -> bool:
    """Whether the library loaded and this CPU has what ``kernel`` needs (``<kernel>_supported()``)."""
    lib = library()
    if lib is None:
        return False
    if not getattr(lib, f"{kernel}_supported")():
        ad_logger.info(f"native {kernel} unavailable: this CPU has no {needs}; using torch's kernels")
        return False
    return True


def int8_gemv_available() -> bool:
    """Whether ``auto_deploy::int8_gemv`` runs here: the library loaded and the CPU has AVX-512 VNNI."""
    return _runs_here("int8_gemv", "AVX-512 VNNI")


def decode_attention_available() -> bool:
    """Whether ``auto_deploy::decode_attention`` runs here: the library loaded and the CPU has AVX-512."""
    return _runs_here("decode_attention", "AVX-512")


def f32_linear_available() -> bool:
    """Whether ``auto_deploy::f32_linear`` runs here: the library loaded and the CPU has AVX-512."""
    return _runs_here("f32_small_gemm", "AVX-512")


def int8_gemv_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether :func:`int8_gemv` takes these inputs (given :func:`int8_gemv_available`): CPU float32 activations, a
    contiguous int8 weight whose row length is a multiple of 64 and bfloat16 scales. Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.int8
            and scale.dtype == torch.bfloat16 and weight.is_contiguous() and scale.is_contiguous()
            and weight.shape[1] % 64 == 0 and x.shape[-1] == weight.shape[1])


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ (weight [N, K] * scale[:, None]).T`` in float32 (see ``int8_gemv.c`` for the
    numerics): the ``auto_deploy::int8_gemv`` operator. The caller checks :func:`int8_gemv_available`
    and :func:`int8_gemv_takes` first (the operator rejects other inputs with an error)."""
    return torch.ops.auto_deploy.int8_gemv(x, weight, scale)


def decode_attention_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these inputs (given :func:`decode_attention_available`): CPU
    float32 query and contiguous caches with head sizes that are multiples of 16. Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    return (q.device.type == "cpu" and all(t.dtype == torch.float32 for t in (q, k_cache, v_cache))
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[-1] % 16 == 0 and v_cache.shape[-1] % 16 == 0)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
                     page_table: torch.Tensor, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence (``q`` [..., n_heads, head_dim], one token per sequence)
    over its paged cache, already holding the new token's k/v: the ``auto_deploy::decode_attention``
    operator (see ``decode_attention.c``). No sinks or logit soft-capping; the caller checks
    :func:`decode_attention_available` and :func:`decode_attention_takes` first."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    return torch.ops.auto_deploy.decode_attention(q, k_cache, v_cache, input_pos, page_table, scale, window)


#: up to this many rows ``auto_deploy::f32_linear`` uses the native kernel (``kSmallGemmMaxRows``)
F32_LINEAR_NATIVE_MAX_ROWS = 16


def f32_linear_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`f32_linear` takes these inputs (given :func:`f32_linear_available`): CPU float32
    activations, a contiguous float32 [N, K] weight with K a multiple of 16, and a float32 bias or none.
    Checks only dtypes, devices and shapes, so it also runs while torch.compile traces."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[1] % 16 == 0 and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu")))


def f32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in float32: the ``auto_deploy::f32_linear`` operator, the native kernel
    (see ``f32_small_gemm.c``) up to :data:`F32_LINEAR_NATIVE_MAX_ROWS` rows and torch's linear beyond. The
    caller checks :func:`f32_linear_available` and :func:`f32_linear_takes` first (the operator rejects
    other inputs with an error)."""
    return torch.ops.auto_deploy.f32_linear(x, weight, bias)
