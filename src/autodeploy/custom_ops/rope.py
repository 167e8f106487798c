"""``auto_deploy::torch_rope_with_explicit_cos_sin``: rotary embedding of q and k together.

    torch_rope_with_explicit_cos_sin(q, k, cos, sin, unsqueeze_dim=1, interleaved=False) -> (q_embed, k_embed)

Llama/Qwen/Mistral style by default (``rotate_half``: the two halves of the rotary dims form the pairs,
``x * cos + cat(-x[..., h:], x[..., :h]) * sin``). With ``interleaved=True``, GPT-J/Cohere/GLM style:
neighbouring features form the pairs, ``x * cos + stack(-x[..., 1::2], x[..., ::2], -1).flatten(-2) * sin``,
with cos/sin as those models hand them to it (each frequency twice in a row, ``repeat_interleave(2)``).
``cos``/``sin`` are [batch, seq, rotary_dim] (batch may be 1 to broadcast); ``unsqueeze_dim`` is the
heads dim of q/k to broadcast over: 1 for [batch, heads, seq, head_dim], 2 for
[batch, seq, heads, head_dim] (the canonical layout after ``match_rope_layout``).
When rotary_dim < head_dim (partial rotary, e.g. StableLM, Phi, GPT-NeoX), only the first rotary_dim
features rotate; the rest pass through unchanged.

The result dtype follows PyTorch's type promotion of q/k with cos/sin, exactly like the eager
``q * cos + rotate_half(q) * sin`` it replaces.
"""

from __future__ import annotations

import torch

from .compile_forms import register_compile_form


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    out = x_rot * cos + (_rotate_interleaved(x_rot) if interleaved else _rotate_half(x_rot)) * sin
    if x_pass.shape[-1] == 0:
        return out
    return torch.cat((out, x_pass.to(out.dtype)), dim=-1)


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    # plain raises, not torch._check with f-string closures: Dynamo traces these without a graph break
    rot_dim = cos.shape[-1]
    if sin.shape[-1] != rot_dim:
        raise ValueError("torch_rope: cos and sin need the same last dim")
    if rot_dim % 2:
        raise ValueError(f"torch_rope: rotary dim must be even, got {rot_dim}")
    for name, x in (("q", q), ("k", k)):
        if rot_dim > x.shape[-1]:
            raise ValueError(f"torch_rope: rotary dim {rot_dim} exceeds {name}'s head dim {x.shape[-1]}")


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch implementation of ``auto_deploy::torch_rope_with_explicit_cos_sin`` (also its compile
    form)."""
    _check(q, k, cos, sin)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _apply(q, cos, sin, interleaved), _apply(k, cos, sin, interleaved)


torch_rope_with_explicit_cos_sin = torch.library.custom_op(
    "auto_deploy::torch_rope_with_explicit_cos_sin", rope_reference, mutates_args=())
register_compile_form(torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default, lambda decode: rope_reference)


@torch_rope_with_explicit_cos_sin.register_fake
def _rope_fake(q, k, cos, sin, unsqueeze_dim=1, interleaved=False):
    _check(q, k, cos, sin)
    cs_dtype = torch.promote_types(cos.dtype, sin.dtype)
    dtype_q = torch.promote_types(q.dtype, cs_dtype)
    dtype_k = torch.promote_types(k.dtype, cs_dtype)
    return q.new_empty(q.shape, dtype=dtype_q), k.new_empty(k.shape, dtype=dtype_k)
