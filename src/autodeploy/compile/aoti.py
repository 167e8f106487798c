"""The ``aoti`` backend: the decode step compiled ahead of time by AOTInductor into a package of code only.

The decode graph (:func:`~autodeploy.compile.torch_compile.decode_graph`: one token per sequence, no host
syncs) is exported with a dynamic batch and page-table width and compiled by AOTInductor *without* its
constants (``aot_inductor.package_constants_in_so=False``): the package is a few MB of code, and the weights
and KV caches are handed to it at load as user-managed constants, the very tensors the cached graph holds
(not copies; the cache writes land in them). Every other batch (prefill, chunked, mixed) runs the cached
graph eagerly, as with ``torch-compile``'s default.

Because the package needs neither Dynamo nor Inductor to run, the served module can live in a process that
never imported them: :class:`~autodeploy.LLM` builds in a child process and serves the package
(:mod:`autodeploy.runtime.package`), which is what keeps its peak memory near the weights'.

Where the native kernels run, the package calls them through their C shims (``aoti_torch_cpu_<op>`` in the op
library, :func:`~autodeploy.custom_ops.native.aoti_c_shims`) rather than AOTInductor's proxy executor, which
costs about 3.5 us a call through the dispatcher: some 60 calls a step, 0.17 ms of a 4 ms int4 step.

Packages are cached on disk (``cache_dir()/aoti``) under a key of everything the compiled code depends on:
the decode graph's code, its constants' and inputs' shapes, dtypes and strides, the Inductor options, torch's
version, the CPU's instruction set and autodeploy's own sources; a second build of the same model skips the
compile.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.fx import GraphModule

from ..custom_ops import native
from ..errors import PackageError
from ..runtime.decode_dispatch import DecodeDispatch
from ..runtime.kv_cache import KV_CACHE_META_KEY
from ..runtime.package import AOTIDecode, PackagedModel
from ..runtime.sequence_info import GRAPH_INPUTS, LOGITS_IDX, SLOT_IDX, SequenceInfo, SequenceRequest
from ..utils.cache import cache_dir, source_digest
from ..utils.fx import graph_tensors
from ..utils.logger import ad_logger
from .backends import register_compile_backend
from .eager import call_implementations_directly
from .torch_compile import decode_graph, inductor_options

_PACKAGE_FILE = "decode.pt2"
#: The package's Inductor settings beyond :func:`inductor_options`: its constants passed at load, and its C++
#: wrapper (the 3300 lines that call the kernels, 12 layers unrolled) compiled at -O0. At -O1, g++ took 8-13 s
#: of a cold build for it against 5 s, and the two packages' decode steps timed alike (11.9 / 11.5 ms at batch
#: 1, 12.1 / 12.3 ms at batch 2, the 125M Llama on the AMD EPYC of docs/performance.md): the wrapper's work is
#: calls into the kernels and the runtime's shims, which -O1 does not make faster.
#: Its pointwise kernels (norms, SiLU x up, residual adds: a few rows of 768-4096 values a step) run on one
#: thread: Inductor splits a kernel over the threads where its example (two sequences) has at least
#: ``cpp.min_chunk_size`` values a thread, and at batch 1 the other thread then only joined and left, some 50
#: OpenMP regions a step. Measured on the Intel Xeon of docs/performance.md (thirtieth round), one process, two
#: packages alternating: the batch-1 decode step 1.03-1.04x faster (int4, AVX2), 1.025x (int8, AVX-512); at batch
#: 16 (float32) 0.996x (AVX2) and 1.007x (AVX-512).
_PACKAGE_OPTIONS = {"aot_inductor.package_constants_in_so": False, "aot_inductor.compile_wrapper_opt_level": "O0",
                    "cpp.min_chunk_size": 8192}


def _tensor_signature(t: torch.Tensor) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype), str(t.device)]


def _example_step(gm: GraphModule, names: list[str]) -> list[torch.Tensor]:
    """A two-sequence decode step (two, so that export keeps the batch dimension symbolic), its page table
    two columns wide as :class:`DecodeDispatch` pads it."""
    spec = gm.meta[KV_CACHE_META_KEY]
    info = SequenceInfo(max(2, spec.max_batch_size), spec.max_seq_len, spec.page_size, spec.num_pages)
    seqs = [SequenceRequest([1 + i], i, [0]) for i in range(2)]
    batch = info.build(seqs, gather="last" if LOGITS_IDX in names else None, device=spec.device,
                       min_width=DecodeDispatch.min_table_width)
    return list(batch.as_args(include_logits_idx=LOGITS_IDX in names))


def _dynamic_shapes(names: list[str], step: list[torch.Tensor], max_batch: int, max_pages: int) -> tuple:
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    pages = torch.export.Dim("pages", min=2, max=max_pages)
    dims = []
    for name, arg in zip(names, step):
        if name == "page_table":
            dims.append({0: batch, 1: pages})
        elif name in ("input_ids", "position_ids"):
            dims.append({arg.dim() - 1: batch})
        else:
            dims.append({0: batch})
    return tuple(dims)


def _call_kernels_directly(exported, max_batch: int) -> int:
    """Where no decode batch can exceed what the native int8 kernel takes, point the exported graph's
    ``int8_product`` calls (a Python kernel that picks the kernel or the GEMM by rows, at run time) at the
    kernel's own operator: a call from the package into Python costs some 30 us, 20 % of a batch-1 int8 step
    on the 125M model. Returns how many calls changed."""
    from ..custom_ops.quant_linear import NATIVE_MAX_ROWS

    if max_batch > NATIVE_MAX_ROWS:
        return 0
    product, kernel = torch.ops.auto_deploy.int8_product.default, torch.ops.auto_deploy.int8_gemv.default
    nodes = list(exported.graph.find_nodes(op="call_function", target=product))
    for node in nodes:
        node.target = kernel
    if nodes:
        exported.graph_module.recompile()
    return len(nodes)


def package_key(decode: GraphModule, step: list[torch.Tensor], options: dict[str, Any], max_batch: int,
                max_pages: int) -> str:
    """The cache key of the decode package: everything its compiled code depends on."""
    constants = {name: _tensor_signature(t) for name, t in graph_tensors(decode).items()}
    record = {
        "code": decode.code, "constants": constants, "inputs": [_tensor_signature(a) for a in step],
        "options": {k: repr(v) for k, v in sorted(options.items())}, "limits": [max_batch, max_pages],
        "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
        "sources": source_digest(),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


def compile_decode_package(gm: GraphModule) -> tuple[Path, GraphModule]:
    """The decode graph of the cached graph ``gm`` and the path of its AOTInductor package (compiled, or
    found in the cache). Raises :class:`PackageError` naming the step that failed."""
    from torch._inductor import aoti_compile_and_package

    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    if SLOT_IDX in names:
        raise PackageError("aoti: graphs with a state cache (state-space layers) are not covered yet")
    spec = gm.meta[KV_CACHE_META_KEY]
    decode = decode_graph(gm)
    step = _example_step(gm, names)
    # (a dimension needs min < max: a one-page table still gets a range of widths)
    max_batch, max_pages = max(2, spec.max_batch_size), max(3, spec.max_pages_per_seq)
    options = {**inductor_options(), **_PACKAGE_OPTIONS,
               "aot_inductor.custom_ops_to_c_shims": native.aoti_c_shims()}
    key = package_key(decode, step, options, max_batch, max_pages)
    path = cache_dir() / "aoti" / key / _PACKAGE_FILE
    if path.is_file():
        ad_logger.info(f"aoti: decode package found in the cache ({path})")
        return path, decode
    start = time.perf_counter()
    try:
        exported = torch.export.export(decode, tuple(step), dynamic_shapes=_dynamic_shapes(names, step, max_batch,
                                                                                          max_pages), strict=False)
    except Exception as exc:  # noqa: BLE001 - reported with the step that failed
        raise PackageError(f"aoti: exporting the decode graph failed: {type(exc).__name__}: {exc}") from exc
    direct = _call_kernels_directly(exported, max_batch)
    ad_logger.info(f"aoti: decode graph exported ({len(exported.graph.nodes)} nodes"
                   + (f", {direct} int8 product(s) calling the kernel directly" if direct else "") + ") in "
                   f"{time.perf_counter() - start:.1f} s; compiling with AOTInductor")
    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"partial-{os.getpid()}.pt2")
    try:
        with warnings.catch_warnings():  # torch's own deprecation inside the package writer, not the user's
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            aoti_compile_and_package(exported, package_path=str(partial), inductor_configs=options)
    except Exception as exc:  # noqa: BLE001
        partial.unlink(missing_ok=True)
        raise PackageError(f"aoti: AOTInductor could not compile the decode graph: {type(exc).__name__}: "
                              f"{exc}") from exc
    os.replace(partial, path)  # whole or absent: a concurrent build never loads half a package
    ad_logger.info(f"aoti: decode package compiled in {time.perf_counter() - start:.1f} s "
                   f"({path.stat().st_size / 2**20:.1f} MiB, cached at {path})")
    return path, decode


@register_compile_backend("aoti")
def compile_with_aoti(gm: GraphModule, config: Any) -> nn.Module:
    """The cached graph ``gm`` served with its decode step from an AOTInductor package (see the module
    docstring); ``config`` is ``compile_model``'s (nothing in it applies but the backend's name)."""
    inputs = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    if {"input_ids", "seq_lens", "page_table"} - set(inputs) or set(inputs) - set(GRAPH_INPUTS):
        raise PackageError(f"aoti: the cached graph's inputs {inputs} are not the runtime's {list(GRAPH_INPUTS)}")
    try:
        path, decode = compile_decode_package(gm)
    except PackageError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here leaves the model servable another way
        raise PackageError(f"aoti: preparing the decode package failed: {type(exc).__name__}: {exc}") from exc
    start = time.perf_counter()
    try:
        runner = AOTIDecode(path, graph_tensors(decode))
    except RuntimeError as exc:  # a package torch cannot load (e.g. a cache entry cut short)
        raise PackageError(f"aoti: loading the decode package {path} failed: {exc}") from exc
    direct = call_implementations_directly(gm)  # the graph other batches run eagerly
    served = PackagedModel(gm, runner, inputs, gm.meta[KV_CACHE_META_KEY])
    ad_logger.info(f"aoti: decode package loaded in {time.perf_counter() - start:.2f} s; the other batches' graph "
                   f"calls {direct} op implementation(s) directly")
    return served
