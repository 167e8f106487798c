"""Delta-rule mixers (Gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid; Kimi Delta Attention): their forward
through the canonical ops.

HF's pure-torch gated delta rule (``torch_chunk_gated_delta_rule``) chunks the sequence with a padding that
depends on its length, which ``torch.export`` cannot trace with a dynamic sequence dim. While export runs, each
such module's ``forward`` is :func:`gated_delta_net_forward`: the same computation with the convolution as
``auto_deploy::torch_causal_conv1d`` and the recurrence as ``auto_deploy::torch_gated_delta_rule``
(:mod:`autodeploy.custom_ops.ssm`), which ``insert_cached_ssm`` gives a per-sequence state.

A module is such a mixer by what it holds: a depthwise ``conv1d`` over q|k|v (``2 * key_dim + value_dim``
channels), ``A_log`` and ``dt_bias`` [value heads], the gated norm (``norm`` or ``o_norm``), the output
projection (``out_proj`` or ``o_proj``), its sizes (``num_k_heads``, ``num_v_heads``, ``head_k_dim``,
``head_v_dim``, ``key_dim``, ``value_dim``) and its input projections, in one of three layouts: Qwen3-Next's
``in_proj_qkvz`` / ``in_proj_ba`` (interleaved per key head, untangled by the module's own
``fix_query_key_value_ordering``), Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, or
OLMo-Hybrid's ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (the gate), ``b_proj``, ``a_proj``. With
``allow_neg_eigval`` (OLMo-Hybrid) beta is doubled, as the module does.

Kimi Delta Attention (``KimiLinearDeltaAttention``) is the same rule with a decay per key channel: it holds
``q_proj``/``k_proj``/``v_proj``, the depthwise ``conv1d`` over q|k|v, a ``forget_gate`` module (the log decay
[b, s, heads, head_dim]), ``b_proj`` (beta), ``g_a_proj``/``g_b_proj`` (the output gate), ``o_norm``, ``o_proj``
and its sizes ``num_heads``, ``head_dim``; :func:`kimi_delta_attention_forward` calls its own forget gate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ExportPatchRegistry, ModuleForwardPatch

_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim")
_SPLIT_PROJS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_SEPARATE_PROJS = ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj")


def _linears(module: nn.Module, names) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in names)


def _interleaved(module: nn.Module) -> bool:
    """Qwen3-Next's layout: q, k, v, z (and b, a) interleaved per key head in two projections."""
    return _linears(module, ("in_proj_qkvz", "in_proj_ba")) and callable(
        getattr(module, "fix_query_key_value_ordering", None))


def _first(module: nn.Module, names: tuple[str, ...], kind: type):
    return next((m for m in (getattr(module, n, None) for n in names) if isinstance(m, kind)), None)


def _norm(module: nn.Module):
    return _first(module, ("norm", "o_norm"), nn.Module)


def _out_proj(module: nn.Module):
    return _first(module, ("out_proj", "o_proj"), nn.Linear)


def is_gated_delta_net(module: nn.Module) -> bool:
    """Whether ``module`` holds the weights and sizes of a Gated DeltaNet mixer (see the module docstring)."""
    conv = getattr(module, "conv1d", None)
    sizes = [getattr(module, name, None) for name in _SIZES]
    if not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels or not all(isinstance(v, int) for v in sizes):
        return False
    k_heads, v_heads, dk, dv, key_dim, value_dim = sizes
    params = [getattr(module, name, None) for name in ("A_log", "dt_bias")]
    return (all(isinstance(t, torch.Tensor) and tuple(t.shape) == (v_heads,) for t in params)
            and key_dim == k_heads * dk and value_dim == v_heads * dv and v_heads % k_heads == 0
            and conv.in_channels == 2 * key_dim + value_dim and _norm(module) is not None
            and _out_proj(module) is not None
            and (_interleaved(module) or _linears(module, _SPLIT_PROJS) or _linears(module, _SEPARATE_PROJS)))


def _activation(name: str):
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def gated_delta_net_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """HF's Gated DeltaNet forward without a cache, through the canonical ops (``self``: the mixer)."""
    if cache is not None:
        raise RuntimeError("the export patch of Gated DeltaNet mixers traces the cache-free forward only "
                           "(use_cache=False)")
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, seq, _ = hidden_states.shape
    if _interleaved(self):
        q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden_states),
                                                             self.in_proj_ba(hidden_states))
        mixed = torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1)
    elif _linears(self, _SPLIT_PROJS):
        mixed = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    else:
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
        z = self.g_proj(hidden_states)
        b, a = self.b_proj(hidden_states), self.a_proj(hidden_states)
    mixed = torch.ops.auto_deploy.torch_causal_conv1d(mixed, self.conv1d.weight, self.conv1d.bias)
    mixed = _activation(self.activation)(mixed)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(batch, seq, -1, self.head_k_dim)
    k = k.reshape(batch, seq, -1, self.head_k_dim)
    v = v.reshape(batch, seq, -1, self.head_v_dim)
    beta = b.sigmoid()
    if getattr(self, "allow_neg_eigval", False):  # beta in (0, 2): the transition may have negative eigenvalues
        beta = beta * 2.0
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    out = torch.ops.auto_deploy.torch_gated_delta_rule(q, k, v, g, beta, True)
    out = _norm(self)(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return _out_proj(self)(out.reshape(batch, seq, -1))


_KIMI_PROJS = ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")


def is_kimi_delta_attention(module: nn.Module) -> bool:
    """Whether ``module`` holds the weights and sizes of a Kimi Delta Attention mixer (see the module docstring)."""
    conv, heads, head_dim = (getattr(module, name, None) for name in ("conv1d", "num_heads", "head_dim"))
    return (isinstance(conv, nn.Conv1d) and isinstance(heads, int) and isinstance(head_dim, int)
            and conv.groups == conv.in_channels == 3 * heads * head_dim and _linears(module, _KIMI_PROJS)
            and all(isinstance(getattr(module, name, None), nn.Module) for name in ("forget_gate", "o_norm")))


def kimi_delta_attention_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """HF's Kimi Delta Attention forward without a cache, through the canonical ops (``self``: the mixer)."""
    if cache is not None:
        raise RuntimeError("the export patch of Kimi Delta Attention traces the cache-free forward only "
                           "(use_cache=False)")
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, seq = hidden_states.shape[:2]
    heads = (batch, seq, -1, self.head_dim)
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], -1)
    mixed = torch.ops.auto_deploy.torch_causal_conv1d(mixed, self.conv1d.weight, self.conv1d.bias)
    q, k, v = (t.reshape(heads) for t in torch.split(_activation(self.activation)(mixed), mixed.shape[-1] // 3, -1))
    g = self.forget_gate(hidden_states)  # [b, s, heads, head_dim]: a decay per key channel
    beta = torch.sigmoid(self.b_proj(hidden_states))
    out = torch.ops.auto_deploy.torch_gated_delta_rule(q, k, v, g, beta, True)
    gate = self.g_b_proj(self.g_a_proj(hidden_states)).view(heads)
    return self.o_proj(self.o_norm(out, gate).reshape(batch, seq, -1))


_FORWARDS = ((is_gated_delta_net, gated_delta_net_forward), (is_kimi_delta_attention, kimi_delta_attention_forward))


@ExportPatchRegistry.register("gated_delta_net_ops")
class GatedDeltaNetOps(ModuleForwardPatch):
    """Every delta-rule mixer through the canonical ops."""

    FORWARDS = _FORWARDS
