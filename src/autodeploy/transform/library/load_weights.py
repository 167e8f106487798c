"""weight_load stage: load the checkpoint into the graph module and move it to the device.

A graph split by the sharding stage (``gm.meta["sharding"]["slices"]``: parameter -> (dim, start, end))
keeps only this rank's slice of each split tensor; the checkpoint stays memory-mapped while it is read, so
a rank's resident weights are its slices plus what stays replicated (copied out of the map at the end).

A 16-bit (bf16/fp16) checkpoint loaded into a float32 graph (``dtype: float32``) while ``quantize_weights``
is enabled (its note in ``ctx.extras``): the checkpoint is read in its own dtype; the linear weights that
transform will replace (the weights read only by dense products, not excluded by its ``exclude``) stay as
they are stored, their products becoming ``auto_deploy::half_linear`` (float32 arithmetic); every other
tensor is upcast to the graph's dtype. So no float32 copy of the linear weights exists at any point."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.fx import GraphModule

from ...custom_ops.half_linear import HALF_DTYPES, HALF_LINEAR
from ...errors import AutoDeployError, CheckpointError
from ...export.export import assign_tensor
from ...utils.fx import (
    copy_out_cpu_tensors,
    get_attr_tensor,
    graph_tensors,
    named_graphmodules,
    read_as_embedding_table_only,
    replace_device_args,
    run_shape_prop,
)
from ...utils.logger import ad_logger
from ...utils.memory import advise_random_access
from ...utils.products import product_of
from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry
from .quantize import KEEP_16BIT_WEIGHTS


def _move_placeholder_values(gm: GraphModule, device: torch.device) -> None:
    """Re-create the placeholders' fake values on ``device`` (same symbolic shapes), so that shape
    propagation after loading sees inputs on the same device as the weights."""
    from torch._guards import detect_fake_mode

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    values = [n.meta.get("val") for n in placeholders]
    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return
    with fake_mode:
        for node, val in zip(placeholders, values):
            if isinstance(val, torch.Tensor) and val.device != device:
                node.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device)


def _meta_attributes(gm: GraphModule) -> list[str]:
    """Tensors the graph reads (get_attr) that are still on the meta device."""
    left = []
    for node in gm.graph.find_nodes(op="get_attr"):
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor) and value.is_meta:
            left.append(node.target)
    return left


def _refresh_shapes(gms) -> bool:
    """Re-propagate shapes on the device; a model whose ops fake tensors cannot follow on this device
    keeps running (a later transform that needs shapes will say so)."""
    try:
        for _, gm in gms:
            run_shape_prop(gm)  # node.meta["val"] now describes tensors on the device
    except Exception as exc:  # noqa: BLE001 - shape metadata is optional for running the graph
        ad_logger.warning(f"shape propagation after loading failed ({type(exc).__name__}); node shapes are stale")
        return False
    return True


def _advise_embedding_tables(gm: GraphModule) -> int:
    """Mark the tables read only by embedding lookups as read at random (their checkpoint pages then come
    in a row at a time, not a read-ahead window per row); returns how many were marked."""
    tables: dict[int, torch.Tensor] = {}
    read_whole: set[int] = set()  # a tied table is read whole by its LM head anyway
    for node in gm.graph.find_nodes(op="get_attr"):
        tensor = get_attr_tensor(gm, node.target)
        if not isinstance(tensor, torch.Tensor):
            continue
        if read_as_embedding_table_only(node):
            tables[tensor.data_ptr()] = tensor
        else:
            read_whole.add(tensor.data_ptr())
    return sum(advise_random_access(t) for ptr, t in tables.items() if ptr not in read_whole)


def _half_linear_weights(gm: GraphModule, exclude: list[str]) -> set[str]:
    """The names of the weights read only by dense products (as their weight), once each, not matching
    ``exclude``: what ``quantize_weights`` replaces."""
    reads: dict[str, int] = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        reads[node.target] = reads.get(node.target, 0) + 1
    names = set()
    for node in gm.graph.find_nodes(op="get_attr"):
        products = [product_of(user) for user in node.users]
        if (reads[node.target] == 1 and products and all(p is not None and p.kind.dense and p.weight is node
                                                             and p.input is not node for p in products)
                and not any(fnmatch.fnmatch(node.target, pattern) for pattern in exclude)):
            names.add(node.target)
    tensors = graph_tensors(gm)
    tied: dict[int, int] = {}  # one tensor under several names (tied weights) is left to the graph's dtype
    for t in tensors.values():
        tied[id(t)] = tied.get(id(t), 0) + 1
    return {name for name in names if name in tensors and tied[id(tensors[name])] == 1}


def _to_half_linear(gm: GraphModule, names: set[str]) -> int:
    """The dense products over the weights ``names`` -> ``half_linear``; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        product = product_of(node)
        if product is not None and product.kind.dense and getattr(product.weight, "target", None) in names:
            if product.kind is not HALF_LINEAR:
                product.replace(HALF_LINEAR)
                count += 1
    gm.recompile()
    return count


@TransformRegistry.register("load_weights")
class LoadWeights(BaseTransform):
    """Loads every parameter and buffer from the checkpoint (one copy: the graph takes the tensors)."""

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        gms = list(named_graphmodules(mod))
        if not gms:
            raise AutoDeployError("load_weights needs an exported graph; run the export stage first")
        if ctx.factory is None:
            raise AutoDeployError("load_weights needs a model factory (a checkpoint to load)")
        device = torch.device(ctx.device)
        exclude = ctx.extras.get(KEEP_16BIT_WEIGHTS)
        stored = getattr(ctx.factory, "checkpoint_dtype", None)
        keep_16bit = (exclude is not None and stored in HALF_DTYPES
                      and getattr(ctx.factory, "dtype", None) == torch.float32)
        state = ctx.factory.load_state(device, dtype=stored) if keep_16bit else ctx.factory.load_state(device)
        loaded, kept = 0, 0
        for _, gm in gms:
            slices = gm.meta.get("sharding", {}).get("slices", {})
            half_names = _half_linear_weights(gm, exclude) if keep_16bit else set()
            for name, current in graph_tensors(gm).items():
                tensor = state.get(name)
                if tensor is None:
                    continue
                if name in slices:
                    dim, start, end = slices[name]
                    tensor = tensor.narrow(dim, start, end - start).contiguous()  # this rank's share only
                if keep_16bit and tensor.is_floating_point() and tensor.dtype != current.dtype:
                    if name in half_names:
                        kept += 1
                    else:
                        tensor = tensor.to(current.dtype)  # norms, embedding, biases: the graph's dtype
                if tuple(tensor.shape) != tuple(current.shape):
                    raise CheckpointError(
                        f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the graph expects {tuple(current.shape)}"
                    )
                assign_tensor(gm, name, tensor)
                loaded += 1
            if keep_16bit:
                _to_half_linear(gm, {n for n in half_names if get_attr_tensor(gm, n).dtype in HALF_DTYPES})
            replace_device_args(gm, torch.device("meta"), device)
            missing = _meta_attributes(gm)
            if missing:
                raise CheckpointError(f"no weights were loaded for graph tensor(s): {', '.join(missing)}")
            _move_placeholder_values(gm, device)
            _advise_embedding_tables(gm)
            if slices:  # the replicated rest out of the checkpoint's mapping, so the whole file can go
                copy_out_cpu_tensors(gm, keep={get_attr_tensor(gm, name).data_ptr() for name in slices})
        shapes_valid = _refresh_shapes(gms)
        del state  # the graph now holds the only references
        ad_logger.info(f"loaded {loaded} tensors to {device}" + (
            f"; {kept} linear weight(s) kept in the checkpoint's {str(stored).removeprefix('torch.')} "
            "(auto_deploy::half_linear), the rest upcast" if keep_16bit else ""))
        return mod, TransformInfo(skipped=False, num_matches=loaded, is_clean=True, has_valid_shapes=shapes_valid)
