"""Mixture-of-experts blocks: an expert loop with static shapes for export.

transformers' expert modules (``@use_experts_implementation``: Mixtral, Qwen-MoE, ...) loop over
the experts that tokens were routed to, which depends on data and cannot be traced. During export
they run :func:`dense_experts_forward` instead, registered in transformers' own experts interface:
every expert is applied to every token and weighted by its routing weight (zero when not routed),
which computes the same result with static shapes. The pattern matcher later turns the loop into
one canonical MoE op.

Each expert's contribution is a chain that starts at ``aten.select(<expert weight>, 0, e)`` and is
added to a running sum, which is what ``num_moe_experts_for_export`` relies on to trace only a few
experts and replicate the chain for the rest (see ``autodeploy.export.moe_expand``).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ExportPatch, ExportPatchRegistry

EXPERTS_IMPLEMENTATION = "autodeploy_dense_export"

# Set by the export driver while tracing with num_moe_experts_for_export (None: trace all experts).
_traced_experts: list[int | None] = [None]


def _expert_linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return F.linear(x, weight.t() if transposed else weight)


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every expert on every token, weighted by a dense [tokens, experts] routing matrix."""
    up_weights = self.gate_up_proj if self.has_gate else self.up_proj
    num_experts = up_weights.shape[0]
    routing = torch.zeros(
        hidden_states.shape[0], num_experts + 1, dtype=top_k_weights.dtype, device=hidden_states.device
    )
    # expert ids >= num_experts are expert-parallel sentinels: they land in the extra, unused column
    routing = routing.scatter_add(1, top_k_index.clamp(max=num_experts), top_k_weights)
    traced = _traced_experts[0] or num_experts
    out = torch.zeros_like(hidden_states)
    for expert in range(min(traced, num_experts)):
        h = _expert_linear(hidden_states, up_weights[expert], self.is_transposed)
        if self.has_bias:
            h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[expert]
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _expert_linear(h, self.down_proj[expert], self.is_transposed)
        if self.has_bias:
            h = h + self.down_proj_bias[expert]
        if self.has_post_expert_norm:
            h = self.post_expert_norm(h)
        out = out + h * routing[:, expert, None].to(h.dtype)
    return out.to(hidden_states.dtype)


def _experts_interface():
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # transformers without the experts interface: nothing to patch
        return None
    return ALL_EXPERTS_FUNCTIONS


@ExportPatchRegistry.register("moe_dense_experts")
class MoEDenseExperts(ExportPatch):
    def _configs(self):
        seen = {}
        for module in self.model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_experts_implementation"):
                seen[id(config)] = config
        return list(seen.values())

    def applies(self) -> bool:
        return _experts_interface() is not None and any(
            hasattr(m, "down_proj") and hasattr(m, "_apply_gate") for m in self.model.modules()
        )

    @contextlib.contextmanager
    def patch(self):
        interface = _experts_interface()
        interface.register(EXPERTS_IMPLEMENTATION, dense_experts_forward)
        configs = self._configs()
        previous = [c._experts_implementation for c in configs]
        for c in configs:
            c._experts_implementation = EXPERTS_IMPLEMENTATION
        _traced_experts[0] = getattr(self.export_config, "num_moe_experts_for_export", None)
        try:
            yield
        finally:
            _traced_experts[0] = None
            for c, value in zip(configs, previous):
                c._experts_implementation = value


def _is_identity_experts(module: nn.Module) -> bool:
    """LongCat-Flash's experts: ``num_routed_experts`` SwiGLU experts (fused ``gate_up_proj``) and
    ``zero_expert_num`` zero-computation experts that return their input (``identity_expert``)."""
    return (hasattr(module, "identity_expert") and hasattr(module, "zero_expert_num")
            and getattr(module, "gate_up_proj", None) is not None and getattr(module, "down_proj", None) is not None)


def identity_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Every routed expert on every token as in :func:`dense_experts_forward` (ids of zero-computation experts land
    in the extra routing column), plus the input weighted by the routing weights of the zero-computation experts."""
    routed = self.num_routed_experts
    routing = torch.zeros(hidden_states.shape[0], routed + 1, dtype=top_k_weights.dtype, device=hidden_states.device)
    routing = routing.scatter_add(1, top_k_index.clamp(max=routed), top_k_weights)
    out = torch.zeros_like(hidden_states)
    for expert in range(routed):
        gate, up = F.linear(hidden_states, self.gate_up_proj[expert]).chunk(2, dim=-1)
        h = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
        out = out + h * routing[:, expert, None].to(h.dtype)
    identity = (top_k_weights * (top_k_index >= routed).to(top_k_weights.dtype)).sum(-1, keepdim=True)
    return (out + hidden_states * identity.to(hidden_states.dtype)).to(hidden_states.dtype)


@ExportPatchRegistry.register("moe_identity_experts")
class MoEIdentityExperts(ExportPatch):
    """Experts with zero-computation (identity) experts beside the routed ones (LongCat-Flash): their expert
    loop depends on the data, like transformers' own; :func:`identity_experts_forward` computes the same densely."""

    def applies(self) -> bool:
        return any(_is_identity_experts(m) for m in self.model.modules())

    @contextlib.contextmanager
    def patch(self):
        with contextlib.ExitStack() as stack:
            for module in self.model.modules():
                if _is_identity_experts(module):
                    forward = identity_experts_forward.__get__(module)
                    stack.enter_context(mock.patch.object(module, "forward", forward))
            yield
