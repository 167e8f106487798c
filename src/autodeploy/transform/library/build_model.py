"""factory stage: build the HF model skeleton on the meta device."""

from __future__ import annotations

from torch import nn

from ...errors import AutoDeployError
from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry


@TransformRegistry.register("build_model")
class BuildModel(BaseTransform):
    """Builds the model from the factory; no weight memory is allocated (meta device)."""

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        if ctx.factory is None:
            raise AutoDeployError("build_model needs a model: pass --model PATH (or optimize(model=...))")
        model = ctx.factory.build_model(device="meta")
        return model, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=True)
