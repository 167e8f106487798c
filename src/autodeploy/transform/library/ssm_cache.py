"""cache_init stage: ``insert_cached_ssm``, state-space ops over a per-sequence state cache.

Replaces every ``auto_deploy::torch_causal_conv1d``, ``torch_selective_scan``, ``torch_ssd_scan`` and
``torch_gated_delta_rule`` with its cached form (:mod:`autodeploy.custom_ops.cached_ssm`) and gives each a state
buffer on the graph module (a meta placeholder until ``initialize_cache`` allocates it: [max_batch_size, *state],
one slot per running sequence): ``ssm_conv_state_<i>`` [channels, kernel - 1] in the activations' dtype,
``ssm_state_<i>`` in float32: [channels, state] (Mamba-1), [heads, head_dim, state] (Mamba-2), [value heads, key
dim, value dim] (gated delta rule). The layers join the graph's :class:`~autodeploy.runtime.kv_cache.KVCacheSpec`
(``StateLayer`` entries), so the state cache is sized, allocated and served with the paged KV cache.

Runs after ``insert_cached_attention``: a hybrid's graph already has the cache metadata inputs and the spec;
a graph without attention gets them here (field ``page_size``: the pages only bound the sequences' lengths,
the graph stores nothing in them). Either way it adds the input ``slot_idx`` [num_seqs] int32 right after
``page_table`` (see :mod:`autodeploy.runtime.sequence_info`).
"""

from __future__ import annotations

import torch
from pydantic import Field
from torch.fx import GraphModule, Node

from ...errors import AutoDeployError
from ...runtime import kv_cache as kvc
from ...runtime.sequence_info import METADATA_INPUTS, SLOT_IDX
from ...utils.fx import node_val, op_args
from ...utils.logger import ad_logger
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry
from .kvcache import add_metadata_inputs

_ops = torch.ops.auto_deploy


class InsertCachedSSMConfig(TransformConfig):
    page_size: int = Field(default=64, ge=1, description="Tokens per page when the graph has no attention "
                           "(insert_cached_attention's page_size otherwise).")


def _val(node, what: str, transform_node: Node) -> torch.Tensor:
    val = node_val(node)
    if val is None:
        raise AutoDeployError(f"insert_cached_ssm: no shape for the {what} of {transform_node.name}; run shape prop")
    return val


def _metadata(gm: GraphModule, spec: kvc.KVCacheSpec, created: bool) -> dict[str, Node]:
    """The metadata inputs (added when the graph has none yet) and ``slot_idx`` after ``page_table``."""
    if created:
        metadata = add_metadata_inputs(gm, spec, "insert_cached_ssm")
    else:
        placeholders = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
        missing = [name for name in METADATA_INPUTS if name not in placeholders]
        if missing:
            raise AutoDeployError(f"insert_cached_ssm: the cached graph lacks the metadata input(s) {missing}")
        if SLOT_IDX in placeholders:
            raise AutoDeployError(f"insert_cached_ssm: the graph already has an input {SLOT_IDX!r}")
        metadata = {name: placeholders[name] for name in METADATA_INPUTS}
    page_table = metadata["page_table"]
    with gm.graph.inserting_after(page_table):
        slot_idx = gm.graph.placeholder(SLOT_IDX)
    if slot_idx.name != SLOT_IDX:  # fx renamed it: a node of that name exists
        raise AutoDeployError(f"insert_cached_ssm: the graph already has a node named {SLOT_IDX!r}")
    seq_lens = node_val(metadata["seq_lens"])
    if seq_lens is not None:  # the same dynamic num_seqs as the other metadata
        slot_idx.meta["val"] = seq_lens.new_empty(seq_lens.shape)
    metadata[SLOT_IDX] = slot_idx
    return metadata


def _register_state(gm: GraphModule, spec: kvc.KVCacheSpec, layer: kvc.StateLayer) -> Node:
    if hasattr(gm, layer.name):
        raise AutoDeployError(f"insert_cached_ssm: the graph already has an attribute {layer.name!r}")
    gm.register_buffer(layer.name, torch.empty(0, *layer.shape, dtype=layer.dtype, device="meta"), persistent=False)
    spec.state_layers.append(layer)
    return gm.graph.get_attr(layer.name)


@TransformRegistry.register("insert_cached_ssm")
class InsertCachedSSM(BaseTransform):
    """Replace the state-space ops with their cached forms over a per-sequence state cache."""

    config: InsertCachedSSMConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        graph = gm.graph
        convs = list(graph.find_nodes(op="call_function", target=_ops.torch_causal_conv1d.default))
        scans = list(graph.find_nodes(op="call_function", target=_ops.torch_selective_scan.default))
        ssds = list(graph.find_nodes(op="call_function", target=_ops.torch_ssd_scan.default))
        deltas = list(graph.find_nodes(op="call_function", target=_ops.torch_gated_delta_rule.default))
        if not convs and not scans and not ssds and not deltas:
            return gm, TransformInfo.unchanged()
        created = kvc.KV_CACHE_META_KEY not in gm.meta
        spec = (kvc.KVCacheSpec("none", self.config.page_size, ctx.max_batch_size, ctx.max_seq_len) if created
                else gm.meta[kvc.KV_CACHE_META_KEY])
        meta = _metadata(gm, spec, created)
        seq_meta = (meta["seq_lens"], meta["input_pos"], meta[SLOT_IDX])

        for i, node in enumerate(convs):
            args = op_args(node)
            x, weight = _val(args["x"], "input", node), _val(args["weight"], "weight", node)
            layer = kvc.StateLayer(f"ssm_conv_state_{i}", (int(weight.shape[0]), int(weight.shape[-1]) - 1), x.dtype)
            with graph.inserting_before(node):
                state = _register_state(gm, spec, layer)
                cached = graph.call_function(_ops.torch_cached_causal_conv1d.default,
                                             (args["x"], args["weight"], args["bias"], state, *seq_meta))
            node.replace_all_uses_with(cached)
            graph.erase_node(node)
        for i, node in enumerate(scans):
            args = op_args(node)
            A = _val(args["A"], "A", node)
            layer = kvc.StateLayer(f"ssm_state_{i}", tuple(int(d) for d in A.shape), torch.float32)
            with graph.inserting_before(node):
                state = _register_state(gm, spec, layer)
                cached = graph.call_function(
                    _ops.torch_cached_selective_scan.default,
                    (args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"], args["z"], args["dt_bias"],
                     args["dt_softplus"], state, *seq_meta),
                )
            node.replace_all_uses_with(cached)
            graph.erase_node(node)
        for i, node in enumerate(ssds, start=len(scans)):
            args = op_args(node)
            x, B = _val(args["x"], "input", node), _val(args["B"], "B", node)
            shape = (int(x.shape[-2]), int(x.shape[-1]), int(B.shape[-1]))  # heads, head_dim, state
            layer = kvc.StateLayer(f"ssm_state_{i}", shape, torch.float32)
            with graph.inserting_before(node):
                state = _register_state(gm, spec, layer)
                cached = graph.call_function(
                    _ops.torch_cached_ssd_scan.default,
                    (args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"], args["dt_bias"],
                     args["dt_softplus"], args["dt_min"], args["dt_max"], state, *seq_meta),
                )
            node.replace_all_uses_with(cached)
            graph.erase_node(node)
        for i, node in enumerate(deltas, start=len(scans) + len(ssds)):
            args = op_args(node)
            k, v = _val(args["k"], "key", node), _val(args["v"], "value", node)
            shape = (int(v.shape[-2]), int(k.shape[-1]), int(v.shape[-1]))  # value heads, key dim, value dim
            layer = kvc.StateLayer(f"ssm_state_{i}", shape, torch.float32)
            with graph.inserting_before(node):
                state = _register_state(gm, spec, layer)
                cached = graph.call_function(
                    _ops.torch_cached_gated_delta_rule.default,
                    (args["q"], args["k"], args["v"], args["g"], args["beta"], args["qk_l2norm"], state, *seq_meta),
                )
            node.replace_all_uses_with(cached)
            graph.erase_node(node)

        gm.meta[kvc.KV_CACHE_META_KEY] = spec
        ctx.extras[kvc.KV_CACHE_META_KEY] = spec
        num_scans = len(scans) + len(ssds) + len(deltas)
        ad_logger.info(f"{len(convs)} conv / {num_scans} scan node(s) -> cached state-space ops, "
                       f"{spec.state_nbytes} state-cache bytes for {spec.max_batch_size} sequences")
        return gm, TransformInfo(skipped=False, num_matches=len(convs) + num_scans, is_clean=False,
                                 has_valid_shapes=False)
