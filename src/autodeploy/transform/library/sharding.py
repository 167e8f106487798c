"""sharding stage: split the canonical graph for ``world_size`` ranks (tensor and expert parallelism).

``detect_sharding`` decides, per region of the graph, how it is split, and records the decisions in the
pipeline context (``ctx.extras["sharding"]``, a :class:`ShardingPlan`); ``sharding_transform_executor``
applies them to this rank's graph. Regions, read from the canonical graph (products through the
product-op registry):

- **attention**: the q/k/v products that feed a ``torch_attention`` (through views, per-head norms and
  RoPE) split by output rows in whole heads, the product after it (o) by input columns, followed by an
  all-reduce. With more ranks than KV heads (``world_size`` a multiple of them), each rank keeps the KV head
  its query heads use. Views with literal head counts are rewritten for the local count; attention sinks are
  split with their heads.
- **mlp**: products sharing an input whose outputs meet only through elementwise ops (gate/up, SiLU, the
  product) in one closing product (down): split by the intermediate dim, all-reduce after the closer.
- **moe** (``ep``): the experts of each ``torch_moe`` partitioned across ranks (the remainder to the last
  rank), the routing remapped to the local experts (others become the op's sentinel), an all-reduce after
  the block. The router and shared experts stay outside it (the shared experts' MLP is split as an mlp).
- **bmm** (``bmm``): a batched matmul with a weight of the graph, split on its batch dim, followed by an
  all-gather.

What is not understood (fused q/k/v, norms over all heads such as OLMo-2's q/k norm, head counts that do
not divide) stays replicated, or with ``simple_shard_only`` every product is split by columns and
all-gathered: never a wrong result. Plans from ``manual_config.tp_plan`` and the model config's
``base_model_tp_plan`` (``sharding_source``) name products by module pattern: a region is split as a
region only where the plan's styles agree with its roles (colwise openers, rowwise closer); a product the
plan names outside such a region is split on its own (colwise or gather: all-gather after it; rowwise: its
input sliced, an all-reduce after it).

Weights stay on the meta device here: the executor gives each sliced parameter its local shape and records
``(dim, start, end)`` per parameter in ``gm.meta["sharding"]``, so ``load_weights`` keeps only this rank's
slice. Biases of row-split products are added once, after the all-reduce.
"""

from __future__ import annotations

import fnmatch
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, Field
from torch.fx import GraphModule, Node

from ...errors import ConfigError
from ...export.export import assign_tensor
from ...utils.fx import get_attr_tensor, is_call, node_val, op_args, static_int
from ...utils.logger import ad_logger
from ...utils.products import Product, product_of
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten
SHARDING_KEY = "sharding"
Style = Literal["colwise", "rowwise", "gather"]

_ROPE = torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default
_NORMS = (torch.ops.auto_deploy.torch_rmsnorm.default, torch.ops.auto_deploy.torch_layernorm.default)
# ops a head-local chain passes through between a product and the attention (and after it)
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_HEAD_LOCAL = _RESHAPES | {aten.transpose.int, aten.contiguous.default, aten.to.dtype, aten._to_copy.default,
                           aten.clone.default, aten.alias.default}
# elementwise ops allowed between an mlp's openers and its closer
_ELEMENTWISE = {aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default,
                aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.to.dtype,
                aten._to_copy.default, aten.pow.Tensor_Scalar, aten.mul.Scalar, aten.add.Scalar, aten.div.Scalar,
                aten.clamp.default, aten.minimum.default, aten.maximum.default}


# -- config ---------------------------------------------------------------------------------------------
class ManualShardingConfig(BaseModel):
    tp_plan: dict[str, Style] = Field(
        default_factory=dict,
        description="Module-name patterns (HF plan syntax, '*' for one name, e.g. 'layers.*.mlp.down_proj') to "
        "colwise, rowwise or gather.")


class DetectShardingConfig(GraphRewriteConfig):
    sharding_source: list[Literal["manual", "factory", "heuristic"]] = Field(
        default_factory=lambda: ["manual", "factory", "heuristic"],
        description="Where the decisions come from, in order of preference.")
    manual_config: ManualShardingConfig = Field(default_factory=ManualShardingConfig)
    support_partial_config: bool = Field(
        default=True, description="A plan that covers only some products leaves the rest to the next source.")
    sharding_dims: list[Literal["tp", "ep", "bmm"]] = Field(default_factory=lambda: ["tp", "ep", "bmm"])
    simple_shard_only: bool = Field(default=False, description="Split every product by columns + all-gather.")
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="torch.distributed backend: auto is NCCL on CUDA, gloo on CPU.")


# -- decisions ------------------------------------------------------------------------------------------
@dataclass
class Split:
    """One product split: ``style`` colwise (output rows [start, end)), rowwise (input columns [start,
    end), an all-reduce after) or gather (colwise, an all-gather after). ``role``: a region's ``opener``
    (colwise, its output stays split) or ``closer`` (rowwise, its input is already split), or ``lone``: a
    product split on its own (colwise gathers after it, rowwise slices its input first)."""

    node: str
    style: Style
    start: int
    end: int
    role: Literal["opener", "closer", "lone"] = "lone"


@dataclass
class Region:
    kind: str  # attention, mlp, moe, bmm, product
    splits: list[Split] = field(default_factory=list)
    views: dict[str, tuple[int, int]] = field(default_factory=dict)  # view node -> (full size, local size)
    sinks: tuple[str, int, int] | None = None  # sinks get_attr target, start, end
    moe: tuple[str, int, int] | None = None  # torch_moe node, first local expert, end


@dataclass
class ShardingPlan:
    rank: int
    world_size: int
    regions: list[Region] = field(default_factory=list)
    replicated: Counter = field(default_factory=Counter)  # region kind -> times left as is

    def summary(self) -> str:
        done = Counter(r.kind for r in self.regions)
        parts = [f"{kind} x{n} split" for kind, n in sorted(done.items())]
        parts += [f"{kind} x{n} replicated" for kind, n in sorted(self.replicated.items())]
        return ", ".join(parts) or "nothing to split"


def _even(size: int, rank: int, world: int) -> tuple[int, int]:
    share = size // world
    return rank * share, (rank + 1) * share


# -- region detection ----------------------------------------------------------------------------------
def _chain_back(node, stop) -> tuple[Product | None, list[Node]]:
    """Walk from ``node`` back through head-local ops, RoPE and per-head norms to the product that feeds it;
    returns (product, the walked nodes) or (None, ...) when the chain holds anything else."""
    walked = []
    while isinstance(node, Node):
        product = product_of(node)
        if product is not None:
            return product, walked
        walked.append(node)
        if node.op != "call_function":
            return None, walked
        if node.target in _HEAD_LOCAL:
            node = node.args[0]
        elif node.target is operator.getitem and is_call(node.args[0], _ROPE):
            node = node.args[0].args[node.args[1]]  # q or k of the rope
        elif node.target in _NORMS:
            x = node_val(node.args[0])
            params = [node_val(p) for p in node.args[1:3] if isinstance(p, Node)]  # weight (, bias)
            if x is None or any(p is None or p.numel() != x.shape[-1] for p in params) or not stop(x):
                return None, walked  # a norm over more than one head does not split by heads
            node = node.args[0]
        else:
            return None, walked
    return None, walked


def _chain_forward(node: Node) -> tuple[Product | None, list[Node]]:
    """From the attention output forward through single-user head-local ops to the product it feeds."""
    walked = []
    while len(node.users) == 1:
        (user,) = node.users
        product = product_of(user)
        if product is not None:
            return (product if product.input is node else None), walked
        if user.op != "call_function" or user.target not in _HEAD_LOCAL:
            return None, walked
        walked.append(user)
        node = user
    return None, walked


def _head_views(nodes: list[Node], full: int, local: int) -> dict[str, tuple[int, int]]:
    """The views of a chain whose shape argument holds a literal head count (-1 needs no rewrite)."""
    views = {}
    for node in nodes:
        if node.target in _RESHAPES and isinstance(node.args[1], (list, tuple)) and full in node.args[1]:
            views[node.name] = (full, local)
    return views


def _attention_region(attn: Node, rank: int, world: int, claimed: set) -> Region | str:
    """The attention region of one ``torch_attention`` node, or the reason it is left replicated."""
    args = op_args(attn)
    qkv = [args["query"], args["key"], args["value"]]
    q_val, k_val, v_val = (node_val(a) for a in qkv)
    layout = args["layout"]
    if q_val is None or k_val is None or v_val is None or layout != "bsnd":
        return "no bsnd shapes"
    n_heads, n_kv = static_int(q_val.shape[-2]), static_int(k_val.shape[-2])
    head_dim, v_dim = static_int(q_val.shape[-1]), static_int(v_val.shape[-1])
    if None in (n_heads, n_kv, head_dim, v_dim) or n_heads % world:
        return f"{n_heads} heads do not divide by {world}"
    if n_kv % world and world % n_kv:
        return f"{n_kv} kv heads and {world} ranks: neither divides the other"
    per_head = lambda val: static_int(val.shape[-1]) in (head_dim, v_dim)  # noqa: E731
    chains = [_chain_back(a, per_head) for a in qkv]
    out_product, out_walk = _chain_forward(attn)
    products = [p for p, _ in chains] + [out_product]
    if any(p is None for p in products):
        return "its q/k/v/o products are not a plain chain (fused or unusual layout)"
    if any(p.node in claimed for p in products) or len({p.node for p in products}) != 4:
        return "its products are shared"
    if any(len(p.node.users) != 1 for p in products[:3]):
        return "a q/k/v product's output is also used elsewhere"
    q0, q1 = _even(n_heads, rank, world)
    if n_kv % world == 0:
        kv0, kv1 = _even(n_kv, rank, world)
    else:  # more ranks than kv heads: the kv head of this rank's query heads, replicated
        kv0 = q0 // (n_heads // n_kv)
        kv1 = kv0 + 1
    q, k, v, o = products
    region = Region("attention", [
        Split(q.node.name, "colwise", q0 * head_dim, q1 * head_dim, role="opener"),
        Split(k.node.name, "colwise", kv0 * head_dim, kv1 * head_dim, role="opener"),
        Split(v.node.name, "colwise", kv0 * v_dim, kv1 * v_dim, role="opener"),
        Split(o.node.name, "rowwise", q0 * v_dim, q1 * v_dim, role="closer"),
    ])
    walked_q, walked_kv = chains[0][1] + out_walk, chains[1][1] + chains[2][1]
    region.views.update(_head_views(walked_q, n_heads, q1 - q0))
    region.views.update(_head_views(walked_q, n_heads * v_dim, (q1 - q0) * v_dim))
    region.views.update(_head_views(walked_kv, n_kv, kv1 - kv0))
    if args.get("alibi_slopes") is not None:  # computed in the graph for all heads: would need a slice per rank
        return "its ALiBi slopes are not split per rank (the attention stays whole)"
    sinks = args["sinks"]
    if sinks is not None:
        if not (isinstance(sinks, Node) and sinks.op == "get_attr"):
            return "its sinks are computed, not a weight"
        region.sinks = (sinks.name, q0, q1)
    return region


def _mlp_region(closer: Product, rank: int, world: int, claimed: set) -> Region | None:
    """The mlp region closed by ``closer``: openers sharing an input, elementwise ops in between."""
    openers: dict[Node, Product] = {}
    inside: set[Node] = set()
    stack = [closer.input]
    while stack:
        node = stack.pop()
        if not isinstance(node, Node) or node in inside:
            continue
        product = product_of(node)
        if product is not None:
            openers[node] = product
            inside.add(node)
            continue
        if node.op != "call_function" or node.target not in _ELEMENTWISE:
            return None
        inside.add(node)
        tensors = [a for a in node.args if isinstance(a, Node)]
        if any(node_val(t) is None or tuple(node_val(t).shape) != tuple(node_val(node).shape) for t in tensors):
            return None  # broadcasting against something outside the region would not split by columns
        stack.extend(tensors)
    if not openers or any(n in claimed for n in openers) or closer.node in claimed:
        return None
    if any(u not in inside and u is not closer.node for n in inside for u in n.users):
        return None  # an intermediate value is used outside the region
    if len({p.input for p in openers.values()}) != 1:
        return None
    widths = {static_int(node_val(n).shape[-1]) for n in openers}
    width = widths.pop() if len(widths) == 1 else None
    if width is None or width % world:
        return None
    start, end = _even(width, rank, world)
    splits = [Split(n.name, "colwise", start, end, role="opener") for n in openers]
    return Region("mlp", splits + [Split(closer.node.name, "rowwise", start, end, role="closer")])


def _moe_region(node: Node, rank: int, world: int) -> Region | None:
    gate_up, down = node.args[3], node.args[4]
    if not all(isinstance(w, Node) and w.op == "get_attr" for w in (gate_up, down)):
        return None
    experts = static_int(node_val(gate_up).shape[0])
    share = experts // world
    start = rank * share
    end = experts if rank == world - 1 else start + share  # the remainder to the last rank
    return Region("moe", moe=(node.name, start, end))


def _bmm_region(node: Node, rank: int, world: int) -> Region | None:
    weight = node.args[1]
    batch = static_int(node_val(node).shape[0]) if node_val(node) is not None else None
    if not (isinstance(weight, Node) and weight.op == "get_attr") or batch is None or batch % world:
        return None
    start, end = _even(batch, rank, world)
    return Region("bmm", [Split(node.name, "gather", start, end)])


# -- plans by module name (manual, factory) ------------------------------------------------------------
def _module_of(product: Product) -> str | None:
    weight = product.weight
    return weight.target.rsplit(".", 1)[0] if isinstance(weight, Node) and weight.op == "get_attr" else None


def _matches(pattern: str, module: str) -> bool:
    """HF plan patterns match a module path's tail, '*' standing for one name."""
    want, have = pattern.split("."), module.split(".")
    return len(have) >= len(want) and all(fnmatch.fnmatchcase(h, w) for h, w in zip(have[-len(want):], want))


def _plan_styles(gm: GraphModule, plan: dict[str, str], source: str, strict: bool) -> dict[Node, str]:
    """product node -> style for the plan's patterns. ``strict`` (a user's plan): a pattern that names no
    product is an error listing the nearest module names; a model's own plan may name modules the canonical
    graph no longer has as products (experts, norms) and styles handled elsewhere, which are skipped."""
    products = {p.node: _module_of(p) for p in map(product_of, gm.graph.nodes)
                if p is not None and p.kind.row_major and _module_of(p)}
    styles: dict[Node, str] = {}
    for pattern, style in plan.items():
        if style not in ("colwise", "rowwise", "gather"):
            continue
        hits = [node for node, module in products.items() if _matches(pattern, module)]
        if not hits and strict:
            import difflib

            names = sorted(set(products.values()))
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
            raise ConfigError(f"{source}: tp_plan pattern {pattern!r} names no product of the graph; nearest: "
                              + ", ".join(close or names[:3]))
        for node in hits:
            styles.setdefault(node, style)
    return styles


# -- detect_sharding ------------------------------------------------------------------------------------
def detect(gm: GraphModule, config: DetectShardingConfig, rank: int, world: int,
           factory_plan: dict | None) -> ShardingPlan:
    plan = ShardingPlan(rank, world)
    claimed: set[Node] = set()
    # products packed in tiles of rows (int4_packed_linear) cannot be split by rows: left replicated
    products = [p for p in map(product_of, gm.graph.nodes) if p is not None and p.kind.row_major]

    if config.simple_shard_only:
        for p in products:
            width = static_int(node_val(p.node).shape[-1]) if node_val(p.node) is not None else None
            if width and width % world == 0:
                plan.regions.append(Region("product", [Split(p.node.name, "gather", *_even(width, rank, world))]))
            else:
                plan.replicated["product"] += 1
        return plan

    styles: dict[Node, str] = {}
    for source in config.sharding_source:
        if source == "manual" and config.manual_config.tp_plan:
            styles = {**_plan_styles(gm, config.manual_config.tp_plan, "transforms.detect_sharding.manual_config",
                                     strict=True), **styles}
        elif source == "factory" and factory_plan:
            styles = {**_plan_styles(gm, factory_plan, "base_model_tp_plan", strict=False), **styles}
        if styles and not config.support_partial_config:
            break
    heuristic = "heuristic" in config.sharding_source and (config.support_partial_config or not styles)

    gm_nodes = {n.name: n for n in gm.graph.nodes}

    def agrees(region: Region) -> bool:
        """A region the plans leave alone, or whose roles they give exactly."""
        named = [styles.get(gm_nodes[s.node]) for s in region.splits]
        if not any(named):
            return heuristic
        return all(n == ("colwise" if s.role == "opener" else "rowwise") for n, s in zip(named, region.splits))

    if "tp" in config.sharding_dims:
        for attn in gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_attention.default):
            region = _attention_region(attn, rank, world, claimed)
            if isinstance(region, Region) and agrees(region):
                plan.regions.append(region)
                claimed |= {gm_nodes[s.node] for s in region.splits}
            else:
                plan.replicated["attention"] += 1
                if isinstance(region, str):
                    ad_logger.debug(f"{attn.name} stays replicated: {region}")
        for p in products:
            if p.node in claimed:
                continue
            region = _mlp_region(p, rank, world, claimed)
            if region is not None and agrees(region):
                plan.regions.append(region)
                claimed |= {gm_nodes[s.node] for s in region.splits}
    if "ep" in config.sharding_dims:
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_moe.default):
            region = _moe_region(node, rank, world)
            if region is not None:
                plan.regions.append(region)
            else:
                plan.replicated["moe"] += 1
    if "bmm" in config.sharding_dims:
        for node in gm.graph.find_nodes(op="call_function", target=aten.bmm.default):
            region = _bmm_region(node, rank, world)
            if region is not None:
                plan.regions.append(region)
    for node, style in styles.items():  # what a plan names outside any region: split on its own
        if node in claimed:
            continue
        val = node_val(node)
        size = static_int(val.shape[-1] if style != "rowwise" else node_val(product_of(node).input).shape[-1])
        if size and size % world == 0:
            plan.regions.append(Region("product", [Split(node.name, style, *_even(size, rank, world))]))
        else:
            plan.replicated["product"] += 1
    return plan


@TransformRegistry.register("detect_sharding")
class DetectSharding(BaseTransform):
    """Decide how the graph splits for ``world_size`` ranks (see the module docstring)."""

    config: DetectShardingConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        if ctx.world_size == 1:
            return gm, TransformInfo.unchanged()
        config = ctx.text_config()
        factory_plan = getattr(config, "base_model_tp_plan", None) if config is not None else None
        plan = detect(gm, self.config, ctx.rank, ctx.world_size, factory_plan)
        if not plan.regions:
            raise ConfigError(f"world_size={ctx.world_size}: nothing in this model splits into {ctx.world_size} "
                              f"({plan.summary()}); choose a world_size that divides its heads or MLP width")
        ctx.extras[SHARDING_KEY] = plan
        ad_logger.info(f"{ctx.world_size} ranks: {plan.summary()}")
        return gm, TransformInfo(skipped=False, num_matches=len(plan.regions), is_clean=True, has_valid_shapes=True)


# -- sharding_transform_executor -------------------------------------------------------------------------
def _slice_param(gm: GraphModule, node: Node, dim: int, start: int, end: int, slices: dict) -> None:
    """Give the parameter ``node`` reads its local shape (meta) and record the slice to load."""
    tensor = get_attr_tensor(gm, node.target)
    if tensor.is_meta:
        shape = list(tensor.shape)
        shape[dim] = end - start
        assign_tensor(gm, node.target, torch.empty(shape, dtype=tensor.dtype, device="meta"))
    else:  # weights already loaded: keep the slice now
        assign_tensor(gm, node.target, tensor.narrow(dim, start, end - start).contiguous())
    slices[node.target] = (dim, start, end)


def _collective_after(gm: GraphModule, node: Node, op, *args) -> Node:
    with gm.graph.inserting_after(node):
        out = gm.graph.call_function(op, (node, *args))
    node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
    return out


def _apply_split(gm: GraphModule, nodes: dict[str, Node], split: Split, slices: dict) -> None:
    node = nodes[split.node]
    product = product_of(node)
    if product is None:  # a bmm: this rank's batch entries, gathered after
        with gm.graph.inserting_before(node):
            x = gm.graph.call_function(aten.slice.Tensor, (node.args[0], 0, split.start, split.end))
        node.replace_input_with(node.args[0], x)
        _slice_param(gm, node.args[1], 0, split.start, split.end, slices)
        _collective_after(gm, node, torch.ops.auto_deploy.torch_dist_all_gather.default, 0)
        return
    if split.style != "rowwise":  # output rows: the per-row tensors and the bias
        for row in product.row_tensors:
            _slice_param(gm, row, 0, split.start, split.end, slices)
        if product.bias is not None:
            _slice_param(gm, product.bias, 0, split.start, split.end, slices)
        if split.role != "opener":
            _collective_after(gm, node, torch.ops.auto_deploy.torch_dist_all_gather.default, -1)
        return
    _slice_param(gm, product.weight, 1, split.start, split.end, slices)  # input columns
    bias = product.bias
    node = product.replace(bias=None)
    if split.role == "lone":  # a replicated input: take this rank's columns of it
        with gm.graph.inserting_before(node):
            x = gm.graph.call_function(aten.slice.Tensor, (product.input, -1, split.start, split.end))
        node.replace_input_with(product.input, x)
    out = _collective_after(gm, node, torch.ops.auto_deploy.torch_dist_all_reduce.default)
    if bias is not None:  # added once, after the sum
        with gm.graph.inserting_after(out):
            biased = gm.graph.call_function(aten.add.Tensor, (out, bias))
        out.replace_all_uses_with(biased, delete_user_cb=lambda user: user is not biased)


def _apply_moe(gm: GraphModule, nodes: dict[str, Node], name: str, start: int, end: int, slices: dict) -> None:
    node = nodes[name]
    selected, gate_up, down = node.args[1], node.args[3], node.args[4]
    _slice_param(gm, gate_up, 0, start, end, slices)
    _slice_param(gm, down, 0, start, end, slices)
    local = end - start
    graph = gm.graph
    with graph.inserting_before(node):
        shifted = graph.call_function(aten.sub.Tensor, (selected, start))
        inside = graph.call_function(aten.bitwise_and.Tensor, (graph.call_function(aten.ge.Scalar, (shifted, 0)),
                                                               graph.call_function(aten.lt.Scalar, (shifted, local))))
        routed = graph.call_function(aten.where.ScalarOther, (inside, shifted, local))  # others: the sentinel
    node.replace_input_with(selected, routed)
    _collective_after(gm, node, torch.ops.auto_deploy.torch_dist_all_reduce.default)


def _rewrite_views(nodes: dict[str, Node], views: dict[str, tuple[int, int]]) -> None:
    for name, (full, local) in views.items():
        node = nodes[name]
        shape = [local if size == full else size for size in node.args[1]]
        node.update_arg(1, shape)


@TransformRegistry.register("sharding_transform_executor")
class ShardingTransformExecutor(BaseTransform):
    """Apply ``detect_sharding``'s decisions to this rank's graph (see the module docstring)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        plan: ShardingPlan | None = ctx.extras.get(SHARDING_KEY)
        if ctx.world_size == 1 or plan is None or not plan.regions:
            return gm, TransformInfo.unchanged()
        nodes = {n.name: n for n in gm.graph.nodes}
        slices: dict[str, tuple[int, int, int]] = {}
        for region in plan.regions:
            for split in region.splits:
                _apply_split(gm, nodes, split, slices)
            if region.moe is not None:
                _apply_moe(gm, nodes, *region.moe, slices)
            _rewrite_views(nodes, region.views)
            if region.sinks is not None:
                name, start, end = region.sinks
                _slice_param(gm, nodes[name], 0, start, end, slices)
        gm.meta[SHARDING_KEY] = {"rank": plan.rank, "world_size": plan.world_size, "slices": slices}
        collectives = sum(1 for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(
            "auto_deploy.torch_dist_"))
        ad_logger.info(f"rank {plan.rank}: {len(slices)} parameter slices, {collectives} collectives")
        return gm, TransformInfo.changed(len(plan.regions))

