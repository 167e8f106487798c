"""``auto_deploy::torch_layernorm``: layer normalization over the last dim, computed in fp32.

    torch_layernorm(x, weight?, bias?, eps) ->
        (((x32 - mean(x32)) * rsqrt(var(x32) + eps)) * weight32 + bias32).to(x.dtype)

``x32`` is ``x`` in float32, ``var`` the biased variance over the last dim; ``weight`` and ``bias`` are
``[hidden]`` or None (OLMo's non-parametric norm, Cohere's bias-free one) and are applied in float32
before the single rounding to ``x``'s dtype: what ``aten.layer_norm`` computes on CPU, and what
Cohere's hand-written ``weight.float() * normed`` followed by ``.to(input_dtype)`` computes.
The fused form (``fuse_layernorm``) is ``aten.layer_norm`` where x, weight and bias share a dtype.
"""

from __future__ import annotations

import torch

from .compile_forms import register_compile_form


def layernorm_reference(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::torch_layernorm`` (also its compile form)."""
    x32 = x.to(torch.float32)
    centered = x32 - x32.mean(-1, keepdim=True)
    out = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * weight.to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(x.dtype)


torch_layernorm = torch.library.custom_op("auto_deploy::torch_layernorm", layernorm_reference, mutates_args=())
register_compile_form(torch.ops.auto_deploy.torch_layernorm.default, lambda decode: layernorm_reference)


@torch_layernorm.register_fake
def _torch_layernorm_fake(x, weight, bias, eps):
    return torch.empty_like(x)
