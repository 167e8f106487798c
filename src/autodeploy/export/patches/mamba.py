"""Mamba-1 mixers: their slow forward expressed through the canonical state-space ops.

HF's pure-torch mixer (``MambaMixer``, ``FalconMambaMixer``, ``JambaMambaMixer``) loops over the sequence in
Python (the selective scan's recurrence), which ``torch.export`` cannot trace with a dynamic sequence dim.
While export runs, each such module's ``forward`` is :func:`mamba_mixer_forward`, the same computation with
the convolution as ``auto_deploy::torch_causal_conv1d`` and the recurrence as
``auto_deploy::torch_selective_scan`` (:mod:`autodeploy.custom_ops.ssm`), whose cached forms ``cache_init``
later swaps in.

A module is a Mamba-1 mixer by what it holds, not by its class name: a depthwise ``conv1d``, ``in_proj`` (to
twice the inner size: x and the gate z), ``x_proj`` (to dt rank + 2 * state size), ``dt_proj``, ``out_proj``,
``A_log`` [inner, state] and ``D`` [inner]; optional ``dt_layernorm``/``b_layernorm``/``c_layernorm`` (Falcon-
Mamba, Jamba) normalize dt, B and C before the scan, as their forward does. This is the one module-level
patch of the project: the alternative, matching the unrolled loop of a traced scan, does not exist for a
dynamic sequence length.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ExportPatch, ExportPatchRegistry

_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def is_mamba1_mixer(module: nn.Module) -> bool:
    """Whether ``module`` holds the weights of a Mamba-1 mixer (see the module docstring)."""
    conv, a_log, d = getattr(module, "conv1d", None), getattr(module, "A_log", None), getattr(module, "D", None)
    if not isinstance(conv, nn.Conv1d) or not isinstance(a_log, torch.Tensor) or not isinstance(d, torch.Tensor):
        return False
    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in ("in_proj", "x_proj", "dt_proj",
                                                                                 "out_proj")):
        return False
    inner = conv.in_channels
    return (conv.groups == inner == conv.out_channels and a_log.dim() == 2 and a_log.shape[0] == inner
            and tuple(d.shape) == (inner,) and module.in_proj.out_features == 2 * inner
            and module.x_proj.out_features == module.dt_proj.in_features + 2 * a_log.shape[1])


def mamba_mixer_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """HF's Mamba-1 mixer forward without a cache, through the canonical ops (``self``: the mixer)."""
    if cache is not None:
        raise RuntimeError("the export patch of Mamba mixers traces the cache-free forward only (use_cache=False)")
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    dtype = hidden_states.dtype
    x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # [b, s, inner] each
    x = self.act(torch.ops.auto_deploy.torch_causal_conv1d(x, self.conv1d.weight, self.conv1d.bias))
    if attention_mask is not None:
        x = (x * attention_mask[:, :, None]).to(x.dtype)
    rank, state = self.dt_proj.in_features, self.A_log.shape[1]
    time_step, B, C = torch.split(self.x_proj(x), [rank, state, state], dim=-1)
    if all(isinstance(getattr(self, name, None), nn.Module) for name in _NORMS):
        time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
    time_step = F.linear(time_step, self.dt_proj.weight)  # its bias is added (in float32) inside the scan
    A = -torch.exp(self.A_log.float())
    y = torch.ops.auto_deploy.torch_selective_scan(x, time_step, A, B, C, self.D, gate, self.dt_proj.bias, True)
    return self.out_proj(y.to(dtype))


@ExportPatchRegistry.register("mamba_mixer_ops")
class MambaMixerOps(ExportPatch):
    def _mixers(self) -> list[nn.Module]:
        return [m for m in self.model.modules() if is_mamba1_mixer(m)]

    def applies(self) -> bool:
        return bool(self._mixers())

    @contextlib.contextmanager
    def patch(self):
        mixers = self._mixers()
        for m in mixers:  # an instance attribute shadows the class's forward
            m.forward = types.MethodType(mamba_mixer_forward, m)
        try:
            yield
        finally:
            for m in mixers:
                del m.forward
