"""Mamba mixers: their slow forward expressed through the canonical state-space ops.

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

Mamba-2 mixers (``Mamba2Mixer``, ``BambaMixer``, ``NemotronHMamba2Mixer``, ``GraniteMoeHybridMambaLayer``: the
same ``torch_forward``) chunk the sequence with a padding that depends on its length; they become
:func:`mamba2_mixer_forward`, with the recurrence as ``auto_deploy::torch_ssd_scan``. They hold ``in_proj`` (to
the gate, the conv channels x|B|C and one dt per head), a depthwise ``conv1d``, ``A_log``/``D``/``dt_bias``
[heads], the gated ``norm`` and ``out_proj``, and name their sizes (``num_heads``, ``head_dim``, ``n_groups``,
``ssm_state_size``, ``intermediate_size``) and ``time_step_limit``. Falcon-H1's mixer also scales its input
(``ssm_in_multiplier``) and projection (``mup_vector``), and with ``mamba_rms_norm`` off gates with ``silu(z)``
instead of the gated norm; the forward does what these attributes say.

Zamba's mixer (``ZambaMambaMixer``) runs ``n_mamba_heads`` independent Mamba-1 scans over slices of the
channels: per-head ``x_proj_weight`` [heads, rank + 2 * state, head_dim], ``dt_proj_weight`` [heads, head_dim,
rank], ``dt_proj_bias``/``D`` [heads, head_dim], ``A_log`` [heads, head_dim, state], and an ``in_proj`` whose x
and gate channels alternate; :func:`zamba_mixer_forward` makes one ``torch_selective_scan`` per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import ExportPatchRegistry, ModuleForwardPatch

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


_MAMBA2_SIZES = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size")


def is_mamba2_mixer(module: nn.Module) -> bool:
    """Whether ``module`` holds the weights and sizes of a Mamba-2 mixer (see the module docstring)."""
    conv = getattr(module, "conv1d", None)
    if not isinstance(conv, nn.Conv1d) or conv.groups != conv.in_channels:
        return False
    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in ("in_proj", "out_proj")):
        return False
    if not isinstance(getattr(module, "norm", None), nn.Module) or len(getattr(module, "time_step_limit", ())) != 2:
        return False
    sizes = [getattr(module, name, None) for name in _MAMBA2_SIZES]
    if not all(isinstance(v, int) for v in sizes):
        return False
    heads, head_dim, groups, state, inner = sizes
    params = [getattr(module, name, None) for name in ("A_log", "D", "dt_bias")]
    return (all(isinstance(t, torch.Tensor) and tuple(t.shape) == (heads,) for t in params)
            and inner == heads * head_dim and conv.in_channels == inner + 2 * groups * state
            and module.in_proj.out_features == inner + conv.in_channels + heads)


def mamba2_mixer_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """HF's Mamba-2 mixer ``torch_forward`` without a cache, through the canonical ops (``self``: the mixer)."""
    if cache is not None:
        raise RuntimeError("the export patch of Mamba-2 mixers traces the cache-free forward only (use_cache=False)")
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, seq, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim, groups, state, inner = (getattr(self, name) for name in _MAMBA2_SIZES)
    if hasattr(self, "ssm_in_multiplier"):  # Falcon-H1's muP multipliers
        hidden_states = hidden_states * self.ssm_in_multiplier
    projected = self.in_proj(hidden_states)
    if hasattr(self, "mup_vector"):
        projected = projected * self.mup_vector
    gate, xBC, dt = projected.split([inner, self.conv1d.in_channels, heads], dim=-1)
    xBC = self.act(torch.ops.auto_deploy.torch_causal_conv1d(xBC, self.conv1d.weight, self.conv1d.bias))
    if attention_mask is not None:
        xBC = (xBC * attention_mask[:, :, None]).to(xBC.dtype)
    x, B, C = torch.split(xBC, [inner, groups * state, groups * state], dim=-1)
    A = -torch.exp(self.A_log.float())
    dt_min, dt_max = (float(v) for v in self.time_step_limit)
    dt_max = None if dt_max == float("inf") else dt_max  # no upper limit (the op's schema has no inf default)
    y = torch.ops.auto_deploy.torch_ssd_scan(
        x.view(batch, seq, heads, head_dim), dt, A, B.view(batch, seq, groups, state),
        C.view(batch, seq, groups, state), self.D, self.dt_bias, True, dt_min, dt_max,
    )
    y = y.reshape(batch, seq, -1)
    y = self.norm(y, gate) if getattr(self, "mamba_rms_norm", True) else y * F.silu(gate)
    return self.out_proj(y.to(dtype))


def is_zamba_mixer(module: nn.Module) -> bool:
    """Whether ``module`` holds the per-head weights of Zamba's multi-head Mamba-1 mixer (see the docstring)."""
    conv, heads, head_dim = (getattr(module, n, None) for n in ("conv1d", "n_mamba_heads", "mamba_head_dim"))
    if not isinstance(conv, nn.Conv1d) or not isinstance(heads, int) or not isinstance(head_dim, int):
        return False
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in ("in_proj", "out_proj")):
        return False
    params = {n: getattr(module, n, None) for n in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D")}
    if not all(isinstance(t, torch.Tensor) for t in params.values()):
        return False
    inner = heads * head_dim
    return (conv.groups == conv.in_channels == inner and module.in_proj.out_features == 2 * inner
            and params["A_log"].dim() == 3 and tuple(params["A_log"].shape[:2]) == (heads, head_dim)
            and tuple(params["D"].shape) == tuple(params["dt_proj_bias"].shape) == (heads, head_dim)
            and params["x_proj_weight"].dim() == 3 and params["dt_proj_weight"].dim() == 3)


def zamba_mixer_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """HF's Zamba mixer forward without a cache, through the canonical ops: one scan per Mamba head."""
    if cache is not None:
        raise RuntimeError("the export patch of Zamba mixers traces the cache-free forward only (use_cache=False)")
    if attention_mask is not None:
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    batch, seq, _ = hidden_states.shape
    dtype = hidden_states.dtype
    heads, head_dim = self.n_mamba_heads, self.mamba_head_dim
    projected = self.in_proj(hidden_states).view(batch, seq, heads * head_dim, 2)  # x and gate alternate
    x, gate = projected[..., 0], projected[..., 1]
    x = self.act(torch.ops.auto_deploy.torch_causal_conv1d(x, self.conv1d.weight, self.conv1d.bias))
    if attention_mask is not None:
        x = (x * attention_mask[:, :, None]).to(x.dtype)
    rank, state = self.dt_proj_weight.shape[-1], self.A_log.shape[-1]
    A = -torch.exp(self.A_log.float())
    outs = []
    for h in range(heads):
        channels = slice(h * head_dim, (h + 1) * head_dim)
        x_h = x[..., channels]
        time_step, B, C = torch.split(F.linear(x_h, self.x_proj_weight[h]), [rank, state, state], dim=-1)
        time_step = F.linear(time_step, self.dt_proj_weight[h])
        outs.append(torch.ops.auto_deploy.torch_selective_scan(x_h, time_step, A[h], B, C, self.D[h],
                                                               gate[..., channels], self.dt_proj_bias[h], True))
    return self.out_proj(torch.cat(outs, dim=-1).to(dtype))


_FORWARDS = ((is_mamba1_mixer, mamba_mixer_forward), (is_mamba2_mixer, mamba2_mixer_forward),
             (is_zamba_mixer, zamba_mixer_forward))


@ExportPatchRegistry.register("mamba_mixer_ops")
class MambaMixerOps(ModuleForwardPatch):
    """Every Mamba-1/-2 mixer through the canonical ops."""

    FORWARDS = _FORWARDS
