"""cache_init stage: cached attention over a paged KV cache.

- ``insert_cached_attention`` (fields ``backend``, ``page_size``): replaces every
  ``auto_deploy::torch_attention`` with the backend's cached-attention op (and every ``torch_mla`` with
  ``torch_cached_mla``, whose two caches hold the latent and the rope key), adds the sequence-metadata
  inputs and the cache buffers (meta placeholders until allocated), and records a
  :class:`~autodeploy.runtime.kv_cache.KVCacheSpec` in ``gm.meta["kv_cache"]`` and ``ctx.extras["kv_cache"]``.
- ``initialize_cache`` (field ``num_pages``): allocates the caches (default: enough pages for
  ``max_batch_size`` sequences of ``max_seq_len`` tokens) on the pipeline's device.
- ``resize_kv_cache`` (fields ``free_memory_fraction``, ``max_tokens``): re-sizes the caches to a memory
  budget: a fraction of the device's free memory (counting the current caches as free) and/or an
  explicit token count; the smaller wins, capped at what ``max_batch_size`` sequences can use. The
  caches never exceed the budget: too small a budget is an error, not an over-allocation.

The graph's calling convention afterwards (see :mod:`autodeploy.runtime.sequence_info`):

    forward(input_ids [1, T], position_ids [1, T], seq_lens [B] int32, input_pos [B] int32,
            page_table [B, max_pages_per_seq] int32, logits_idx [N] int64) -> (logits [1, N, vocab],)

``logits_idx`` is added by ``gather_logits_before_lm_head`` (:mod:`.gather_logits`, on by default);
without it logits is [1, T, vocab]. The caches are buffers of the graph module (``kv_cache_k_<i>`` /
``kv_cache_v_<i>``), not inputs: the runtime never passes them, and a resize swaps them in place.
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch import nn
from torch.fx import GraphModule, Node

from ...custom_ops.cached_attention import DEFAULT_ATTENTION_BACKEND, get_attention_backend
from ...distributed import agree_min
from ...errors import AutoDeployError
from ...runtime import kv_cache as kvc
from ...runtime.sequence_info import METADATA_INPUTS
from ...utils.fx import add_placeholder, fake_input, graph_fake_mode, named_graphmodules, node_val, op_args
from ...utils.logger import ad_logger
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten


# -- the sequence-metadata inputs ------------------------------------------------------------------
def add_metadata_inputs(gm: GraphModule, spec: kvc.KVCacheSpec, transform: str) -> dict[str, Node]:
    """Add the graph inputs ``seq_lens``, ``input_pos`` [num_seqs] and ``page_table`` [num_seqs, P] (int32, one
    dynamic num_seqs shared by the three); the first cache_init transform that needs them calls this."""
    fake_mode = graph_fake_mode(gm)
    meta_shapes = {"seq_lens": ("num_seqs",), "input_pos": ("num_seqs",),
                   "page_table": ("num_seqs", spec.max_pages_per_seq)}
    metadata = {}
    for name in METADATA_INPUTS:
        # one symbol for num_seqs, shared by the three inputs
        val = fake_input(fake_mode, name, meta_shapes[name], torch.int32) if name == "seq_lens" else None
        if val is not None:
            num_seqs = val.shape[0]
        elif fake_mode is not None:
            with fake_mode:
                shape = [num_seqs if d == "num_seqs" else d for d in meta_shapes[name]]
                val = torch.empty(shape, dtype=torch.int32)
        try:
            metadata[name] = add_placeholder(gm, name, val)
        except ValueError as err:
            raise AutoDeployError(f"{transform}: {err}") from None
    return metadata


# -- insert_cached_attention ----------------------------------------------------------------------
class InsertCachedAttentionConfig(TransformConfig):
    backend: str = Field(default=DEFAULT_ATTENTION_BACKEND, description="Cached-attention backend (registry name).")
    page_size: int = Field(default=64, ge=1, description="Tokens per KV-cache page.")
    requires_shape_prop: bool = Field(default=True, description="Needs k/v shapes in node.meta['val'].")


def _shape(node, what: str) -> tuple:
    val = node_val(node)
    if val is None:
        raise AutoDeployError(f"insert_cached_attention: no shape for the attention {what} ({node}); run shape prop")
    return tuple(val.shape), val.dtype


@TransformRegistry.register("insert_cached_attention")
class InsertCachedAttention(BaseTransform):
    """Replace ``torch_attention`` with cached attention over a paged KV cache."""

    config: InsertCachedAttentionConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        attn_nodes = list(gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_attention.default))
        mla_nodes = list(gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_mla.default))
        if not attn_nodes and not mla_nodes:
            return gm, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        if kvc.KV_CACHE_META_KEY in gm.meta:
            raise AutoDeployError("insert_cached_attention: the graph already has a KV cache")
        backend = get_attention_backend(self.config.backend)
        page_size = self.config.page_size
        spec = kvc.KVCacheSpec(backend.name, page_size, ctx.max_batch_size, ctx.max_seq_len)

        metadata = add_metadata_inputs(gm, spec, "insert_cached_attention")

        order = {n: i for i, n in enumerate(gm.graph.nodes)}  # one layer index per attention, in graph order
        layer_of = {n: i for i, n in enumerate(sorted(attn_nodes + mla_nodes, key=order.__getitem__))}
        layers: dict[int, kvc.CacheLayer] = {}
        for node in mla_nodes:  # the compact cache: the latent and the rope key of every token
            args = op_args(node)
            latent, _ = _shape(args["kv_latent"], "kv latent")
            k_pe, dtype = _shape(args["k_pe"], "rope key")
            i = layer_of[node]
            layer = kvc.CacheLayer(f"kv_cache_k_{i}", f"kv_cache_v_{i}", 1, int(latent[-1]), int(k_pe[-1]), dtype)
            layers[i] = layer
            self._register_caches(gm, layer, page_size)
            with gm.graph.inserting_before(node):
                caches = (gm.graph.get_attr(layer.k_name), gm.graph.get_attr(layer.v_name))
                cached = gm.graph.call_function(
                    torch.ops.auto_deploy.torch_cached_mla.default,
                    (args["q_nope"], args["q_pe"], args["kv_latent"], args["k_pe"], args["kv_b_weight"], *caches,
                     metadata["seq_lens"], metadata["input_pos"], metadata["page_table"]),
                    {"scale": args["scale"]},
                )
            node.replace_all_uses_with(cached)
            gm.graph.erase_node(node)

        for node in attn_nodes:
            i = layer_of[node]
            args = op_args(node)
            if args["attn_mask"] is not None:
                raise AutoDeployError(f"insert_cached_attention: {node.name} has an explicit attn_mask, which a "
                                      "paged cache cannot apply; only causal masking is supported")
            if not args["is_causal"]:
                raise AutoDeployError(f"insert_cached_attention: {node.name} is not causal")
            for feature in ("sinks", "sliding_window", "logit_cap", "alibi_slopes"):
                if args[feature] is not None and not getattr(backend, f"supports_{feature}"):
                    raise AutoDeployError(
                        f"attention backend {backend.name!r} does not support {feature} ({node.name})")
            layout = args["layout"]
            q, k, v = args["query"], args["key"], args["value"]
            (k_shape, dtype), (v_shape, _) = _shape(k, "key"), _shape(v, "value")
            n_kv_dim = 2 if layout == "bsnd" else 1
            layer = kvc.CacheLayer(f"kv_cache_k_{i}", f"kv_cache_v_{i}", int(k_shape[n_kv_dim]),
                                   int(k_shape[-1]), int(v_shape[-1]), dtype)
            layers[i] = layer
            self._register_caches(gm, layer, page_size)

            graph = gm.graph
            with graph.inserting_before(node):
                if layout == "bnsd":
                    q, k, v = (graph.call_function(aten.transpose.int, (t, 1, 2)) for t in (q, k, v))
                k_cache, v_cache = graph.get_attr(layer.k_name), graph.get_attr(layer.v_name)
                cached = graph.call_function(
                    backend.op,
                    (q, k, v, k_cache, v_cache, metadata["seq_lens"], metadata["input_pos"], metadata["page_table"]),
                    {"scale": args["scale"], "sinks": args["sinks"], "sliding_window": args["sliding_window"],
                     "logit_cap": args["logit_cap"], "alibi_slopes": args["alibi_slopes"]},
                )
                out = graph.call_function(aten.transpose.int, (cached, 1, 2)) if layout == "bnsd" else cached
            node.replace_all_uses_with(out)
            graph.erase_node(node)

        spec.layers.extend(layers[i] for i in sorted(layers))
        gm.meta[kvc.KV_CACHE_META_KEY] = spec
        ctx.extras[kvc.KV_CACHE_META_KEY] = spec
        mla = f", {len(mla_nodes)} MLA node(s) -> latent-cached torch_cached_mla" if mla_nodes else ""
        ad_logger.info(
            f"{len(attn_nodes)} attention node(s) -> {backend.name} cached attention{mla}, page_size={page_size}, "
            f"{spec.bytes_per_token} cache bytes/token"
        )
        return gm, TransformInfo(skipped=False, num_matches=len(spec.layers), is_clean=False, has_valid_shapes=False)

    @staticmethod
    def _register_caches(gm: GraphModule, layer: kvc.CacheLayer, page_size: int) -> None:
        """The layer's two caches as empty meta buffers (``initialize_cache`` allocates them)."""
        for name, dim in ((layer.k_name, layer.head_dim), (layer.v_name, layer.v_head_dim)):
            if hasattr(gm, name):
                raise AutoDeployError(f"insert_cached_attention: the graph already has an attribute {name!r}")
            empty = torch.empty(0, page_size, layer.n_kv_heads, dim, dtype=layer.dtype, device="meta")
            gm.register_buffer(name, empty, persistent=False)


# -- initialize_cache / resize_kv_cache -----------------------------------------------------------
def _cached_gms(mod: nn.Module) -> list[tuple[GraphModule, kvc.KVCacheSpec]]:
    return [(gm, gm.meta[kvc.KV_CACHE_META_KEY]) for _, gm in named_graphmodules(mod)
            if kvc.KV_CACHE_META_KEY in gm.meta]


def _allocate_all(mod, ctx, num_pages: int, budget: int | None) -> int:
    pairs = _cached_gms(mod)
    total = sum(spec.nbytes(num_pages) for _, spec in pairs)
    if budget is not None and total > budget:  # check before releasing anything
        raise AutoDeployError(f"a KV cache of {num_pages} pages needs {total} bytes, over its budget of {budget}")
    for gm, spec in pairs:
        kvc.allocate_kv_caches(gm, spec, num_pages, ctx.device)
    return total


class InitializeCacheConfig(TransformConfig):
    num_pages: int | None = Field(
        default=None, ge=1, description="Pages to allocate; None: enough for max_batch_size full-length sequences."
    )
    expect_mem_change: bool = True


@TransformRegistry.register("initialize_cache")
class InitializeCache(BaseTransform):
    """Allocate the KV caches recorded by ``insert_cached_attention`` (zero-filled, on ``ctx.device``)."""

    config: InitializeCacheConfig

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        pairs = _cached_gms(mod)
        if not pairs:
            return mod, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        num_pages = self.config.num_pages or max(spec.max_useful_pages for _, spec in pairs)
        free = kvc.available_memory_bytes(ctx.device)
        total = _allocate_all(mod, ctx, num_pages, budget=free + sum(s.nbytes() for _, s in pairs))
        ad_logger.info(f"KV cache: {num_pages} pages x {pairs[0][1].page_size} tokens, {total / 2**20:.1f} MiB")
        return mod, TransformInfo(skipped=False, num_matches=len(pairs), is_clean=True, has_valid_shapes=True)


class ResizeKVCacheConfig(TransformConfig):
    free_memory_fraction: float | None = Field(
        default=0.5, gt=0.0, le=1.0,
        description="Budget: this fraction of the device's free memory (the current caches count as free).",
    )
    max_tokens: int | None = Field(default=None, ge=1, description="Budget: at most this many cached tokens.")
    expect_mem_change: bool = True


def kv_cache_budget(spec_pairs, device, free_memory_fraction: float | None, max_tokens: int | None):
    """(budget bytes or None, number of pages within it) for the caches of ``spec_pairs``."""
    bytes_per_page = sum(spec.bytes_per_page for _, spec in spec_pairs)
    state_bytes = sum(spec.state_nbytes for _, spec in spec_pairs)  # fixed: one slot per sequence
    page_size = spec_pairs[0][1].page_size
    budget, num_pages = None, max(spec.max_useful_pages for _, spec in spec_pairs)
    if free_memory_fraction is not None:
        free = kvc.available_memory_bytes(device) + sum(spec.nbytes() for _, spec in spec_pairs)
        budget = int(free * free_memory_fraction)
        if bytes_per_page:  # pages of a graph without attention cost nothing
            num_pages = min(num_pages, max(budget - state_bytes, 0) // bytes_per_page)
        elif budget < state_bytes:
            num_pages = 0
    if max_tokens is not None:
        token_budget = (max_tokens // page_size) * bytes_per_page + state_bytes
        budget = token_budget if budget is None else min(budget, token_budget)
        num_pages = min(num_pages, max_tokens // page_size)
    return budget, num_pages


@TransformRegistry.register("resize_kv_cache")
class ResizeKVCache(BaseTransform):
    """Re-size the KV caches to the memory budget (never above it)."""

    config: ResizeKVCacheConfig

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        pairs = _cached_gms(mod)
        if not pairs:
            return mod, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        cfg = self.config
        if cfg.free_memory_fraction is None and cfg.max_tokens is None:
            raise AutoDeployError("resize_kv_cache: set free_memory_fraction and/or max_tokens")
        budget, num_pages = kv_cache_budget(pairs, ctx.device, cfg.free_memory_fraction, cfg.max_tokens)
        num_pages = agree_min(num_pages)  # every rank holds the same pages (of its own heads)
        spec = pairs[0][1]
        if num_pages < 1:
            raise AutoDeployError(
                f"resize_kv_cache: a budget of {budget} bytes holds no KV-cache page "
                f"({sum(s.bytes_per_page for _, s in pairs)} bytes per page of {spec.page_size} tokens, "
                f"{sum(s.state_nbytes for _, s in pairs)} bytes of state cache)"
            )
        if num_pages < spec.max_pages_per_seq:
            ad_logger.warning(f"KV cache of {num_pages * spec.page_size} tokens cannot hold one sequence of "
                              f"max_seq_len={spec.max_seq_len} tokens")
        total = _allocate_all(mod, ctx, num_pages, budget)
        ad_logger.info(f"KV cache resized: {num_pages} pages ({num_pages * spec.page_size} tokens), "
                       f"{total / 2**20:.1f} MiB within a budget of {budget / 2**20:.1f} MiB")
        return mod, TransformInfo(skipped=False, num_matches=len(pairs), is_clean=True, has_valid_shapes=True)
