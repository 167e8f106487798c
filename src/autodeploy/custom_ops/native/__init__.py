"""Native CPU kernels: sources built once per machine with its compilers, loaded into torch as the CPU
implementations of auto_deploy ops.

Every op these kernels implement has its schema, a plain-torch implementation and a fake implementation in
Python, so the op exists and runs everywhere; where the kernels build, they replace the plain-torch
implementation for CPU tensors (``ops.cpp``):

- ``auto_deploy::f32_linear`` (``custom_ops/linear.py``): float32 linear layers, a kernel that reads the
  weight in its own layout, up to the build's :func:`f32_max_rows` rows (64 on AVX-512 and AVX2, decode
  batches of 16 on NEON), torch's fastest float32 GEMM for more rows (oneDNN's linear on x86);
- ``auto_deploy::half_linear`` / ``int4_linear`` (``half_linear.py``, ``int4_linear.py``): 16-bit and
  4-bit weights with float32 arithmetic, widened in registers for decode batches, a tile at a time for more
  rows; past :func:`gemm_max_rows`, a block of rows at a time for that float32 GEMM;
- ``auto_deploy::int8_gemv`` (``quant_linear.py``): int8-weight products for decode with the activations
  rounded to 16 bits per row and exact integer sums, the same arithmetic as its plain-torch implementation;
- ``auto_deploy::decode_attention`` (``cached_attention.py``): float32 attention of one new token per
  sequence over the paged KV cache, read in place; ``prefill_attention``: causal float32 attention of a fresh
  sequence's prompt over its own keys; ``write_kv_cache``: the new tokens' k/v into their slots of the paged
  caches (a copy per token, in ``ops.cpp``: no kernel of a build);
- ``auto_deploy::rms_norm`` / ``silu_mul`` / ``rope`` (``pointwise.py``): the float32 pointwise work of prompts
  between their products, one pass over the rows each.

The kernels (``kernels.cpp``) are written once over ATen's portable vector layer and compiled once per CPU
capability, with torch's names: ``AVX2`` (``-march=x86-64-v3``: AVX2 + FMA), ``AVX512`` (``x86-64-v4``)
and ``DEFAULT`` on ARM64 (NEON). The build for this CPU
is the one torch chooses for its own kernels (``torch.backends.cpu.get_cpu_capability()``, so
``ATEN_CPU_CAPABILITY=avx2`` runs the AVX2 kernels on an AVX-512 machine, as an AVX2-only one would); tests
switch builds with :func:`use_kernels`.

Each library is compiled on first use with ``$CXX`` (default ``c++``), ``-O3 -fopenmp`` and torch's headers
into ``~/.cache/autodeploy/native/`` (``$XDG_CACHE_HOME``), under a name that hashes the sources, the flags,
the compiler and torch's version. They link against the OpenMP runtime torch has loaded and split work with
``at::parallel_for``, so they share torch's threads.

Without a compiler, on a CPU without AVX2 (x86) or NEON (ARM64), or with ``AUTODEPLOY_NATIVE_KERNELS=0``,
:func:`library` returns None and every op runs its plain-torch implementation; the reason is logged once.
``*_available()`` says whether the kernels run here; callers use it to choose a path, never to ask whether
an op exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch

from ...utils.cache import cache_dir
from ...utils.logger import ad_logger

DISABLE_ENV = "AUTODEPLOY_NATIVE_KERNELS"
_KERNEL_SOURCE = Path(__file__).with_name("kernels.cpp")
_OP_SOURCE = Path(__file__).with_name("ops.cpp")
#: the headers the two sources include (kernels.h: the kernel table; amx.h: ops.cpp's AMX products; decode_loop.h:
#: the served decode step run from C++)
_HEADERS = tuple(Path(__file__).with_name(name) for name in ("kernels.h", "amx.h", "decode_loop.h"))
_FLAGS = ["-O3", "-fopenmp", "-fPIC"]
#: capability -> its compiler flags (the macros select at::vec's implementation for the instruction set)
#: (-falign-loops=64: each loop starts a cache line, so that a kernel's speed moves less with where the code before
#: it ends. On the Intel Xeon of docs/performance.md the AVX2 build's int8 decode at one row ran 5-8 % slower after a
#: change elsewhere in kernels.cpp, its own code unchanged; with the loops aligned, as fast as the earlier code's in
#: the alternating harness, 1.006x)
_CAPABILITY_FLAGS = {
    "AVX2": ["-march=x86-64-v3", "-DCPU_CAPABILITY_AVX2", "-falign-loops=64"],
    "AVX512": ["-march=x86-64-v4", "-DCPU_CAPABILITY_AVX512", "-falign-loops=64"],
    "DEFAULT": [],  # ARM64: NEON is in the base instruction set
}
#: the builds a CPU of each architecture may run, best first
_X86 = ("AVX512", "AVX2")
_ARM = ("DEFAULT",)


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


def _build(cxx: str, name: str, source: Path, flags: list[str]) -> Path:
    """Compile ``source`` into a shared library unless an identical build is cached; returns its path."""
    # the key names torch's install (its headers and libraries) rather than the flags derived from it:
    # ``cpp_extension``, which derives them, imports setuptools, which a cache hit never needs
    parts = [source.read_bytes(), *(header.read_bytes() for header in _HEADERS),
             " ".join([*_FLAGS, *flags]).encode(), cxx.encode(), torch.__version__.encode(),
             str(Path(torch.__file__).parent).encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = cache_dir() / "native" / f"{name}-{key}.so"
    if target.is_file():
        return target
    compile_flags, link_flags = _torch_build_flags()
    command_flags = [*_FLAGS, *flags, *compile_flags]
    target.parent.mkdir(parents=True, exist_ok=True)
    ad_logger.info(f"building the native {name} for this machine (once, a few seconds): {target}")
    start = time.perf_counter()
    # build in a scratch folder beside the target, then rename: concurrent builds never load a partial file
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        library_file = Path(scratch) / "library.so"
        _run([cxx, *command_flags, "-shared", str(source), "-o", str(library_file), *link_flags])
        os.replace(library_file, target)
    ad_logger.info(f"native {name} built in {time.perf_counter() - start:.1f} s")
    return target


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def enabled() -> bool:
    """Whether the native kernels may be used (``AUTODEPLOY_NATIVE_KERNELS`` is not 0/false/no/off)."""
    return os.environ.get(DISABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def runnable_capabilities() -> tuple[str, ...]:
    """The kernel builds this CPU runs, best first: those at or below the capability torch chooses for its
    own kernels (``ATEN_CPU_CAPABILITY`` lowers it)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return _ARM
    if machine not in ("x86_64", "amd64"):
        return ()
    level = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": _X86, "AVX2": ("AVX2",)}.get(level, ())


#: the op library loaded into this process: its kernels register as the ops' CPU implementations, which
#: cannot be registered twice, so a process loads one build and keeps it
_loaded: ctypes.CDLL | None = None
#: capability -> its loaded kernel library (kept loaded: the op library holds a pointer to its table)
_kernel_libraries: dict[str, ctypes.CDLL] = {}
_active: str | None = None


def build_kernels(capability: str, source: Path = _KERNEL_SOURCE, name: str | None = None) -> Path:
    """The kernel library of ``capability`` built from ``source`` (the package's kernels.cpp, or another version of
    it beside the package's kernels.h, as ``benchmarks/kernel_ab.py`` builds); cached like every build."""
    return _build(_compiler() or "c++", name or f"kernels-{capability}", source,
                  [*_CAPABILITY_FLAGS[capability], f"-DCPU_CAPABILITY={capability}", "-fvisibility=hidden",
                   "-fvisibility-inlines-hidden"])


def kernel_table_address(kernels: ctypes.CDLL, capability: str) -> int:
    """The address of the KernelTable a loaded kernel library of ``capability`` exports (what
    ``autodeploy_use_kernels`` takes)."""
    table = getattr(kernels, f"autodeploy_kernels_{capability}")
    table.restype = ctypes.c_void_p
    return table()


def _kernel_table(capability: str) -> int:
    """The address of the KernelTable of ``capability``'s build, built and loaded on first use."""
    if capability not in _kernel_libraries:
        _kernel_libraries[capability] = ctypes.CDLL(str(build_kernels(capability)))
    return kernel_table_address(_kernel_libraries[capability], capability)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded op library, the kernels of this CPU's build registered as the CPU implementations of
    their ops; None (with the reason logged once) where they cannot be built or loaded."""
    global _loaded, _active
    if not enabled():
        ad_logger.info(f"native kernels disabled by {DISABLE_ENV}")
        return None
    capabilities = runnable_capabilities()
    if not capabilities:
        ad_logger.info(f"native kernels unavailable: none for this CPU ({platform.machine()}, "
                       f"{torch.backends.cpu.get_cpu_capability()}); using torch's kernels")
        return None
    if _loaded is None:
        cxx = _compiler()
        if cxx is None:
            ad_logger.info("native kernels unavailable: no C++ compiler (set CXX); using torch's kernels")
            return None
        importlib.import_module("autodeploy.custom_ops")  # every op defined before its kernel registers
        try:
            # global: a decode package compiled with the ops' C shims (aoti_c_shims) finds them in the process
            lib = ctypes.CDLL(str(_build(cxx, "ops", _OP_SOURCE, ["-fvisibility=hidden",
                                                                  "-fvisibility-inlines-hidden"])),
                              mode=ctypes.RTLD_GLOBAL)
            lib.autodeploy_use_kernels.argtypes = [ctypes.c_void_p]
            lib.autodeploy_use_kernels(_kernel_table(capabilities[0]))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            ad_logger.warning(f"native kernels unavailable, using torch's kernels: {err}")
            return None
        defined = [hasattr(torch.ops.auto_deploy, op) for op in ("half_linear", "int4_linear")]
        if lib.autodeploy_register_cpu_kernels(*map(int, defined)) != 0:
            ad_logger.warning("native kernels unavailable, using torch's kernels: their registration failed")
            return None
        lib.autodeploy_gemm_max_rows.restype = lib.autodeploy_f32_max_rows.restype = ctypes.c_int64
        _loaded, _active = lib, capabilities[0]
        ad_logger.debug(f"native kernels: the {_active} build")
    return _loaded


#: the ops the op library also defines as C shims (``aoti_torch_cpu_<op>`` in ops.cpp, one output tensor each)
_C_SHIM_OPS = ("f32_linear", "f32_packed_linear", "half_linear", "half_packed_linear", "int4_linear",
               "int4_packed_linear", "int8_gemv", "materialize", "decode_attention", "decode_attention_rope")
#: the C type AOTInductor passes for each schema type of their arguments
_C_SHIM_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t",
                 "float": "double"}


def _c_shim_declaration(op: torch._ops.OpOverload) -> str:
    """The C declaration AOTInductor's generated code calls for ``op``, from its schema."""
    args = [f"{_C_SHIM_TYPES[str(a.type)]} {a.name}" for a in op._schema.arguments]
    return f"AOTITorchError aoti_torch_cpu_{op._schema.name.split('::')[-1]}({', '.join(args)}, AtenTensorHandle* ret)"


def aoti_c_shims() -> dict:
    """AOTInductor's ``aot_inductor.custom_ops_to_c_shims`` for the ops the native kernels implement: a decode
    package compiled with it calls them directly, not through the proxy executor. Empty where the kernels do
    not run (the package then calls the ops as any other)."""
    if library() is None:
        return {}
    ops = [getattr(torch.ops.auto_deploy, name).default for name in _C_SHIM_OPS if hasattr(torch.ops.auto_deploy, name)]
    return {op: [_c_shim_declaration(op)] for op in ops}


def capability() -> str | None:
    """The kernel build the ops run (e.g. ``AVX2``), None where the kernels do not run."""
    return _active if library() is not None else None


@contextlib.contextmanager
def use_kernels(name: str) -> Iterator[None]:
    """Run the ops with another build's kernels inside the block (tests compare every build this CPU runs
    with the plain-torch implementations)."""
    global _active
    lib = library()
    if lib is None or name not in runnable_capabilities():
        raise ValueError(f"the {name} kernels do not run here (this CPU runs {runnable_capabilities()})")
    previous = _active
    lib.autodeploy_use_kernels(_kernel_table(name))
    _active = name
    try:
        yield
    finally:
        lib.autodeploy_use_kernels(_kernel_table(previous))
        _active = previous


_LANES = {"AVX512": 16, "AVX2": 8, "DEFAULT": 4}
#: the builds whose int8_gemv and int4_linear products of many rows are integer products of 16-bit activation
#: pairs (kernels.cpp, AUTODEPLOY_PAIR_PRODUCTS), faster there than float32 arithmetic over the dequantized weights
PAIR_PRODUCT_BUILDS = frozenset({"AVX512", "AVX2"})


def _row_limit(name: str) -> int:
    """The active build's ``KernelTable::<name>``; 0 where the kernels do not run."""
    lib = library()
    return getattr(lib, f"autodeploy_{name}")() if lib is not None else 0


def f32_max_rows() -> int:
    """Up to this many rows ``f32_linear`` takes the active build's kernel (its ``KernelTable::f32_max_rows``);
    more rows take torch's fastest float32 GEMM (oneDNN's linear on x86). 0 where the kernels do not run."""
    return _row_limit("f32_max_rows")


def gemm_max_rows() -> int:
    """Up to this many rows the 16-bit, int8 and 4-bit float32-arithmetic products (``half_linear``,
    ``int8_mm``, ``int4_linear``) take the active build's kernels (its ``KernelTable::gemm_max_rows``); more rows take
    the float32 GEMM of f32_max_rows (kernels.cpp has the measurements). 0 where the kernels do not run."""
    return _row_limit("gemm_max_rows")


def f32_pack_width() -> int:
    """The weight rows per panel of the active build's packed float32 layout (``KernelTable::f32_pack_width``: 16
    on AVX-512 and AVX2), which ``f32_packed_linear`` reads fastest; 0 where the build reads none (NEON, untimed on
    hardware) or the kernels do not run."""
    return _row_limit("f32_pack_width")


def half_pack_width() -> int:
    """The weight rows per panel of the active build's packed 16-bit layout (``KernelTable::half_pack_width``: 16
    on AVX2), which ``half_packed_linear`` reads fastest; 0 where the build reads none (AVX-512: slower than
    ``half_linear`` at 1-2 rows there; NEON, untimed on hardware) or the kernels do not run."""
    return _row_limit("half_pack_width")


def int4_pack_rows() -> int:
    """The weight rows per tile of the active build's packed 4-bit layout (``KernelTable::int4_pack_rows``: 8 on
    AVX2, 16 on AVX-512), which ``int4_packed_linear`` reads fastest; 0 where the build takes none (NEON) or the
    kernels do not run."""
    return _row_limit("int4_pack_rows")


def pair_products() -> bool:
    """Whether the active build takes prompts of int8 weights fastest through ``int8_gemv`` (its pair
    products); a plain read, so it also runs while torch.compile traces."""
    return _active in PAIR_PRODUCT_BUILDS


def amx_products() -> frozenset[str]:
    """The prompt products that run on AMX here (ops.cpp, amx.h): ``"bf16"`` (``half_linear`` of bfloat16 weights,
    more than 64 rows) and ``"int8"`` (``int8_split_mm``); empty without AMX, with torch's oneDNN disabled, under
    ``ONEDNN_MAX_CPU_ISA`` below AMX, or where the native kernels do not run."""
    lib = library()
    bits = lib.autodeploy_amx_products() if lib is not None else 0
    return frozenset(name for bit, name in ((1, "bf16"), (2, "int8")) if bits & bit)


def vnni_products() -> bool:
    """Whether the active build's 4-bit products (decode rows and the quad products of prompts) use AVX512-VNNI here
    (kernels.cpp, ``with_vnni``): the AVX-512 build on a CPU with it, unless ``AUTODEPLOY_NATIVE_VNNI`` is 0 (read
    when the kernels load). Their sums are the same either way."""
    lib = library()
    return bool(lib.autodeploy_vnni_products()) if lib is not None else False


def floats_per_vector() -> int:
    """float32 lanes of one vector register in the active build (head and row sizes must be multiples); a
    plain read, so it also runs while torch.compile traces (callers ask ``*_available()`` first)."""
    return _LANES.get(_active or "", 16)


def _available() -> bool:
    return library() is not None


int8_gemv_available = decode_attention_available = f32_linear_available = _available
half_linear_available = int4_linear_available = pointwise_available = prefill_attention_available = _available
write_kv_cache_available = _available


def int8_gemv_takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether the ``int8_gemv`` kernel takes these inputs: CPU float32 activations, a
    contiguous int8 weight whose row length is a multiple of 64 and bfloat16 scales. Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.int8
            and scale.dtype == torch.bfloat16 and weight.is_contiguous() and scale.is_contiguous()
            and weight.shape[1] % 64 == 0 and x.shape[-1] == weight.shape[1])


def decode_attention_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the ``decode_attention`` kernel takes these inputs: CPU float32 query and contiguous caches
    with head sizes that are multiples of the vector width (:func:`floats_per_vector`). Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    lanes = floats_per_vector()
    return (q.device.type == "cpu" and all(t.dtype == torch.float32 for t in (q, k_cache, v_cache))
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[-1] % lanes == 0 and v_cache.shape[-1] % lanes == 0)



def write_kv_cache_takes(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native ``write_kv_cache`` takes these inputs: CPU float32 k / v [T, n_kv, d] and contiguous
    float32 caches [pages, page_size, n_kv, d] of the same head shapes."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (k, v, k_cache, v_cache))
            and k.dim() == v.dim() == 3 and k_cache.dim() == v_cache.dim() == 4
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k.shape[1:] == k_cache.shape[2:] and v.shape[1:] == v_cache.shape[2:])


def prefill_attention_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the ``prefill_attention`` kernel takes these inputs: CPU float32 q [T, n_heads, d] and k / v [T,
    n_kv, d] with n_heads a multiple of n_kv and head sizes that are multiples of the vector width."""
    lanes = floats_per_vector()
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 3 for t in (q, k, v))
            and q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
            and q.shape[2] == k.shape[2] and q.shape[2] % lanes == 0 and v.shape[2] % lanes == 0)


def f32_linear_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the ``f32_linear`` kernel takes these inputs: CPU float32 activations, a contiguous float32
    [N, K] weight with K a multiple of the vector width, and a float32 bias or none. Checks only dtypes,
    devices and shapes, so it also runs while torch.compile traces."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
            and weight.shape[1] % floats_per_vector() == 0 and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu")))
