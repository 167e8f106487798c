"""The ``torch-compile`` backend: the cached graph served through Inductor.

The served module is a :class:`~autodeploy.runtime.decode_dispatch.DecodeDispatch`:

- **Decode-only batches** (one new token per sequence, the bulk of generation) run a decode graph: a copy
  of the cached graph in which cached attention is :func:`paged_decode_attention_rope` with the RoPE before it
  (where the native kernels run, RoPE, the cache write and the attention in one call of
  ``auto_deploy::decode_attention_rope``) or :func:`paged_decode_attention` (the cache write in plain torch, the
  attention in ``auto_deploy::decode_attention`` where its native kernel runs, else plain torch); no host syncs,
  no value-dependent shapes; and the pure canonical ops take their compile forms
  (:mod:`autodeploy.custom_ops.compile_forms`; int8 products call the native kernel's operator where it
  runs, ``auto_deploy::f32_linear`` stays a call), so the whole decode step is one Inductor graph without
  graph breaks. It shares the weights and KV caches of the cached graph.
- **Other batches** (prefill, chunked prefill, mixed) run the cached graph itself, compiled with its
  cached-attention op kept opaque (``compile_prefill``; off, they run eagerly).

The decode graph attends over every column of the page table, so the dispatcher hands it a table as wide
as the longest sequence of the batch needs (``SequenceInfo.build`` makes it so).

In both graphs the RoPE cos/sin tables that RoPE calls share pass through ``auto_deploy::materialize`` so that
Inductor computes them once per step, not inside every layer's kernel (:func:`compute_rope_tables_once`).

Compile time is part of the user's wait: each warm-up shape logs its progress and time. Dynamo
specializes a decode batch of one (its int8 products call the native kernel directly), so the warm-up
covers batch 1 and the general batch; the prompt graph always gets at least two sequences, so one graph
serves one or many. Duck sizing (equal sizes sharing one symbol) is off during the warm-up, so a batch size
that happens to equal the page count is not baked in.
"""

from __future__ import annotations

import operator
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from ..custom_ops import native
from ..custom_ops.cached_attention import (
    paged_decode_attention,
    paged_decode_attention_native,
    paged_decode_attention_rope,
    paged_decode_attention_rope_native,
)
from ..custom_ops.compile_forms import compile_forms
from ..errors import AutoDeployError
from ..runtime.decode_dispatch import DecodeDispatch
from ..runtime.kv_cache import KV_CACHE_META_KEY
from ..runtime.sequence_info import GRAPH_INPUTS, LOGITS_IDX, SLOT_IDX, SequenceInfo, SequenceRequest
from ..utils.fx import op_args
from ..utils.logger import ad_logger
from .backends import register_compile_backend

#: ``0`` keeps RoPE and the cache write of the decode graph in plain torch (Inductor's kernel) before the attention,
#: instead of :func:`fuse_rope_into_attention`'s one call: for comparing the two (the package cache keys on it)
FUSED_ATTENTION_ENV = "AUTODEPLOY_FUSED_ATTENTION"


def _rope_of(q: Any, k: Any) -> Node | None:
    """The RoPE node whose two outputs ``q`` and ``k`` are, where nothing else reads them and it is the rotate_half
    form over [batch, seq, heads, head_dim] (``auto_deploy::rope``, or the canonical op with ``unsqueeze_dim=2``)."""
    if not all(isinstance(n, Node) and n.target is operator.getitem and len(n.users) == 1 for n in (q, k)):
        return None
    rope = q.args[0]
    if k.args[0] is not rope or (q.args[1], k.args[1]) != (0, 1):
        return None
    if rope.target == torch.ops.auto_deploy.rope.default:
        return rope
    if rope.target == torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default:
        args = op_args(rope)
        return rope if args["unsqueeze_dim"] == 2 and not args["interleaved"] else None
    return None


def fuse_rope_into_attention(gm: GraphModule, native_kernel: bool) -> int:
    """Point each cached attention whose q and k come straight from a RoPE at
    :func:`paged_decode_attention_rope`, with the RoPE's inputs: where the native kernel runs, the rotation, the
    cache write and the attention are one call of the decode step. Returns how many attentions changed."""
    target = paged_decode_attention_rope_native if native_kernel else paged_decode_attention_rope
    fused = 0
    cached = torch.ops.auto_deploy.torch_cached_attention.default
    for node in list(gm.graph.find_nodes(op="call_function", target=cached)):
        rope = _rope_of(node.args[0], node.args[1])
        if rope is None:
            continue
        args = op_args(rope)
        q, k, cos, sin = args["q"], args["k"], args["cos"], args["sin"]
        rotated = node.args[:2]
        node.target = target
        node.args = (q, k, node.args[2], cos, sin, *node.args[3:])
        for getitem in rotated:
            gm.graph.erase_node(getitem)
        if not rope.users:
            gm.graph.erase_node(rope)
        fused += 1
    if fused:
        gm.recompile()
    return fused


def compute_rope_tables_once(gm: GraphModule) -> int:
    """Route each cos/sin table that several RoPE calls share through ``auto_deploy::materialize``.

    Inductor recomputes a cheap pointwise chain in every consumer rather than storing it (on CPU it stores
    only reused chains with exp/log/tanh-like ops), so the compiled prefill graph evaluated cos and sin of
    the prompt's positions for every head of every layer. Returns how many tables are now computed once."""
    ropes = (torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default, torch.ops.auto_deploy.rope.default)
    uses: dict[Node, list[tuple[Node, int]]] = {}
    for node in (n for rope in ropes for n in gm.graph.find_nodes(op="call_function", target=rope)):
        for index in (2, 3):  # (q, k, cos, sin, ...)
            if isinstance(node.args[index], Node):
                uses.setdefault(node.args[index], []).append((node, index))
    shared = {table: users for table, users in uses.items() if len(users) > 1}
    for table, users in shared.items():
        with gm.graph.inserting_after(table):
            stored = gm.graph.call_function(torch.ops.auto_deploy.materialize.default, (table,))
        for node, index in users:
            node.update_arg(index, stored)
    if shared:
        gm.recompile()
    return len(shared)


def inline_pure_ops(gm: GraphModule, decode: bool) -> int:
    """Point the nodes of ops with a compile form at their plain-torch forms (those for the decode graph
    with ``decode``). Returns how many nodes changed."""
    forms = compile_forms(decode)
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in forms:
            node.target = forms[node.target]
            changed += 1
    if changed:
        gm.recompile()
    return changed


def decode_graph(gm: GraphModule) -> GraphModule:
    """A copy of the cached graph for decode-only batches: cached attention becomes
    :func:`paged_decode_attention_rope` where a RoPE feeds it (:func:`fuse_rope_into_attention`), else
    :func:`paged_decode_attention`; the pure ops their plain-torch forms. Weights and KV caches are shared
    with ``gm`` (the same tensors), not copied.

    The fused calls read cos and sin as Inductor computes them for each call (one kernel at the step's start,
    64 values a layer) rather than through ``materialize``: its two calls cost more than they save (engine,
    batch 1, AVX2, alternating: 1.030-1.038x against 1.011-1.031x over the unfused step, docs/performance.md)."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    decode = GraphModule(gm, graph, class_name="DecodeGraph")
    cached = torch.ops.auto_deploy.torch_cached_attention.default
    native_kernel = native.decode_attention_available()
    if os.environ.get(FUSED_ATTENTION_ENV, "1") != "0":
        fuse_rope_into_attention(decode, native_kernel)
    attention = paged_decode_attention_native if native_kernel else paged_decode_attention
    for node in decode.graph.find_nodes(op="call_function", target=cached):
        node.target = attention
    compute_rope_tables_once(decode)
    inline_pure_ops(decode, decode=True)
    decode.recompile()
    return decode


#: Inductor checks the size, stride and alignment of every tensor an extern kernel returns, in Python calls
#: between the kernels; these graphs are fixed, so the checks are off.
_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}
#: The decode graph runs every step, so its per-call overhead counts (docs/performance.md):
#: - its calls (a hundred kernels and product ops per step) made from C++ rather than from a Python wrapper:
#:   0.2-0.6 ms less per step, 3-10 % of a batch-1 step, for a few seconds more of cold compile;
#: - no guards on the graph module's attributes (its weights, caches and submodules: some 2000 checks per
#:   call, 0.15-0.2 ms) nor on the module globals its code reads (``torch``, ``native``, evaluated in Python):
#:   the runtime never changes them after the build. The guards on the step's inputs, which choose between
#:   the batch-1 and the general graph, and on the global state (grad mode, threads) stay.
def _decode_guard_filter(entries: list) -> list[bool]:
    keep_modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    keep_globals = torch.compiler.skip_guard_on_globals_unsafe(entries)
    return [module and glob for module, glob in zip(keep_modules, keep_globals)]


_DECODE_OPTIONS = {"cpp_wrapper": True, "guard_filter_fn": _decode_guard_filter}


_isa_probe: Future | None = None


def start_isa_probe() -> None:
    """Start Inductor's instruction-set probe (:func:`inductor_options` needs its answer) in a background
    thread, so that it runs while the graph is exported and rewritten rather than before compiling.

    The probe builds a test library per instruction set (on a new machine: several seconds of g++) and loads
    each in a child Python (every build: 1.2 s); those wait on other processes, which the second core runs
    meanwhile. Safe to call more than once."""
    global _isa_probe
    if _isa_probe is None:
        from torch._inductor import cpu_vec_isa  # imported here: imports in a second thread could deadlock

        pool = ThreadPoolExecutor(1, thread_name_prefix="autodeploy-isa-probe")
        _isa_probe = pool.submit(cpu_vec_isa.pick_vec_isa)
        pool.shutdown(wait=False)  # the thread ends with the probe


def inductor_options() -> dict[str, Any]:
    """:data:`_INDUCTOR_OPTIONS` with ``cpp.simdlen`` pinned to the vector width Inductor picks here.

    Inductor's FX-graph cache key leaves out the instruction set it picks (which ``ATEN_CPU_CAPABILITY``
    lowers): a graph cached under AVX2 was reloaded under AVX-512 with its 8-lane kernel source compiled for
    16 lanes, whose full-width stores ran past their buffers (heap corruption), and the reverse gave garbage
    page tables. With the width in the config, which the key includes, each instruction set has its own
    cache entries. The answer comes from :func:`start_isa_probe`'s thread where one was started."""
    from torch._inductor import cpu_vec_isa

    isa = _isa_probe.result() if _isa_probe is not None else cpu_vec_isa.pick_vec_isa()
    return {**_INDUCTOR_OPTIONS, "cpp.simdlen": isa.bit_width()}


def _warmup_shapes(capture: list[int], max_batch_size: int, prefill: bool) -> list[tuple[int, int]]:
    """(sequences, tokens per sequence) to run once each."""
    sizes = sorted({min(b, max_batch_size) for b in capture if b >= 1})
    shapes = [(b, 1) for b in sizes]
    if prefill:
        shapes.append((1, 2))
        if max_batch_size > 1:
            shapes.append((2, 2))
    return shapes


def _warmup(served: nn.Module, gm: GraphModule, shapes: list[tuple[int, int]], budget: float | None) -> None:
    import torch.fx.experimental._config as fx_config

    spec = gm.meta[KV_CACHE_META_KEY]
    info = SequenceInfo.from_spec(spec)
    inputs = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    gathers = LOGITS_IDX in inputs
    device = torch.device(spec.device)
    start = time.perf_counter()
    for i, (num_seqs, num_tokens) in enumerate(shapes):
        if budget is not None and time.perf_counter() - start > budget:
            ad_logger.warning(f"warm-up budget of {budget:.0f} s spent: {len(shapes) - i} shape(s) left to "
                              "compile on first use")
            return
        t0 = time.perf_counter()
        # the warm-up writes k/v into cache page 0 only (and state into slot 0); stale cache slots are never read
        # before they're written, and a sequence's state slot starts from zero at its first token
        seqs = [SequenceRequest([0] * num_tokens, 0, [0] * info.pages_needed(num_tokens)) for _ in range(num_seqs)]
        batch = info.build(seqs, gather="last" if gathers else None, device=device, slots=SLOT_IDX in inputs)
        with torch.no_grad(), fx_config.patch(use_duck_shape=False):
            served(*batch.as_args(include_logits_idx=gathers))
        kind = "decode" if num_tokens == 1 else "prefill"
        ad_logger.info(f"compiled {kind} shape {i + 1}/{len(shapes)}: {num_seqs} sequence(s) x {num_tokens} "
                       f"token(s) in {time.perf_counter() - t0:.1f} s")


@register_compile_backend("torch-compile")
def compile_with_inductor(gm: GraphModule, config: Any) -> nn.Module:
    """The cached graph ``gm`` compiled with Inductor, warmed up for the shapes of ``config`` (fields
    ``capture_batch_sizes``, ``compile_prefill``, ``freeze_weights``, ``warmup_time_budget_s``)."""
    inputs = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    missing = {"input_ids", "seq_lens", "page_table"} - set(inputs)
    if missing or set(inputs) - {*GRAPH_INPUTS, SLOT_IDX}:
        raise AutoDeployError(f"compile_model: the cached graph's inputs {inputs} are not the runtime's "
                              f"{list(GRAPH_INPUTS)} (and {SLOT_IDX!r} with a state cache)")
    options = inductor_options()
    decode = torch.compile(decode_graph(gm), dynamic=True, options={**options, **_DECODE_OPTIONS})
    general: nn.Module = gm
    if config.compile_prefill:
        compute_rope_tables_once(gm)
        inlined = inline_pure_ops(gm, decode=False)
        ad_logger.info(f"prefill graph: {inlined} canonical op call(s) inlined as plain torch")
        general = torch.compile(gm, dynamic=True, options=options)
    served = DecodeDispatch(general, decode, inputs, {"freezing": True} if config.freeze_weights else None)
    shapes = _warmup_shapes(config.capture_batch_sizes, gm.meta[KV_CACHE_META_KEY].max_batch_size,
                            config.compile_prefill)
    ad_logger.info(f"torch.compile (Inductor): warming up {len(shapes)} shape(s)")
    _warmup(served, gm, shapes, config.warmup_time_budget_s)
    return served
