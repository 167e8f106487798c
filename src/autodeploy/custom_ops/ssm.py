"""State-space ops: the causal depthwise convolution and the Mamba-1 selective scan.

    torch_causal_conv1d(x, weight, bias=None) -> Tensor
    torch_selective_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True) -> Tensor

Both work on [batch, seq, channels] ("bsd", the layout of the token stream after ``cache_init``):

- ``torch_causal_conv1d``: ``x`` [b, s, c], ``weight`` [c, 1, k] (``nn.Conv1d``'s depthwise layout), ``bias``
  [c] or None. Output [b, s, c]: position t sees inputs t-k+1..t (zeros before the sequence starts). No
  activation: the model's own activation follows the op in the graph.
- ``torch_selective_scan`` (Mamba-1): ``x``, ``dt`` and ``z`` [b, s, d], ``A`` [d, n] (negative), ``B``/``C``
  [b, s, n], ``D``/``dt_bias`` [d] or None. With ``dt = softplus(dt + dt_bias)`` (softplus when
  ``dt_softplus``), the state h [b, d, n] starts at zero and for each position t

      h = exp(dt_t * A) * h + dt_t * B_t * x_t,      y_t = h @ C_t + D * x_t,      y_t *= silu(z_t)

  Output [b, s, d] in ``x``'s dtype; the recurrence runs in float32, as HF's slow path does.

The cached forms (per-sequence state slots, prefill and decode mixed) are in :mod:`.cached_ssm`; they share
:func:`selective_scan_steps` and :func:`conv_over_window` with these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_over_window(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise conv without padding of ``window`` [b, c, k - 1 + s] (the k - 1 inputs before the first
    output position, then the s new ones): [b, c, s]."""
    return F.conv1d(window.to(weight.dtype), weight, bias, groups=weight.shape[0])


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::torch_causal_conv1d``."""
    history = weight.shape[-1] - 1
    window = F.pad(x.transpose(1, 2), (history, 0))  # zeros before the sequence starts
    return conv_over_window(window, weight, bias).transpose(1, 2).to(x.dtype)


torch_causal_conv1d = torch.library.custom_op("auto_deploy::torch_causal_conv1d", causal_conv1d_reference,
                                              mutates_args=())


@torch_causal_conv1d.register_fake
def _torch_causal_conv1d_fake(x, weight, bias=None):
    return torch.empty_like(x)


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """The time step in float32: ``softplus(dt + dt_bias)`` (softplus only with ``dt_softplus``)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def selective_scan_steps(x, dt, A, B, C, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over the s positions of ``x``/``dt`` [b, s, d], ``B``/``C`` [b, s, n] from ``state``
    [b, d, n] (float32; ``dt`` already discretized): (y [b, s, d] float32 without the D and z terms, the
    last state). A loop over positions: the reference, not a kernel."""
    A = A.float()
    dA = torch.exp(dt[..., None] * A)  # [b, s, d, n]
    dBx = (dt * x.float())[..., None] * B.float()[:, :, None, :]
    C = C.float()
    ys = []
    for t in range(x.shape[1]):
        state = dA[:, t] * state + dBx[:, t]
        ys.append(torch.einsum("bdn,bn->bd", state, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape, dtype=torch.float32)
    return y, state


def scan_epilogue(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """``y + D * x``, gated by ``silu(z)``, in float32 (then ``x``'s dtype)."""
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)


def selective_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::torch_selective_scan`` (see the module docstring)."""
    if A.dim() != 2 or A.shape[0] != x.shape[-1]:
        raise ValueError(f"torch_selective_scan: A must be [channels={x.shape[-1]}, state], got {tuple(A.shape)}")
    state = x.new_zeros(x.shape[0], A.shape[0], A.shape[1], dtype=torch.float32)
    y, _ = selective_scan_steps(x, discretize_dt(dt, dt_bias, dt_softplus), A, B, C, state)
    return scan_epilogue(y, x, D, z)


torch_selective_scan = torch.library.custom_op("auto_deploy::torch_selective_scan", selective_scan_reference,
                                               mutates_args=())


@torch_selective_scan.register_fake
def _torch_selective_scan_fake(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True):
    return torch.empty_like(x)
