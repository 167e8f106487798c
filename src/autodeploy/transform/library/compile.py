"""compile stage: ``compile_model`` compiles the cached graph (the one the runtime serves).

Config: ``backend``: ``torch-simple`` (no compilation: the GraphModule runs as generated Python code) or
``torch-compile`` (Inductor); ``capture_batch_sizes`` (decode batch sizes run once up front, like CUDA-graph
batch sizes, so their graphs are compiled before serving; capped by ``max_batch_size``); ``compile_prefill``
(also compile the graph that serves prefill and mixed batches; default on); ``freeze_weights`` (Inductor
freezing of the multi-sequence decode graph: the weights of its ``aten.linear`` nodes become constants
that Inductor prepacks for oneDNN's matrix kernels, at the cost of a second copy of them; the batch-1
graph, which would not gain, stays unfrozen. Measured 1.26x faster batch-16 decode steps on a 2-core
AVX-512 CPU before ``native_linear``, whose native kernel is faster still and leaves it no linears there);
``warmup_time_budget_s`` (stop warming up once this much time is spent: the remaining shapes compile on
first use).

With ``torch-compile`` the served module is a :class:`DecodeDispatch`:

- **Decode-only batches** (one new token per sequence, the bulk of generation) run a decode graph: a copy
  of the cached graph in which cached attention is :func:`paged_decode_attention` (the cache write in plain
  torch, the attention in the native ``auto_deploy::decode_attention`` operator where it exists, else
  plain torch; no host syncs, no value-dependent shapes) and the pure canonical ops
  (:data:`COMPILE_FORMS`: RMSNorm, RoPE, repeat_kv, int8 linear) take their compile forms (plain torch;
  int8 linears call the native kernel's operator where it exists; ``native_linear``'s float32 operator
  stays a call), so the whole decode step is one
  Inductor graph without graph breaks. It shares the weights and KV caches of the cached graph.
- **Other batches** (prefill, chunked prefill, mixed) run the cached graph itself, compiled with its
  cached-attention op kept opaque (``compile_prefill``, default on; off, they run eagerly). Prefill is
  dominated by large matrix products; compiling fuses the rest (time to first token 0.115 -> 0.101 s at
  batch 1, 1.39 -> 1.19 s at batch 16 on the 125M Llama of the README) for 11-22 s more compile time.

The decode graph attends over every column of the page table, so the dispatcher hands it a table as wide
as the longest sequence of the batch needs (``SequenceInfo.build`` makes it so), and both graphs at least
two columns: dynamo specializes dimensions of size 1, and a second column (masked, or unused by position
lookups) keeps one graph for all lengths.

In both graphs the RoPE cos/sin tables pass through ``auto_deploy::materialize`` so that Inductor computes
them once per step, not inside every layer's kernel (:func:`compute_rope_tables_once`).

Compile time is part of the user's wait: each warm-up shape logs its progress and time. Dynamo
specializes a decode batch of one (its int8 products call the native kernel directly), so the warm-up
covers batch 1 and the general batch; the prompt graph always gets at least two sequences (an empty one
is added), so one graph serves one or many. Duck sizing (equal sizes sharing one symbol) is off during the
warm-up, so a batch size that happens to equal the page count is not baked in.
"""

from __future__ import annotations

import time
from typing import Callable, Literal

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from pydantic import Field
from torch import nn
from torch.fx import Graph, GraphModule, Node

from ...custom_ops import native
from ...custom_ops.cached_attention import paged_decode_attention, paged_decode_attention_native
from ...custom_ops.quant_linear import int8_linear_for_compile
from ...errors import AutoDeployError
from ...runtime.kv_cache import KV_CACHE_META_KEY
from ...runtime.sequence_info import GRAPH_INPUTS, LOGITS_IDX, SequenceInfo, SequenceRequest
from ...utils.fx import named_graphmodules
from ...utils.logger import ad_logger
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry, _set_submodule


class CompileModelConfig(TransformConfig):
    backend: Literal["torch-simple", "torch-compile"] = Field(
        default="torch-simple", description="torch-simple: no compilation; torch-compile: torch.compile (Inductor)."
    )
    capture_batch_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8],
        description="Decode batch sizes compiled up front (capped by max_batch_size).",
    )
    compile_prefill: bool = Field(
        default=True, description="Also compile the graph serving prefill and mixed batches (and warm it up)."
    )
    freeze_weights: bool = Field(
        default=False,
        description="Inductor freezing for the decode graph: the weights of its aten.linear nodes become "
        "constants, prepacked for oneDNN (costs a second copy of them; nothing to gain where native_linear "
        "took the linears).",
    )
    warmup_time_budget_s: float | None = Field(
        default=600.0, description="Stop the warm-up after this many seconds (null: no limit)."
    )
    # the compiler's own memory (~100-450 MiB), plus the prepacked weights with freeze_weights
    expect_mem_change: bool = True
    run_per_gm: bool = False
    requires_clean_graph: bool = False
    run_graph_cleanup: bool = False


def _op_python_impl(name: str) -> Callable:
    """The plain-torch implementation registered for ``auto_deploy::<name>`` (traceable by Dynamo)."""
    from torch._library.custom_ops import OPDEFS

    return OPDEFS[f"auto_deploy::{name}"]._init_fn


#: auto_deploy ops replaced by a plain-torch form before torch.compile (a custom op is an opaque call to
#: Dynamo, so Inductor could not fuse it with its neighbours); name -> the form's factory, called with
#: ``decode`` (whether the form is for the decode graph or the general one)
COMPILE_FORMS: dict[str, Callable[[bool], Callable]] = {
    "torch_rmsnorm": lambda decode: _op_python_impl("torch_rmsnorm"),
    "torch_rope_with_explicit_cos_sin": lambda decode: _op_python_impl("torch_rope_with_explicit_cos_sin"),
    "torch_repeat_kv": lambda decode: _op_python_impl("torch_repeat_kv"),
    "torch_int8_linear": int8_linear_for_compile,
    # native_linear's operator: decode graphs call it, prompt graphs see a plain linear for Inductor to plan
    "f32_linear": lambda decode: torch.ops.auto_deploy.f32_linear.default if decode else F.linear,
}


@torch.library.custom_op("auto_deploy::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x``. Opaque to Inductor, so the chain that computes ``x`` is evaluated once into a
    buffer instead of inside each consumer (see :func:`compute_rope_tables_once`)."""
    return x.clone()


@materialize.register_fake
def _materialize_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def compute_rope_tables_once(gm: GraphModule) -> int:
    """Route each cos/sin table that several RoPE calls share through ``auto_deploy::materialize``.

    Inductor recomputes a cheap pointwise chain in every consumer rather than storing it (on CPU it stores
    only reused chains with exp/log/tanh-like ops), so the compiled prefill graph evaluated cos and sin of
    the prompt's positions for every head of every layer (about 0.15 ms per layer for a 128-token prompt,
    that kernel's time with and without the tables). Returns how many tables are now computed once."""
    rope = torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default
    uses: dict[Node, list[tuple[Node, int]]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=rope):
        for index in (2, 3):  # (q, k, cos, sin, unsqueeze_dim)
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
    """Point the nodes of the :data:`COMPILE_FORMS` ops at their plain-torch forms (those for the decode
    graph with ``decode``). Returns how many nodes changed."""
    forms = {getattr(torch.ops.auto_deploy, name).default: make(decode) for name, make in COMPILE_FORMS.items()
             if hasattr(torch.ops.auto_deploy, name)}  # the native operators exist only where they built
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
    :func:`paged_decode_attention`, the pure ops their plain-torch forms. Weights and KV caches are shared
    with ``gm`` (the same tensors), not copied."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    decode = GraphModule(gm, graph, class_name="DecodeGraph")
    cached = torch.ops.auto_deploy.torch_cached_attention.default
    attention = paged_decode_attention_native if native.decode_attention_available() else paged_decode_attention
    for node in decode.graph.find_nodes(op="call_function", target=cached):
        node.target = attention
    compute_rope_tables_once(decode)
    inline_pure_ops(decode, decode=True)
    decode.recompile()
    return decode


class DecodeDispatch(nn.Module):
    """Serves decode-only batches with the (compiled) decode graph and every other batch with the cached
    graph (``general``), which keeps the KV-cache metadata the runtime reads."""

    def __init__(self, general: nn.Module, decode: nn.Module, input_names: list[str],
                 decode_inductor_config: dict | None = None):
        super().__init__()
        self.general, self.decode = general, decode
        # Inductor settings for the multi-sequence decode graph (freezing). Dynamo reads them from the global
        # config while tracing, so they are set around each call that may compile, not passed as options
        self._decode_config = decode_inductor_config or {}
        self._names = list(input_names)
        self._ids, self._seq_lens = input_names.index("input_ids"), input_names.index("seq_lens")
        self._page_table = input_names.index("page_table")
        self._input_pos = input_names.index("input_pos")
        self._logits_idx = input_names.index(LOGITS_IDX) if LOGITS_IDX in input_names else None

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor):
        if kwargs:  # the graph's inputs by name (``gm(**batch.as_kwargs())``), in placeholder order
            unknown = set(kwargs) - set(self._names[len(args):])
            if unknown:
                raise TypeError(f"unexpected or repeated graph input(s) {sorted(unknown)}; inputs: {self._names}")
            args = args + tuple(kwargs[name] for name in self._names[len(args):] if name in kwargs)
        args = list(args)
        table = args[self._page_table]
        # a second column (unused: pages are looked up by position, or masked) keeps the width dynamic:
        # Dynamo specializes a width of 1, so one-page prompts would compile a graph of their own
        if table.shape[1] < 2:
            args[self._page_table] = F.pad(table, (0, 2 - table.shape[1]))
        # as many tokens as sequences means one token each: the runtime never sends a sequence without one
        if args[self._ids].shape[-1] != args[self._seq_lens].shape[0]:
            return self._run_general(args)
        if not self._decode_config or table.shape[0] == 1:  # batch 1 is its own graph; it gains nothing
            return self.decode(*args)
        with inductor_config.patch(self._decode_config):
            return self.decode(*args)

    def _run_general(self, args: list[torch.Tensor]):
        """The general graph, with at least two sequences and two gathered logits: Dynamo specializes a
        dimension of size 1, so one-sequence prompts would compile a graph of their own (~30 s, and a
        slower graph when traced without that specialization). The extra sequence is empty (no tokens:
        cached attention skips it); the repeated logits row is dropped again."""
        if args[self._seq_lens].shape[0] == 1:
            args[self._seq_lens] = F.pad(args[self._seq_lens], (0, 1))
            args[self._input_pos] = F.pad(args[self._input_pos], (0, 1))
            args[self._page_table] = F.pad(args[self._page_table], (0, 0, 0, 1))
        if self._logits_idx is None or args[self._logits_idx].shape[0] != 1:
            return self.general(*args)
        args[self._logits_idx] = args[self._logits_idx].repeat(2)
        logits, *rest = self.general(*args)
        return (logits[:, :1], *rest)


#: Inductor checks the size, stride and alignment of every tensor an extern kernel returns; those Python
#: calls cost 0.3 ms of a 4.5 ms int8 decode step (about 50 kernel calls), and these graphs are fixed.
#: (The C++ wrapper, which calls the kernels without Python in between, made the bare int8 decode graph
#: 0.5 ms faster but the engine's steps no faster, alternating A/B, and compiles 8-40 s longer: not used.)
_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}


def _cached_graph(mod: nn.Module) -> tuple[str, GraphModule]:
    for name, gm in named_graphmodules(mod):
        if KV_CACHE_META_KEY in gm.meta:
            return name, gm
    raise AutoDeployError("compile_model needs the cached graph: run the cache_init stage first")


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
    gathers = LOGITS_IDX in [n.name for n in gm.graph.find_nodes(op="placeholder")]
    device = torch.device(spec.device)
    start = time.perf_counter()
    for i, (num_seqs, num_tokens) in enumerate(shapes):
        if budget is not None and time.perf_counter() - start > budget:
            ad_logger.warning(f"warm-up budget of {budget:.0f} s spent: {len(shapes) - i} shape(s) left to "
                              "compile on first use")
            return
        t0 = time.perf_counter()
        # the warm-up writes k/v into cache page 0 only; stale cache slots are never read before they're written
        seqs = [SequenceRequest([0] * num_tokens, 0, [0] * info.pages_needed(num_tokens)) for _ in range(num_seqs)]
        batch = info.build(seqs, gather="last" if gathers else None, device=device)
        with torch.no_grad(), fx_config.patch(use_duck_shape=False):
            served(*batch.as_args(include_logits_idx=gathers))
        kind = "decode" if num_tokens == 1 else "prefill"
        ad_logger.info(f"compiled {kind} shape {i + 1}/{len(shapes)}: {num_seqs} sequence(s) x {num_tokens} "
                       f"token(s) in {time.perf_counter() - t0:.1f} s")


@TransformRegistry.register("compile_model")
class CompileModel(BaseTransform):
    """Compile the cached graph with the configured backend (see the module docstring)."""

    @classmethod
    def get_config_class(cls):
        return CompileModelConfig

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        if self.config.backend == "torch-simple":
            return mod, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        name, gm = _cached_graph(mod)
        start = time.perf_counter()
        inputs = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        missing = {"input_ids", "seq_lens", "page_table"} - set(inputs)
        if missing or set(inputs) - set(GRAPH_INPUTS):
            raise AutoDeployError(f"compile_model: the cached graph's inputs {inputs} are not the runtime's "
                                  f"{list(GRAPH_INPUTS)}")
        decode = torch.compile(decode_graph(gm), dynamic=True, options=_INDUCTOR_OPTIONS)
        general: nn.Module = gm
        if self.config.compile_prefill:
            compute_rope_tables_once(gm)
            inlined = inline_pure_ops(gm, decode=False)
            ad_logger.info(f"prefill graph: {inlined} canonical op call(s) inlined as plain torch")
            general = torch.compile(gm, dynamic=True, options=_INDUCTOR_OPTIONS)
        served = DecodeDispatch(general, decode, inputs, {"freezing": True} if self.config.freeze_weights else None)
        shapes = _warmup_shapes(self.config.capture_batch_sizes, gm.meta[KV_CACHE_META_KEY].max_batch_size,
                                self.config.compile_prefill)
        ad_logger.info(f"torch.compile (Inductor): warming up {len(shapes)} shape(s)")
        _warmup(served, gm, shapes, self.config.warmup_time_budget_s)
        ad_logger.info(f"compiled in {time.perf_counter() - start:.1f} s")
        mod = served if name == "" else _set_submodule(mod, name, served)
        return mod, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=True)
