"""``auto_deploy::torch_moe``: the routed experts of a mixture-of-experts block (SwiGLU experts).

    torch_moe(x, selected_experts, routing_weights, gate_up_weight, down_weight) -> Tensor

- ``x`` [tokens, hidden]; ``selected_experts`` [tokens, top_k] (int64, expert ids; ids >= num_experts
  are ignored, as expert-parallel sentinels); ``routing_weights`` [tokens, top_k].
- ``gate_up_weight`` [num_experts, 2 * intermediate, hidden]: gate rows then up rows (HF's fused
  layout); ``down_weight`` [num_experts, hidden, intermediate].
- out[t] = sum_k routing_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = selected[t, k].

Router and shared experts stay outside the op as ordinary graph nodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("auto_deploy::torch_moe", mutates_args=())
def torch_moe(
    x: torch.Tensor,
    selected_experts: torch.Tensor,
    routing_weights: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
) -> torch.Tensor:
    num_experts = gate_up_weight.shape[0]
    out = torch.zeros_like(x)
    for expert in torch.unique(selected_experts).tolist():  # only the experts some token was routed to
        if expert >= num_experts:
            continue
        token_idx, slot = torch.where(selected_experts == expert)
        gate, up = F.linear(x[token_idx], gate_up_weight[expert]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, down_weight[expert])
        out.index_add_(0, token_idx, (h * routing_weights[token_idx, slot, None].to(h.dtype)).to(out.dtype))
    return out


@torch_moe.register_fake
def _torch_moe_fake(x, selected_experts, routing_weights, gate_up_weight, down_weight):
    return torch.empty_like(x)
