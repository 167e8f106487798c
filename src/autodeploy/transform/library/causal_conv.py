"""pattern_matcher stage: ``match_causal_conv1d``, depthwise causal convolutions -> ``torch_causal_conv1d``.

The causal convolution of short-convolution layers (LFM2's ``Lfm2ShortConv``, HF's ``causal_conv1d_fn`` written
out), channels first::

    y = aten.conv1d(x [b, c, s], weight [c, 1, k], bias, stride=[1], padding=[k - 1], dilation=[1], groups=c)
    y = y[:, :, :s]                                  # keep the first s outputs: position t sees t-k+1..t

becomes ``torch_causal_conv1d(x.transpose(1, 2), weight, bias).transpose(1, 2)``: the op works on [b, s, c], the
token stream's layout, and ``insert_cached_ssm`` gives it a per-sequence conv state. A convolution whose every
user is that slice is matched (the end is the input's sequence length, provably); other convolutions, strides,
dilations or paddings are left alone. The Mamba mixers' convolutions reach the graph as the op already (their
export patch, :mod:`autodeploy.export.patches.mamba`).

Invariants: the graph is clean and every ``node.meta["val"]`` is current afterwards (shapes are propagated).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from ...utils.fx import node_val, sizes_equal, static_int
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten
CAUSAL_CONV1D = torch.ops.auto_deploy.torch_causal_conv1d.default


def _arg(node: Node, index: int, name: str, default):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _ints(value) -> list | None:
    if isinstance(value, int):
        return [value]
    return [static_int(v) for v in value] if isinstance(value, (list, tuple)) else None


def _is_causal_depthwise(conv: Node) -> bool:
    x, weight = node_val(conv.args[0]), node_val(conv.args[1]) if len(conv.args) > 1 else None
    if x is None or weight is None or x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != 1:
        return False
    channels, kernel = static_int(weight.shape[0]), static_int(weight.shape[2])
    if channels is None or kernel is None or not sizes_equal(x.shape[1], channels):
        return False
    return (_ints(_arg(conv, 3, "stride", [1])) == [1] and _ints(_arg(conv, 4, "padding", [0])) == [kernel - 1]
            and _ints(_arg(conv, 5, "dilation", [1])) == [1] and _arg(conv, 6, "groups", 1) == channels)


def _keeps_first_positions(user: Node, seq_len) -> bool:
    """``user`` is ``y[:, :, :seq_len]`` (aten.slice on dim 2 from 0 to a size provably ``seq_len``)."""
    if user.op != "call_function" or user.target is not aten.slice.Tensor:
        return False
    dim, start = _arg(user, 1, "dim", 0), _arg(user, 2, "start", None)
    end, step = _arg(user, 3, "end", None), _arg(user, 4, "step", 1)
    if dim not in (2, -1) or start not in (None, 0) or step != 1 or end is None:
        return False
    end = end.meta.get("val") if isinstance(end, Node) else end
    return sizes_equal(end, seq_len)


def match_causal_conv1d(gm: GraphModule) -> int:
    num = 0
    for conv in list(gm.graph.find_nodes(op="call_function", target=aten.conv1d.default)):
        if not _is_causal_depthwise(conv) or not conv.users:
            continue
        x = conv.args[0]
        seq_len = node_val(x).shape[2]
        if not all(_keeps_first_positions(u, seq_len) for u in conv.users):
            continue
        bias = _arg(conv, 2, "bias", None)
        graph = gm.graph
        with graph.inserting_before(conv):
            tokens = graph.call_function(aten.transpose.int, (x, 1, 2))
            out = graph.call_function(CAUSAL_CONV1D, (tokens, conv.args[1], bias))
            channels_first = graph.call_function(aten.transpose.int, (out, 1, 2))
        for user in list(conv.users):
            user.replace_all_uses_with(channels_first)
            graph.erase_node(user)
        graph.erase_node(conv)
        num += 1
    return num


@TransformRegistry.register("match_causal_conv1d")
class MatchCausalConv1d(BaseTransform):
    """Depthwise causal conv1d (padded, then the first positions kept) -> ``torch_causal_conv1d``."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        return gm, TransformInfo.changed(match_causal_conv1d(gm))
