"""post_load_fusion stage: ``quantize_weights``, weight-only quantization of the linear layers.

``dtype`` picks the weights' format (every format multiplies in float32 and returns the activations' dtype):

- ``int8``: ``auto_deploy::torch_int8_linear``, per-output-channel symmetric int8 with bf16 scales
  (:mod:`autodeploy.custom_ops.quant_linear`); a quarter of fp32's weight bytes.
- ``bf16`` / ``fp16``: ``auto_deploy::half_linear`` over the weight rounded to 16 bits
  (:mod:`autodeploy.custom_ops.half_linear`); half of fp32's bytes. Weights already in that dtype (a bf16
  checkpoint) are wrapped as they are, not copied.
- ``int4``: ``auto_deploy::int4_linear``, two weights per byte with one bf16 scale per ``group_size``
  elements of a row (:mod:`autodeploy.custom_ops.int4_linear`); 4.5 bits per weight at group size 32.
  Linears whose in-features are not a multiple of ``group_size`` stay as they are (logged at debug level).

Every dense product (a product-op registry entry with a plain float weight: ``aten.linear``,
``auto_deploy::f32_linear``, ``auto_deploy::half_linear``) whose weight is a ``get_attr`` read by products
only is rewritten over the new weight tensors; the original is deleted, so the weights shrink. Activations
keep their dtype between layers (norms, attention and residuals stay in fp32 in an fp32 graph). Weights that
are read by anything else (an embedding tied to the LM head) and names matching ``exclude`` stay as they
are, where they were loaded: a memory-mapped checkpoint's pages of each replaced weight are released as it
goes (``utils.memory.FilePageReleaser``), so only the pages the remaining weights touch stay resident (an
embedding's gathered rows), and no second copy of them exists at any point.

A 16-bit checkpoint built as a float32 graph (``dtype: float32``): with this transform enabled,
``load_weights`` keeps the linear weights it will replace in the checkpoint's dtype (as ``half_linear``
products) instead of upcasting them, so no float32 copy of them exists at any point; the other weights
(norms, embedding) are upcast. ``dtype: bf16`` then leaves a bf16 checkpoint's linears as they are; int8
and int4 quantize from the bf16 values (the same result as from their exact float32 upcast).

Off by default: it trades accuracy for speed. docs/performance.md lists the measured logit error against
fp32 and the speed-up; ``benchmarks/weight_precision.py`` measures both on any checkpoint.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch.fx import GraphModule

from ...custom_ops.half_linear import HALF_LINEAR
from ...custom_ops.int4_linear import GROUP_SIZES, INT4_LINEAR, quantize_int4
from ...custom_ops.quant_linear import INT8_LINEAR, quantize_per_channel_int8
from ...utils.fx import get_attr_tensor, swap_attr_tensors, tensor_name_counts
from ...utils.logger import ad_logger
from ...utils.memory import FilePageReleaser
from ...utils.products import ProductOp, product_of
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten

#: ``ctx.extras`` key: set (to the ``exclude`` patterns) before the pipeline runs when this transform is
#: enabled, so ``load_weights`` may keep a 16-bit checkpoint's linear weights as they are stored
KEEP_16BIT_WEIGHTS = "quantize_weights.keep_16bit_linear_weights"

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
_LABELS = {"int8": "int8 weight-only (auto_deploy::torch_int8_linear)",
           "bf16": "bf16 weights (auto_deploy::half_linear)", "fp16": "fp16 weights (auto_deploy::half_linear)",
           "int4": "int4 weight-only (auto_deploy::int4_linear, group size {g})"}


class QuantizeWeightsConfig(GraphRewriteConfig):
    dtype: Literal["int8", "bf16", "fp16", "int4"] = Field(
        default="int8",
        description="Weight dtype: int8 (per-channel symmetric), bf16 / fp16 (16-bit weights, fp32 arithmetic), "
                    "int4 (group-wise symmetric, one bf16 scale per group_size elements).")
    group_size: int = Field(
        default=32, description=f"int4 only: elements per scale, one of {', '.join(map(str, GROUP_SIZES))}.")
    exclude: list[str] = Field(
        default_factory=list, description="fnmatch patterns of weight names to keep unquantized, e.g. 'lm_head*'."
    )
    expect_mem_change: bool = True

    @field_validator("dtype", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        return _ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_size(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int) or value not in GROUP_SIZES:
            raise ValueError(f"must be one of {', '.join(map(str, GROUP_SIZES))} (elements per int4 scale)")
        return value


def _convert(weight: torch.Tensor, dtype: str, group_size: int
             ) -> tuple[ProductOp, list[tuple[str, torch.Tensor]], dict[str, Any]] | str:
    """The product op, its new row tensors (name suffix, tensor) and static arguments for ``weight`` in
    ``dtype``; or why it stays as it is."""
    if dtype == "int8":
        q, scale = quantize_per_channel_int8(weight)
        return INT8_LINEAR, [("int8", q), ("scale", scale)], {}
    if dtype in _HALF:
        half = weight.detach() if weight.dtype == _HALF[dtype] else weight.detach().to(_HALF[dtype])
        return HALF_LINEAR, [(dtype, half)], {}
    k = weight.shape[1]
    if k % group_size or k % 2:
        return f"in-features {k} not a multiple of group_size {group_size}"
    q, scale = quantize_int4(weight, group_size)
    return INT4_LINEAR, [("int4", q), ("scale", scale)], {"group_size": group_size}


@TransformRegistry.register("quantize_weights")
class QuantizeWeights(BaseTransform):
    """Linears -> int8 / 16-bit / int4 weight-only linears (see the module docstring)."""

    config: QuantizeWeightsConfig

    def prepare(self, ctx: PipelineContext) -> None:
        ctx.extras[KEEP_16BIT_WEIGHTS] = list(self.config.exclude)

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        graph = gm.graph
        dtype, group_size = self.config.dtype, self.config.group_size
        names_of = tensor_name_counts(gm)  # tensors with several names (tied weights) are left alone
        by_weight: dict = {}
        for node in graph.nodes:
            product = product_of(node)
            if product is not None and product.kind.dense and getattr(product.weight, "op", None) == "get_attr":
                by_weight.setdefault(product.weight, []).append(product)
        count, already, saved, released, skipped = 0, 0, 0, 0, []
        releaser = FilePageReleaser([*gm.parameters(), *gm.buffers()])
        for weight_node, linears in by_weight.items():
            name = weight_node.target
            weight = get_attr_tensor(gm, name)
            if len(weight_node.users) != len(linears) or names_of.get(weight.data_ptr(), 0) != 1:
                skipped.append(f"{name} (shared)")
                continue
            if any(fnmatch.fnmatch(name, pattern) for pattern in self.config.exclude):
                skipped.append(f"{name} (excluded)")
                continue
            if weight.dim() != 2 or not weight.is_floating_point() or weight.is_meta:
                continue
            if dtype in _HALF and weight.dtype == _HALF[dtype] and all(p.kind is HALF_LINEAR for p in linears):
                already += len(linears)  # a 16-bit checkpoint's weight, kept as it is by load_weights
                continue
            made = _convert(weight, dtype, group_size)
            if isinstance(made, str):
                ad_logger.debug(f"left as it is: {name} ({made})")
                skipped.append(f"{name} (in-features)")
                continue
            op, tensors, static = made
            reused = any(t.data_ptr() == weight.data_ptr() for _, t in tensors)  # wrapped as it is
            saved += weight.numel() * weight.element_size() - (
                0 if reused else sum(t.numel() * t.element_size() for _, t in tensors))
            if not reused:
                released += releaser.release(weight)  # its checkpoint pages need not stay resident till the end
            base = name.replace(".", "_")
            row_nodes = swap_attr_tensors(gm, [name], [(f"{base}_{suffix}", t) for suffix, t in tensors], weight_node)
            for product in linears:
                product.replace(op, row_tensors=row_nodes, static=static)
                count += 1
            graph.erase_node(weight_node)
        if skipped:
            ad_logger.info(f"left unquantized: {', '.join(skipped)}")
        if already:
            ad_logger.info(f"{already} linear(s) already {dtype} (the checkpoint's weights, kept by load_weights)")
        if count:
            ad_logger.info(f"{count} linear(s) -> {_LABELS[dtype].format(g=group_size)}, "
                           f"{saved / 2**20:.1f} MiB of weights freed"
                           + (f" ({released / 2**20:.1f} MiB of memory-mapped checkpoint pages released as they "
                              "were replaced)" if released else ""))
        return gm, TransformInfo.changed(count)
