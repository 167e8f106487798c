"""``auto_deploy::torch_rmsnorm``: RMS normalization computed in fp32, as HF does.

    torch_rmsnorm(x, weight, eps) -> weight * (x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).to(x.dtype)

``weight`` may be None: the weightless norm (NanoChat's norms, Llama 4's L2 q/k norm).
"""

from __future__ import annotations

import torch

from .compile_forms import register_compile_form


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::torch_rmsnorm`` (also its compile form)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) if weight is None else weight * normed.to(x.dtype)


torch_rmsnorm = torch.library.custom_op("auto_deploy::torch_rmsnorm", rmsnorm_reference, mutates_args=())
register_compile_form(torch.ops.auto_deploy.torch_rmsnorm.default, lambda decode: rmsnorm_reference)


@torch_rmsnorm.register_fake
def _torch_rmsnorm_fake(x, weight, eps):
    return torch.empty_like(x, dtype=x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype))
