"""post_load_fusion stage: ``quantize_weights``, weight-only int8 quantization of the linear layers.

Every dense product (a product-op registry entry with a plain float weight: ``aten.linear``,
``auto_deploy::f32_linear``) whose weight is a ``get_attr`` read by products only becomes
``auto_deploy::torch_int8_linear`` over an int8 copy of the weight (per-output-channel symmetric scales,
:mod:`autodeploy.custom_ops.quant_linear`); the fp32/bf16 original is deleted, so the weights shrink to a
quarter (fp32) or half (bf16). Activations keep their dtype between layers. Weights that are read by
anything else (an embedding tied to the LM head) and names matching ``exclude`` stay as they are, copied
out of the loaded storage: weights loaded from a memory-mapped checkpoint keep the whole file mapped while
any of them lives.

Off by default: it trades accuracy for speed. docs/performance.md lists the measured logit error against
fp32 and the speed-up; ``benchmarks/weight_precision.py`` measures both on any checkpoint.
"""

from __future__ import annotations

import fnmatch
from typing import Literal

import torch
from pydantic import Field
from torch.fx import GraphModule

from ...custom_ops.quant_linear import INT8_LINEAR, quantize_per_channel_int8
from ...utils.fx import copy_out_cpu_tensors, delete_attr_tensor, get_attr_tensor, tensor_name_counts
from ...utils.logger import ad_logger
from ...utils.memory import FilePageReleaser
from ...utils.products import product_of
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten


class QuantizeWeightsConfig(GraphRewriteConfig):
    dtype: Literal["int8"] = Field(default="int8", description="Weight dtype (int8: per-channel symmetric).")
    exclude: list[str] = Field(
        default_factory=list, description="fnmatch patterns of weight names to keep unquantized, e.g. 'lm_head*'."
    )
    expect_mem_change: bool = True


@TransformRegistry.register("quantize_weights")
class QuantizeWeights(BaseTransform):
    """Linears -> int8 weight-only linears (see the module docstring)."""

    config: QuantizeWeightsConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        graph = gm.graph
        names_of = tensor_name_counts(gm)  # tensors with several names (tied weights) are left alone
        by_weight: dict = {}
        for node in graph.nodes:
            product = product_of(node)
            if product is not None and product.kind.dense and getattr(product.weight, "op", None) == "get_attr":
                by_weight.setdefault(product.weight, []).append(product)
        count, saved, released, skipped = 0, 0, 0, []
        new_tensors: set[int] = set()
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
            q, scale = quantize_per_channel_int8(weight)
            saved += weight.numel() * weight.element_size() - q.numel() - scale.numel() * scale.element_size()
            released += releaser.release(weight)  # its checkpoint pages need not stay resident till the end
            base = name.replace(".", "_")
            delete_attr_tensor(gm, name)
            gm.register_buffer(f"{base}_int8", q)
            gm.register_buffer(f"{base}_scale", scale)
            new_tensors |= {q.data_ptr(), scale.data_ptr()}
            with graph.inserting_before(weight_node):
                q_node, scale_node = graph.get_attr(f"{base}_int8"), graph.get_attr(f"{base}_scale")
            for product in linears:
                product.replace(INT8_LINEAR, row_tensors=[q_node, scale_node])
                count += 1
            graph.erase_node(weight_node)
        if skipped:
            ad_logger.info(f"left unquantized: {', '.join(skipped)}")
        if count:
            ad_logger.info(f"{count} linear(s) -> int8 weight-only, {saved / 2**20:.1f} MiB of weights freed"
                           + (f" ({released / 2**20:.1f} MiB of memory-mapped checkpoint pages released as they "
                              "were replaced)" if released else ""))
            # the weights left (embedding, norms) may live in the checkpoint's memory map, which would keep
            # the whole fp32 file resident: copy them out so it goes
            copied = copy_out_cpu_tensors(gm, keep=new_tensors)
            ad_logger.info(f"remaining weights copied out of the loaded storage: {copied / 2**20:.1f} MiB")
        return gm, TransformInfo.changed(count)
