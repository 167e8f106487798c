"""Gated DeltaNet mixers (Qwen3-Next, Qwen3.5): their forward through the canonical ops.

HF's pure-torch gated delta rule (``torch_chunk_gated_delta_rule``) chunks the sequence with a padding that
depends on its length, which ``torch.export`` cannot trace with a dynamic sequence dim. While export runs, each
such module's ``forward`` is :func:`gated_delta_net_forward`: the same computation with the convolution as
``auto_deploy::torch_causal_conv1d`` and the recurrence as ``auto_deploy::torch_gated_delta_rule``
(:mod:`autodeploy.custom_ops.ssm`), which ``insert_cached_ssm`` gives a per-sequence state.

A module is such a mixer by what it holds: a depthwise ``conv1d`` over q|k|v (``2 * key_dim + value_dim``
channels), ``A_log`` and ``dt_bias`` [value heads], the gated ``norm``, ``out_proj``, its sizes
(``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``, ``key_dim``, ``value_dim``) and its input
projections, in one of two layouts: Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` (interleaved per key head,
untangled by the module's own ``fix_query_key_value_ordering``) or Qwen3.5's ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b``, ``in_proj_a``.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ExportPatch, ExportPatchRegistry

_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim")
_SPLIT_PROJS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _linears(module: nn.Module, names) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in names)


def _interleaved(module: nn.Module) -> bool:
    """Qwen3-Next's layout: q, k, v, z (and b, a) interleaved per key head in two projections."""
    return _linears(module, ("in_proj_qkvz", "in_proj_ba")) and callable(
        getattr(module, "fix_query_key_value_ordering", None))


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
            and conv.in_channels == 2 * key_dim + value_dim and isinstance(getattr(module, "norm", None), nn.Module)
            and _linears(module, ("out_proj",)) and (_interleaved(module) or _linears(module, _SPLIT_PROJS)))


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
    else:
        mixed = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(batch, seq, -1, self.head_v_dim)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    mixed = torch.ops.auto_deploy.torch_causal_conv1d(mixed, self.conv1d.weight, self.conv1d.bias)
    mixed = _activation(self.activation)(mixed)
    q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    q = q.reshape(batch, seq, -1, self.head_k_dim)
    k = k.reshape(batch, seq, -1, self.head_k_dim)
    v = v.reshape(batch, seq, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    out = torch.ops.auto_deploy.torch_gated_delta_rule(q, k, v, g, beta, True)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, seq, -1))


@ExportPatchRegistry.register("gated_delta_net_ops")
class GatedDeltaNetOps(ExportPatch):
    def _mixers(self) -> list[nn.Module]:
        return [m for m in self.model.modules() if is_gated_delta_net(m)]

    def applies(self) -> bool:
        return bool(self._mixers())

    @contextlib.contextmanager
    def patch(self):
        mixers = self._mixers()
        for m in mixers:  # an instance attribute shadows the class's forward
            m.forward = types.MethodType(gated_delta_net_forward, m)
        try:
            yield
        finally:
            for m in mixers:
                del m.forward
