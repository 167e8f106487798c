"""Probe: serve the decode graph from an AOTInductor package, in a process that never imports the compiler.

The probe that led to the ``aoti`` backend, which :class:`autodeploy.LLM` now serves by default
(``autodeploy.compile.aoti``, ``autodeploy.runtime.package``; docs/performance.md, "Issue 18, sixth and
seventh rounds"). It stays as a step-level measurement of that route against ``torch.compile``, on one model:

1. build the model with the ``torch-simple`` backend and take its decode graph
   (:func:`autodeploy.compile.torch_compile.decode_graph`: one token per sequence, native products and
   decode attention, the cache writes as ``index_copy_`` into the graph's cache buffers);
2. export it with a dynamic batch and page-table width, and compile it with AOTInductor *without* its
   constants (``aot_inductor.package_constants_in_so=False``): the package holds code only;
3. save the graph's weights and caches (before the step) and the eager graph's logits and caches after one
   step;
4. in a spawned child that imports torch and autodeploy's canonical ops only: load the package, hand it the
   saved tensors as user-managed constants (memory-mapped, not copied), run the step, and compare the logits
   and the caches it wrote with the eager graph's; then time steps, and report the child's resident memory
   and whether Inductor, Dynamo or sympy were loaded.

The parent times the eager and the ``torch.compile``-d decode graph (the served one) on the same step.

    python benchmarks/aoti_serving_probe.py --model /tmp/llama-125m [--batch 2] [--steps 30] [--workdir DIR]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_BUILD_ONLY = ("torch._inductor", "torch._dynamo", "sympy", "transformers", "autodeploy.transform")


def _step_times(run, args, steps: int) -> float:
    """Median seconds of ``run(args)`` over ``steps`` calls, after two warm-up calls."""
    for _ in range(2):
        run(args)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run(args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def serve_from_package(workdir: str, steps: int, queue) -> None:
    """The child: load and run the package with the saved tensors; put its findings on ``queue``."""
    import torch

    from autodeploy.custom_ops import native
    from autodeploy.utils.memory import current_memory_bytes, peak_rss_bytes

    native.library()
    base_mib = current_memory_bytes() / 2**20
    start = time.perf_counter()
    loader = torch._C._aoti.AOTIModelPackageLoader(os.path.join(workdir, "decode.pt2"), "model", False, 1, -1)
    state = torch.load(os.path.join(workdir, "state.pt"), mmap=True)
    constants = {name: state[name] for name in loader.get_constant_fqns()}
    loader.load_constants(constants, False, True, True)  # not inductor's names, every constant, user-managed
    load_s = time.perf_counter() - start
    expected = torch.load(os.path.join(workdir, "expected.pt"))
    (logits,) = loader.run(list(expected["args"]))
    caches = {name: (constants[name] - after).abs().max().item() for name, after in expected["caches"].items()}
    step_s = _step_times(loader.run, list(expected["args"]), steps)
    queue.put({
        "child_rss_after_imports_mib": round(base_mib, 1),
        "child_peak_rss_mib": round(peak_rss_bytes() / 2**20, 1),
        "package_load_s": round(load_s, 3),
        "max_logit_diff": (logits - expected["logits"]).abs().max().item(),
        "max_cache_diff": max(caches.values()),
        "caches_checked": len(caches),
        "aoti_step_ms": round(step_s * 1e3, 2),
        "build_modules_loaded": sorted(m for m in sys.modules if m.startswith(_BUILD_ONLY))[:20],
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=2, help="decode sequences in the step (at least 1)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workdir", help="where the package and tensors go (default: a temporary folder)")
    args = parser.parse_args()
    os.environ["AUTODEPLOY_COMPILE_BACKEND"] = "torch-simple"

    import torch
    import torch.nn.functional as F
    from torch._inductor import aoti_compile_and_package

    from autodeploy import LLM
    from autodeploy.compile.aoti import _PACKAGE_OPTIONS, _dynamic_shapes
    from autodeploy.compile.torch_compile import _DECODE_OPTIONS, decode_graph, inductor_options
    from autodeploy.runtime.kv_cache import KV_CACHE_META_KEY
    from autodeploy.runtime.sequence_info import LOGITS_IDX, SLOT_IDX, SequenceInfo, SequenceRequest

    workdir = args.workdir or tempfile.mkdtemp(prefix="aoti-probe-")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    llm = LLM(args.model, overrides={"max_batch_size": max(args.batch, 2), "max_seq_len": 192})
    gm = llm.module
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    if SLOT_IDX in names:
        raise SystemExit("aoti_serving_probe: models with a state cache are not covered by this probe")
    info = SequenceInfo.from_spec(gm.meta[KV_CACHE_META_KEY])
    seqs = [SequenceRequest([5 + i], 3 + i, [0, 1]) for i in range(args.batch)]
    step = list(info.build(seqs, gather="last" if LOGITS_IDX in names else None, device=torch.device("cpu"),
                           slots=False).as_args(include_logits_idx=LOGITS_IDX in names))
    table = names.index("page_table")
    step[table] = F.pad(step[table], (0, max(0, 2 - step[table].shape[1])))  # as DecodeDispatch pads it

    decode = decode_graph(gm)
    # the aoti backend's export and options (compile/aoti.py), compiled here without its cache, so that every
    # run times the compile
    start = time.perf_counter()
    exported = torch.export.export(decode, tuple(step), dynamic_shapes=_dynamic_shapes(names, step, 256, 4096),
                                   strict=False)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    aoti_compile_and_package(exported, package_path=os.path.join(workdir, "decode.pt2"),
                             inductor_configs={**inductor_options(), **_PACKAGE_OPTIONS})
    aoti_s = time.perf_counter() - start

    tensors = {**dict(decode.named_parameters()), **dict(decode.named_buffers())}
    torch.save({name: t.detach().clone() for name, t in tensors.items()}, os.path.join(workdir, "state.pt"))
    caches = [name for name in tensors if name.startswith("kv_cache_")]
    with torch.no_grad():
        (logits,) = decode(*step)
    torch.save({"args": step, "logits": logits, "caches": {n: tensors[n].detach().clone() for n in caches}},
               os.path.join(workdir, "expected.pt"))

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=serve_from_package, args=(workdir, args.steps, queue))
    child.start()
    found = queue.get(timeout=900)
    child.join()

    with torch.no_grad():
        eager_s = _step_times(lambda a: decode(*a), step, args.steps)
        compiled = torch.compile(decode_graph(gm), dynamic=True, options={**inductor_options(), **_DECODE_OPTIONS})
        start = time.perf_counter()
        compiled(*step)
        compile_s = time.perf_counter() - start
        inductor_s = _step_times(lambda a: compiled(*a), step, args.steps)
    print(json.dumps({
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "batch": args.batch,
        "export_s": round(export_s, 2), "aoti_compile_s": round(aoti_s, 1),
        "package_bytes": os.path.getsize(os.path.join(workdir, "decode.pt2")),
        "exported_nodes": len(exported.graph.nodes), **found,
        "eager_step_ms": round(eager_s * 1e3, 2), "torch_compile_s": round(compile_s, 1),
        "torch_compile_step_ms": round(inductor_s * 1e3, 2),
        "aoti_vs_torch_compile": round(inductor_s / (found["aoti_step_ms"] / 1e3), 3),
        "workdir": workdir,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
