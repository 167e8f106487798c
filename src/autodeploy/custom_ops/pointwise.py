"""The pointwise work of prompts between their products, as ops with native kernels.

    rms_norm(x, weight?, eps)   -> torch_rmsnorm's arithmetic (rmsnorm_reference)
    add_rms_norm(x, residual, weight?, eps) -> (x + residual, rms_norm(x + residual, weight, eps)): a residual
                                   add and the norm after it, one pass
    silu_mul(gate, up)          -> F.silu(gate) * up
    rope(q, k, cos, sin)        -> torch_rope_with_explicit_cos_sin(q, k, cos, sin, unsqueeze_dim=2): rotate_half
                                   pairs, q and k [batch, seq, heads, head_dim], cos and sin [batch or 1, seq, rot]

A prompt runs its graph eagerly (the ``aoti`` backend compiles only the decode step), where torch's kernels for
these take several passes over the activations each: ``aten.rms_norm`` on the CPU is six kernels (pow, mean, add,
rsqrt and two multiplies), SiLU times up two, the reference RoPE six per tensor. Where the native kernels run
(:mod:`autodeploy.custom_ops.native`), each of these ops is one pass over float32 rows (``native/kernels.cpp``),
which reads the halves of a fused gate/up or q/k/v product in place; the ``native_pointwise`` transform puts them in
the graph. Their float32 results differ from the references by rounding only (sums in another order, and the
multiply-adds the compiler may fuse); other dtypes run the references' arithmetic. Compiled graphs (the decode
step, ``torch-compile``) read them as their references, so Inductor fuses them with their neighbours as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .compile_forms import register_compile_form
from .rmsnorm import rmsnorm_reference
from .rope import rope_reference

_LIB = torch.library.Library("auto_deploy", "FRAGMENT")
_LIB.define("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor")
_LIB.define("add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps) -> (Tensor, Tensor)")
_LIB.define("silu_mul(Tensor gate, Tensor up) -> Tensor")
_LIB.define("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)")


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch implementation of ``auto_deploy::add_rms_norm``."""
    total = x + residual
    return total, rmsnorm_reference(total, weight, eps)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::silu_mul``."""
    return F.silu(gate) * up


def rope_bshd_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch implementation of ``auto_deploy::rope``."""
    return rope_reference(q, k, cos, sin, unsqueeze_dim=2)


_REFERENCES = {"rms_norm": rmsnorm_reference, "add_rms_norm": add_rms_norm_reference, "silu_mul": silu_mul_reference,
               "rope": rope_bshd_reference}
for _name, _reference in _REFERENCES.items():
    _LIB.impl(_name, _reference, "CompositeExplicitAutograd")
    register_compile_form(getattr(torch.ops.auto_deploy, _name).default, lambda decode, fn=_reference: fn)


@torch.library.register_fake("auto_deploy::rms_norm", lib=_LIB)
def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype))


@torch.library.register_fake("auto_deploy::add_rms_norm", lib=_LIB)
def _add_rms_norm_fake(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = torch.empty(torch.broadcast_shapes(x.shape, residual.shape),
                        dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return total, _rms_norm_fake(total, weight, eps)


@torch.library.register_fake("auto_deploy::silu_mul", lib=_LIB)
def _silu_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty(torch.broadcast_shapes(gate.shape, up.shape), dtype=torch.promote_types(gate.dtype, up.dtype),
                       device=gate.device)


@torch.library.register_fake("auto_deploy::rope", lib=_LIB)
def _rope_fake(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(cos.dtype, sin.dtype)
    return (torch.empty(q.shape, dtype=torch.promote_types(q.dtype, dtype), device=q.device),
            torch.empty(k.shape, dtype=torch.promote_types(k.dtype, dtype), device=k.device))
