"""compile stage: ``compile_model`` compiles the cached graph (the one the runtime serves).

Config: ``backend``: ``torch-simple`` (no compilation: the GraphModule runs as generated Python code) or
``torch-compile`` (``torch.compile(gm, dynamic=True)``, Inductor); ``capture_batch_sizes`` (decode batch
sizes compiled up front, like CUDA-graph batch sizes; capped by ``max_batch_size``); ``warmup_prefill``
(also compile the prefill shapes up front); ``warmup_time_budget_s`` (stop warming up once this much time
is spent: the remaining shapes compile on first use).

Before compiling, the pure canonical ops (:data:`INLINED_FOR_COMPILE`: RMSNorm, RoPE, repeat_kv, int8
linear) are swapped for their plain-torch implementations, so Inductor sees their aten ops and fuses them
with their neighbours (a custom op is an opaque call to Dynamo); cached attention, which writes the cache and
branches on the batch's metadata, stays one opaque op.

Compile time is part of the user's wait: each warm-up shape logs its progress and time. With
``dynamic=True`` dynamo still specializes dimensions of size 1, so the warm-up covers: one sequence with
one token (batch-1 decode), one sequence with several tokens (single-prompt prefill) and the general
graph (several sequences); duck sizing (equal sizes sharing one symbol) is turned off during the warm-up
so that a decode graph (tokens == sequences) is not specialized to that equality.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.fx import GraphModule

from ...errors import AutoDeployError
from ...runtime.kv_cache import KV_CACHE_META_KEY
from ...runtime.sequence_info import LOGITS_IDX, SequenceInfo, SequenceRequest
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
    warmup_prefill: bool = Field(default=True, description="Also compile the prefill shapes up front.")
    warmup_time_budget_s: float | None = Field(
        default=600.0, description="Stop the warm-up after this many seconds (null: no limit)."
    )
    run_per_gm: bool = False
    requires_clean_graph: bool = False
    run_graph_cleanup: bool = False


#: pure auto_deploy ops whose Python implementation replaces them in the graph before torch.compile
INLINED_FOR_COMPILE = ("torch_rmsnorm", "torch_rope_with_explicit_cos_sin", "torch_repeat_kv", "torch_int8_linear")


def inline_pure_ops(gm: GraphModule) -> int:
    """Point the nodes of :data:`INLINED_FOR_COMPILE` ops at the ops' Python implementations (traceable by
    Dynamo). Returns how many nodes changed."""
    from torch._library.custom_ops import OPDEFS

    impls = {}
    for name in INLINED_FOR_COMPILE:
        opdef = OPDEFS.get(f"auto_deploy::{name}")
        if opdef is not None:
            impls[getattr(torch.ops.auto_deploy, name).default] = opdef._init_fn
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in impls:
            node.target = impls[node.target]
            changed += 1
    if changed:
        gm.recompile()
    return changed


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


def _warmup(compiled: nn.Module, gm: GraphModule, shapes: list[tuple[int, int]], budget: float | None) -> None:
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
            compiled(*batch.as_args(include_logits_idx=gathers))
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
        inlined = inline_pure_ops(gm)
        if inlined:
            ad_logger.info(f"{inlined} canonical op call(s) inlined as plain torch for Inductor to fuse")
        compiled = torch.compile(gm, dynamic=True)
        shapes = _warmup_shapes(self.config.capture_batch_sizes, gm.meta[KV_CACHE_META_KEY].max_batch_size,
                                self.config.warmup_prefill)
        ad_logger.info(f"torch.compile (Inductor, dynamic): warming up {len(shapes)} shape(s)")
        _warmup(compiled, gm, shapes, self.config.warmup_time_budget_s)
        ad_logger.info(f"compiled in {time.perf_counter() - start:.1f} s")
        mod = compiled if name == "" else _set_submodule(mod, name, compiled)
        return mod, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=True)
