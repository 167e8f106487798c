"""State-space ops: the causal depthwise convolution, the Mamba-1 selective scan, the Mamba-2 (SSD) scan and the
gated delta rule (Qwen3-Next's linear attention).

    torch_causal_conv1d(x, weight, bias=None) -> Tensor
    torch_selective_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True) -> Tensor
    torch_ssd_scan(x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=True, dt_min=0.0, dt_max=None) -> Tensor
    torch_gated_delta_rule(q, k, v, g, beta, qk_l2norm=True) -> Tensor

Both work on [batch, seq, channels] ("bsd", the layout of the token stream after ``cache_init``):

- ``torch_causal_conv1d``: ``x`` [b, s, c], ``weight`` [c, 1, k] (``nn.Conv1d``'s depthwise layout), ``bias``
  [c] or None. Output [b, s, c]: position t sees inputs t-k+1..t (zeros before the sequence starts). No
  activation: the model's own activation follows the op in the graph.
- ``torch_selective_scan`` (Mamba-1): ``x``, ``dt`` and ``z`` [b, s, d], ``A`` [d, n] (negative), ``B``/``C``
  [b, s, n], ``D``/``dt_bias`` [d] or None. With ``dt = softplus(dt + dt_bias)`` (softplus when
  ``dt_softplus``), the state h [b, d, n] starts at zero and for each position t

      h = exp(dt_t * A) * h + dt_t * B_t * x_t,      y_t = h @ C_t + D * x_t,      y_t *= silu(z_t)

  Output [b, s, d] in ``x``'s dtype; the recurrence runs in float32, as HF's slow path does.
- ``torch_ssd_scan`` (Mamba-2's state-space duality scan, in its recurrent form): ``x`` [b, s, h, p] (h heads of
  p channels), ``dt`` [b, s, h], ``A``/``D``/``dt_bias`` [h] (one decay per head), ``B``/``C`` [b, s, g, n] (g
  groups of heads share them; h a multiple of g). With ``dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)``
  (``dt_max`` None: no upper limit)
  the state h [b, h, p, n] starts at zero and for each position t

      h = exp(dt_t * A) * h + dt_t * x_t B_t^T,      y_t = h C_t + D * x_t

  Output [b, s, h, p] in float32, as HF's ``torch_forward`` returns it (the gated norm that follows is the
  model's own graph).
- ``torch_gated_delta_rule``: ``q``/``k`` [b, s, hk, dk], ``v`` [b, s, hv, dv] (hv a multiple of hk: each
  q/k head serves hv / hk consecutive value heads), ``g`` (log decay) [b, s, hv] (per head, Gated DeltaNet) or
  [b, s, hv, dk] (per key channel, Kimi Delta Attention) and ``beta`` [b, s, hv]. With q and k
  L2-normalized over dk (``qk_l2norm``) and q scaled by dk^-0.5, the state S [b, hv, dk, dv] starts at zero and

      S = exp(g_t) S (row-wise over dk),      S = S + k_t (beta_t (v_t - S^T k_t))^T,      o_t = S^T q_t

  Output [b, s, hv, dv] in ``q``'s dtype; float32 inside, as HF's torch implementation.

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


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C [b, s, g, n] repeated to one per head: [b, s, h, n] float32 (head i uses group i // (h / g))."""
    return t.float().repeat_interleave(num_heads // t.shape[2], dim=2)


def discretize_ssd_dt(dt, dt_bias, dt_softplus: bool, dt_min: float, dt_max: float | None) -> torch.Tensor:
    """Mamba-2's time step in float32: :func:`discretize_dt`, clamped to [dt_min, dt_max]."""
    return discretize_dt(dt, dt_bias, dt_softplus).clamp(min=dt_min, max=dt_max)


def ssd_scan_steps(x, dt, A, B, C, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 recurrence over the s positions of ``x`` [b, s, h, p], ``dt`` [b, s, h] (discretized), ``B``/
    ``C`` [b, s, g, n] from ``state`` [b, h, p, n] float32: (y [b, s, h, p] float32 without the D term, the last
    state). A loop over positions: the reference, not a kernel."""
    num_heads = x.shape[2]
    B, C = _heads(B, num_heads), _heads(C, num_heads)
    dA = torch.exp(dt * A.float())  # [b, s, h]
    dtx = dt[..., None] * x.float()  # [b, s, h, p]
    ys = []
    for t in range(x.shape[1]):
        state = dA[:, t, :, None, None] * state + dtx[:, t, :, :, None] * B[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape, dtype=torch.float32)
    return y, state


def ssd_epilogue(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor:
    return y if D is None else y + x.float() * D.float()[:, None]


def ssd_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float | None = None,
) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::torch_ssd_scan`` (see the module docstring)."""
    b, _, h, p = x.shape
    if A.shape != (h,) or B.shape[2] == 0 or h % B.shape[2]:
        raise ValueError(f"torch_ssd_scan: A must be [heads={h}] and the heads a multiple of B's groups, got A "
                         f"{tuple(A.shape)}, B {tuple(B.shape)}")
    state = x.new_zeros(b, h, p, B.shape[-1], dtype=torch.float32)
    y, _ = ssd_scan_steps(x, discretize_ssd_dt(dt, dt_bias, dt_softplus, dt_min, dt_max), A, B, C, state)
    return ssd_epilogue(y, x, D)


torch_ssd_scan = torch.library.custom_op("auto_deploy::torch_ssd_scan", ssd_scan_reference, mutates_args=())


@torch_ssd_scan.register_fake
def _torch_ssd_scan_fake(x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=True, dt_min=0.0, dt_max=None):
    return torch.empty_like(x, dtype=torch.float32)


def _unit(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """L2 normalization over the last dim as FLA (and HF) write it: ``x * rsqrt(sum(x^2) + eps)``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_inputs(q, k, v, g, beta, qk_l2norm: bool):
    """float32 q (normalized, scaled), k (normalized), v, g, beta, with q/k repeated to the value heads."""
    groups = v.shape[-2] // k.shape[-2]
    q, k = (t.float().repeat_interleave(groups, dim=-2) for t in (q, k))
    if qk_l2norm:
        q, k = _unit(q), _unit(k)
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def delta_rule_steps(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the s positions of float32 ``q``/``k`` [b, s, hv, dk], ``v`` [b, s, hv, dv],
    ``g`` [b, s, hv] or [b, s, hv, dk], ``beta`` [b, s, hv] (from :func:`delta_rule_inputs`) from ``state``
    [b, hv, dk, dv]: (o [b, s, hv, dv],
    the last state). A loop over positions: the reference, not a kernel."""
    outs = []
    for t in range(q.shape[1]):
        decay = g[:, t].exp()  # [b, hv] or [b, hv, dk]
        state = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return out, state


def gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               qk_l2norm: bool = True) -> torch.Tensor:
    """The plain-torch implementation of ``auto_deploy::torch_gated_delta_rule`` (see the module docstring)."""
    per_channel = g.dim() == 4
    if v.shape[-2] % k.shape[-2] or q.shape[-2] != k.shape[-2] or (per_channel and g.shape[-1] != k.shape[-1]):
        raise ValueError(f"torch_gated_delta_rule: value heads must be a multiple of the q/k heads (and a "
                         f"per-channel g as wide as k), got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, g {tuple(g.shape)}")
    qf, kf, vf, gf, bf = delta_rule_inputs(q, k, v, g, beta, qk_l2norm)
    state = vf.new_zeros(v.shape[0], v.shape[-2], k.shape[-1], v.shape[-1])
    out, _ = delta_rule_steps(qf, kf, vf, gf, bf, state)
    return out.to(q.dtype)


torch_gated_delta_rule = torch.library.custom_op("auto_deploy::torch_gated_delta_rule", gated_delta_rule_reference,
                                                 mutates_args=())


@torch_gated_delta_rule.register_fake
def _torch_gated_delta_rule_fake(q, k, v, g, beta, qk_l2norm=True):
    return v.new_empty(v.shape, dtype=q.dtype)
