"""cache_init stage: ``gather_logits_before_lm_head``, logits only for the tokens the sampler needs.

Adds the graph input ``logits_idx`` [N] int64 (after the cache metadata of ``insert_cached_attention``) and
selects those token rows: before the LM head's product when only per-token elementwise ops (casts, logit
soft-capping) follow it, so a prompt's head is computed for its last token only, else on the logits. The
LM head is whatever the product-op registry calls a product (a plain, int8 or native linear). The
runtime passes each sequence's last token; without this transform it takes them from the full logits.

With ``through_last_layer`` (the default) the selection then moves up through every op that computes a token's row
from that token's rows alone (:data:`ROW_WISE_OPS`, every registered product, and the ops :func:`_row_args` checks
per call): the final norm, the last layer's MLP, its output projection and residual adds, up to the first op that
mixes tokens (attention) or whose result other ops read in full. A prompt's last layer then runs those ops for its
sampled tokens only (the keys and values of every token are still computed and cached before it). The selected rows'
results are the same arithmetic on the same inputs; products of fewer rows may take another kernel, so they differ
by rounding only.
"""

from __future__ import annotations

import operator

import torch
from pydantic import Field
from torch.fx import GraphModule, Node

from ...runtime.kv_cache import KV_CACHE_META_KEY
from ...runtime.sequence_info import LOGITS_IDX
from ...utils.fx import add_placeholder, fake_input, graph_fake_mode, is_call, node_val, sizes_equal, static_int
from ...utils.logger import ad_logger
from ...utils.products import product_of
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten
ad = torch.ops.auto_deploy

# elementwise ops that may sit between the LM head and the output (casts, logit soft-capping)
_PER_TOKEN_OPS = {aten._to_copy.default, aten.to.dtype, aten.tanh.default, aten.div.Tensor, aten.mul.Tensor,
                  aten.div.Scalar, aten.mul.Scalar, aten.clone.default}

# Ops whose output row for a token depends only on that token's rows of their inputs, so that selecting rows
# after them equals selecting their inputs' rows first: elementwise ops, norms over the last dim, SiLU x up,
# the sum of a tensor-parallel product's partial rows; and, checked per call (_row_args), every registered
# product, torch's norms over trailing dims, and splits and reductions along the last dim. Tokens lie along
# dim 1 ([batch, seq, ...]); an input without that dim (a weight) must broadcast over it.
ROW_WISE_OPS = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.pow.Tensor_Scalar, aten.rsqrt.default,
    aten.sqrt.default, aten.exp.default, aten.tanh.default, aten.sigmoid.default, aten.relu.default,
    aten.silu.default, aten.gelu.default, aten._to_copy.default, aten.to.dtype, aten.alias.default,
    aten.clone.default, aten.contiguous.default, aten.dropout.default, ad.torch_rmsnorm.default,
    ad.torch_layernorm.default, ad.rms_norm.default, ad.add_rms_norm.default, ad.silu_mul.default,
    ad.torch_dist_all_reduce.default,
}
_SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList}
_NORMS = {aten.layer_norm.default, aten.rms_norm.default}
# reshapes of the trailing dims (the token dims kept; the new shape's token count is the selection's)
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack")  # not the shapes, which a new node lacks


def _lm_head(logits: Node) -> Node | None:
    """The product that computes ``logits``, through per-token elementwise ops only; None if there is none."""
    node = logits
    while (
        isinstance(node, Node) and node.op == "call_function" and node.target in _PER_TOKEN_OPS
        and all(not isinstance(a, Node) for a in node.args[1:]) and isinstance(node.args[0], Node)
    ):
        node = node.args[0]
    return node if product_of(node) is not None else None


def gather_logits(gm: GraphModule, logits_idx: Node) -> tuple[Node, str]:
    """Select the ``logits_idx`` tokens (see the module docstring). Returns the selection and where it is."""
    output = gm.graph.output_node()
    outs = output.args[0]
    logits = outs[0] if isinstance(outs, (tuple, list)) else outs
    head = _lm_head(logits)
    if head is not None:
        hidden = product_of(head).input
        with gm.graph.inserting_before(head):
            picked = gm.graph.call_function(aten.index_select.default, (hidden, 1, logits_idx))
        head.replace_input_with(hidden, picked)
        return picked, "before the lm head"
    with gm.graph.inserting_before(output):
        picked = gm.graph.call_function(aten.index_select.default, (logits, 1, logits_idx))
    output.args = (type(outs)([picked, *outs[1:]]),) if isinstance(outs, (tuple, list)) else (picked,)
    return picked, "on the logits"


# -- moving the selection up -----------------------------------------------------------------------
def _is_selection(node: Node, idx: Node) -> bool:
    return is_call(node, aten.index_select.default) and node.args[1] == 1 and node.args[2] is idx


def _along_last_dims(node: Node) -> bool:
    """A norm over trailing dims, or a split or reduction along the last dim only: row-wise per call."""
    val = node_val(node.args[0])
    if val is None or val.dim() < 3:
        return False
    if node.target in _NORMS:  # normalized_shape: trailing dims, never the tokens'
        return len(node.args[1]) <= val.dim() - 2
    if node.target in _SPLITS:
        dims = node.args[2] if len(node.args) > 2 else 0
    elif node.target in _REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else None
    else:
        return False
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return all(isinstance(d, int) and d % val.dim() == val.dim() - 1 for d in dims)


def _outputs(node: Node) -> list[Node] | None:
    """The nodes holding ``node``'s results: itself, or the ``getitem``s of a tuple result."""
    if node.op != "call_function":
        return None
    if isinstance(node.meta.get("val"), torch.Tensor):
        return [node]
    users = list(node.users)
    return users if all(is_call(u, operator.getitem) for u in users) else None


def _token_size(arg, out_dim: int):
    """The size of ``arg`` along the output's token dim (dim 1) once broadcast against it: 1 where it has
    no such dim (constants, weights of trailing dims), None where unknown."""
    if not isinstance(arg, Node):
        return None if isinstance(arg, (list, tuple)) and any(isinstance(a, Node) for a in arg) else 1
    val = node_val(arg)
    if val is None:
        return 1 if arg.op == "get_attr" else None
    axis = 1 - (out_dim - val.dim())
    return 1 if axis < 0 else val.shape[axis]


def _row_args(node: Node, outputs: list[Node], tokens) -> list[int] | None:
    """The positions of ``node``'s arguments to select rows of, if it computes each token's row (``outputs``) from
    that token's rows alone and every other argument broadcasts over the tokens; None otherwise."""
    if any(isinstance(v, Node) for v in node.kwargs.values()):
        return None
    vals = [node_val(o) for o in outputs]
    if not all(v is not None and v.dim() >= 2 and sizes_equal(v.shape[1], tokens) for v in vals):
        return None
    out_dim = vals[0].dim()

    def is_rows(arg) -> bool:
        val = node_val(arg)
        return val is not None and val.dim() == out_dim and sizes_equal(val.shape[1], tokens)

    product = product_of(node)
    if product is not None:  # its other arguments are the weight's (per output feature)
        return [node.args.index(product.input)] if is_rows(product.input) else None
    if node.target is aten.type_as.default:  # its second argument gives the dtype only
        return [0] if is_rows(node.args[0]) else None
    if node.target in _RESHAPES:
        return [0] if _keeps_token_dims(node, tokens) else None
    if node.target not in ROW_WISE_OPS and not _along_last_dims(node):
        return None
    rows = []
    for i, arg in enumerate(node.args):
        if is_rows(arg):
            rows.append(i)
        elif static_int(_token_size(arg, out_dim)) != 1:
            return None
    return rows or None


def _keeps_token_dims(reshape: Node, tokens) -> bool:
    """Whether a reshape keeps the batch and token dims as they are (its shape's token entry is that count or
    -1): it then reshapes each token's row alone."""
    before, after, shape = node_val(reshape.args[0]), node_val(reshape), reshape.args[1]
    if before is None or before.dim() < 2 or not sizes_equal(before.shape[1], tokens) or len(shape) < 2:
        return False
    if not sizes_equal(before.shape[0], after.shape[0]):
        return False
    entry = shape[1]
    count = entry.meta.get("val") if isinstance(entry, Node) else entry
    return entry == -1 or (isinstance(count, torch.SymInt) and sizes_equal(count, tokens))


def _selected_shape(graph, shape: list, selected: Node) -> list:
    """A reshape's shape for the selected rows: its token count read from the selection."""
    if not isinstance(shape[1], Node):
        return list(shape)
    return [shape[0], graph.call_function(aten.sym_size.int, (selected, 1)), *shape[2:]]


def _selected(value: Node, idx: Node, position: dict[Node, int]) -> Node:
    """``value``'s rows at ``idx`` (dim 1): the selection already in the graph, or a new one after both."""
    for user in value.users:
        if _is_selection(user, idx):
            return user
    with value.graph.inserting_after(max(value, idx, key=position.__getitem__)):
        return value.graph.call_function(aten.index_select.default, (value, 1, idx))


def select_rows_early(gm: GraphModule, selection: Node) -> int:
    """Move ``selection`` (``index_select(x, 1, idx)`` over [batch, seq, ...] tokens) up through the row-wise
    ops before it, as far as each op's results are read only through selections of the same rows. Returns how
    many ops now run on the selected rows only."""
    graph, idx = gm.graph, selection.args[2]
    source = node_val(selection.args[0])
    if source is None:
        return 0
    tokens, position = source.shape[1], {n: i for i, n in enumerate(graph.nodes)}
    max(selection.args[0], idx, key=position.__getitem__).append(selection)  # where _selected puts selections
    moved, work, erased = 0, [selection], set()
    while work:
        picked = work.pop()
        if picked in erased:
            continue
        value = picked.args[0]
        node = value.args[0] if is_call(value, operator.getitem) else value
        outputs = _outputs(node)
        if not outputs or not all(_is_selection(u, idx) for out in outputs for u in out.users):
            continue  # some op reads every row of a result
        rows = _row_args(node, outputs, tokens)
        if rows is None:
            continue
        args = list(node.args)
        for i in rows:
            args[i] = _selected(args[i], idx, position)
        with graph.inserting_before(node):
            if node.target in _RESHAPES:
                args[1] = _selected_shape(graph, args[1], args[0])
            new = graph.call_function(node.target, tuple(args), dict(node.kwargs))
            new.meta.update({k: v for k, v in node.meta.items() if k in _KEPT_META})
            for out in outputs:
                if not out.users:
                    continue
                row_out = new if out is node else graph.call_function(operator.getitem, (new, out.args[1]))
                for user in list(out.users):
                    user.replace_all_uses_with(row_out)
                    graph.erase_node(user)
                    erased.add(user)
        for out in outputs:
            if out is not node:
                graph.erase_node(out)
        graph.erase_node(node)
        moved += 1
        work.extend(args[i] for i in rows)  # their values may now be read through selections only
    return moved


class GatherLogitsConfig(TransformConfig):
    through_last_layer: bool = Field(
        default=True, description="Move the selection up through the row-wise ops before the LM head (the final "
        "norm, the last layer's MLP and output projection), so that a prompt runs them for its sampled tokens only.")


@TransformRegistry.register("gather_logits_before_lm_head")
class GatherLogitsBeforeLMHead(BaseTransform):
    """Add ``logits_idx`` and gather those tokens' logits, before the LM head where possible."""

    config: GatherLogitsConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        if KV_CACHE_META_KEY not in gm.meta:  # the runtime's calling convention starts at cache_init
            return gm, TransformInfo.unchanged()
        if LOGITS_IDX in [n.name for n in gm.graph.find_nodes(op="placeholder")]:
            return gm, TransformInfo.unchanged()
        val = fake_input(graph_fake_mode(gm), LOGITS_IDX, ("num_logits",), torch.long)
        selection, where = gather_logits(gm, add_placeholder(gm, LOGITS_IDX, val))
        moved = select_rows_early(gm, selection) if self.config.through_last_layer else 0
        ad_logger.info(f"logits gathered {where}" + (f"; {moved} ops before it now run on those tokens only"
                                                      if moved else ""))
        return gm, TransformInfo.changed(1)
