"""export stage: torch.export the model to a GraphModule."""

from __future__ import annotations

from typing import List, Optional

from pydantic import Field
from torch import nn

from ...errors import AutoDeployError
from ...export import torch_export_to_gm
from ...utils.fx import has_graphmodule
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry


class ExportToGMConfig(TransformConfig):
    """Configuration for the export to graph module transform."""

    strict: bool = Field(
        default=False,
        description="Whether to export in strict mode. NOTE: we generally export in non-strict mode"
        "for now as it relaxes some assumptions around tracing. Strict mode uses torchdynamo"
        "(symbolic bytecode analysis), which can be brittle since it relies on the exact bytecode"
        "representation of the model see here as well: https://pytorch.org/docs/stable/export.html#non-strict-export",
    )
    clone_state_dict: bool = Field(
        default=False,
        description="Whether to clone the state_dict of the model. This is useful to avoid"
        "modifying the original state_dict of the model.",
    )
    patch_list: Optional[List[str]] = Field(
        default=None,
        description="List of patch names to apply with export. Default is to apply all registered patches.",
    )
    num_moe_experts_for_export: Optional[int] = Field(
        default=None,
        description="If set, only this many MOE experts are traced during torch.export, and the graph is "
        "expanded to include all experts afterwards. This can dramatically speed up export for large MOE "
        "models (e.g. 256 experts). Recommended value: 2.",
    )


@TransformRegistry.register("export_to_gm")
class ExportToGM(BaseTransform):
    """A simple wrapper transform to export a model to a graph module."""

    config: ExportToGMConfig

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        if has_graphmodule(mod):
            raise AutoDeployError("export_to_gm: the model is already exported")
        if not any(True for _ in mod.parameters()):
            raise AutoDeployError("export_to_gm: there is no model to export; run the factory stage first")
        if self.config.num_moe_experts_for_export is not None and self.config.num_moe_experts_for_export < 1:
            raise AutoDeployError("transforms.export_to_gm.num_moe_experts_for_export must be >= 1")
        gm = torch_export_to_gm(
            mod,
            max_batch_size=ctx.max_batch_size,
            max_seq_len=ctx.max_seq_len,
            strict=self.config.strict,
            clone_state_dict=self.config.clone_state_dict,
            patch_list=self.config.patch_list,
            export_config=self.config,
        )
        if self.config.num_moe_experts_for_export is not None:
            from ...export.moe_expand import expand_moe_experts

            expand_moe_experts(gm, self.config.num_moe_experts_for_export)
        return gm, TransformInfo(skipped=False, num_matches=1, is_clean=False, has_valid_shapes=True)
