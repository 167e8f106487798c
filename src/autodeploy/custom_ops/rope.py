"""``auto_deploy::torch_rope_with_explicit_cos_sin``: rotary embedding of q and k together.

    torch_rope_with_explicit_cos_sin(q, k, cos, sin, unsqueeze_dim=1) -> (q_embed, k_embed)

Llama/Qwen/Mistral style (``rotate_half``: the two halves of the rotary dims form the pairs).
``cos``/``sin`` are [batch, seq, rotary_dim]; ``unsqueeze_dim`` is the heads dim of q/k to
broadcast over: 1 for [batch, heads, seq, head_dim], 2 for [batch, seq, heads, head_dim].
When rotary_dim < head_dim (partial rotary), only the first rotary_dim features rotate.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    out = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((out, x_pass), dim=-1) if x_pass.shape[-1] else out


@torch.library.custom_op("auto_deploy::torch_rope_with_explicit_cos_sin", mutates_args=())
def torch_rope_with_explicit_cos_sin(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return _apply(q, cos, sin), _apply(k, cos, sin)


@torch_rope_with_explicit_cos_sin.register_fake
def _rope_fake(q, k, cos, sin, unsqueeze_dim=1):
    dtype_q = torch.promote_types(q.dtype, cos.dtype)
    dtype_k = torch.promote_types(k.dtype, cos.dtype)
    return torch.empty_like(q, dtype=dtype_q), torch.empty_like(k, dtype=dtype_k)
