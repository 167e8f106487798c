"""Cached state-space ops: the state of each sequence in a slot of a per-layer state cache.

    torch_cached_causal_conv1d(x, weight, bias, conv_state, seq_lens, input_pos, slot_idx) -> Tensor
    torch_cached_selective_scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_state,
                                seq_lens, input_pos, slot_idx) -> Tensor
    torch_cached_ssd_scan(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_min, dt_max, ssm_state,
                          seq_lens, input_pos, slot_idx) -> Tensor
    torch_cached_gated_delta_rule(q, k, v, g, beta, qk_l2norm, ssm_state, seq_lens, input_pos, slot_idx) -> Tensor

The cached forms of :mod:`.ssm`'s ops for a batch of sequences flattened into one token stream (prefill and
decode mixed), as cached attention serves it (:mod:`.cached_attention`):

- the tensor arguments of the uncached op, their leading dims the token stream (normally [1, total_tokens]),
  sequence after sequence; ``seq_lens`` [num_seqs] and ``input_pos`` [num_seqs] as for cached attention;
- ``slot_idx`` [num_seqs] int32: the state-cache slot of each sequence;
- ``conv_state`` [num_slots, channels, kernel - 1]: the last kernel - 1 inputs of each slot's sequence;
  ``ssm_state`` [num_slots, channels, state_size] float32: the recurrence's state (Mamba-2: [num_slots, heads,
  head_dim, state_size]; the gated delta rule: [num_slots, value_heads, key_dim, value_dim]).

A sequence with ``input_pos`` 0 starts from the zero state, whatever its slot held before (a slot is reset
when a sequence is admitted into it); one with ``input_pos`` > 0 continues from its slot (decode, or the next
chunk of a chunked prefill). After the call the slot holds the state after the sequence's new tokens; a
sequence without new tokens (``seq_lens`` 0, padding) leaves its slot alone. Decode-only batches (one token
per sequence) run as one batched step; other batches run sequence by sequence.
"""

from __future__ import annotations

import torch

from .ssm import (
    conv_over_window,
    delta_rule_inputs,
    delta_rule_steps,
    discretize_dt,
    discretize_ssd_dt,
    scan_epilogue,
    selective_scan_steps,
    ssd_epilogue,
    ssd_scan_steps,
)


def _stream(t: torch.Tensor | None, trailing: int = 1) -> torch.Tensor | None:
    """``t`` with its leading dims flattened into the token stream: [tokens, *its last ``trailing`` dims]."""
    return None if t is None else t.reshape(-1, *t.shape[t.dim() - trailing:])


def _decode_only(num_tokens: int, seq_lens: torch.Tensor) -> bool:
    return num_tokens == seq_lens.numel() and bool((seq_lens == 1).all())


def _starting_states(state: torch.Tensor, slots: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """The states the sequences continue from: their slot's, or zeros for a sequence just admitted."""
    held = state.index_select(0, slots)
    fresh = (input_pos == 0).view(-1, *([1] * (held.dim() - 1)))
    return held.masked_fill(fresh, 0)


def _segments(seq_lens: torch.Tensor, input_pos: torch.Tensor, slot_idx: torch.Tensor):
    """(token slice, continues from the slot, slot) of each sequence with new tokens."""
    start = 0
    for length, pos, slot in zip(seq_lens.tolist(), input_pos.tolist(), slot_idx.tolist()):
        if length:
            yield slice(start, start + length), pos > 0, slot
        start += length


@torch.library.custom_op("auto_deploy::torch_cached_causal_conv1d", mutates_args=("conv_state",))
def torch_cached_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    xs = _stream(x)
    history = weight.shape[-1] - 1
    slots = slot_idx.long()
    if _decode_only(xs.shape[0], seq_lens):
        window = torch.cat([_starting_states(conv_state, slots, input_pos), xs[:, :, None].to(conv_state.dtype)], -1)
        conv_state.index_copy_(0, slots, window[:, :, 1:])
        out = conv_over_window(window, weight, bias)[:, :, 0]
        return out.to(x.dtype).reshape(x.shape)
    out = torch.empty_like(xs)
    for tokens, continues, slot in _segments(seq_lens, input_pos, slots):
        held = conv_state[slot] if continues else conv_state.new_zeros(conv_state.shape[1:])
        window = torch.cat([held, xs[tokens].t().to(conv_state.dtype)], dim=-1)  # [channels, history + length]
        conv_state[slot] = window[:, window.shape[-1] - history:]
        out[tokens] = conv_over_window(window[None], weight, bias)[0].t().to(x.dtype)
    return out.reshape(x.shape)


@torch_cached_causal_conv1d.register_fake
def _torch_cached_causal_conv1d_fake(x, weight, bias, conv_state, seq_lens, input_pos, slot_idx):
    return torch.empty_like(x)


@torch.library.custom_op("auto_deploy::torch_cached_selective_scan", mutates_args=("ssm_state",))
def torch_cached_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    ssm_state: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    xs, dts, Bs, Cs, zs = (_stream(t) for t in (x, dt, B, C, z))
    dts = discretize_dt(dts, dt_bias, dt_softplus)
    slots = slot_idx.long()
    if _decode_only(xs.shape[0], seq_lens):  # every sequence one step: the batch is the scan's batch
        start = _starting_states(ssm_state, slots, input_pos).float()
        y, state = selective_scan_steps(xs[:, None], dts[:, None], A, Bs[:, None], Cs[:, None], start)
        ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
        return scan_epilogue(y[:, 0], xs, D, zs).reshape(x.shape)
    out = torch.empty_like(xs)
    for tokens, continues, slot in _segments(seq_lens, input_pos, slots):
        held = ssm_state[slot].float() if continues else ssm_state.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        y, state = selective_scan_steps(xs[None, tokens], dts[None, tokens], A, Bs[None, tokens], Cs[None, tokens],
                                        held[None])
        ssm_state[slot] = state[0].to(ssm_state.dtype)
        out[tokens] = scan_epilogue(y[0], xs[tokens], D, None if zs is None else zs[tokens])
    return out.reshape(x.shape)


@torch_cached_selective_scan.register_fake
def _torch_cached_selective_scan_fake(x, dt, A, B, C, D, z, dt_bias, dt_softplus, ssm_state, seq_lens, input_pos,
                                      slot_idx):
    return torch.empty_like(x)


@torch.library.custom_op("auto_deploy::torch_cached_ssd_scan", mutates_args=("ssm_state",))
def torch_cached_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float | None,
    ssm_state: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    xs, Bs, Cs = (_stream(t, 2) for t in (x, B, C))  # [tokens, heads, head_dim], [tokens, groups, state]
    dts = discretize_ssd_dt(_stream(dt), dt_bias, dt_softplus, dt_min, dt_max)
    slots = slot_idx.long()
    if _decode_only(xs.shape[0], seq_lens):
        start = _starting_states(ssm_state, slots, input_pos).float()
        y, state = ssd_scan_steps(xs[:, None], dts[:, None], A, Bs[:, None], Cs[:, None], start)
        ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
        return ssd_epilogue(y[:, 0], xs, D).reshape(x.shape)
    out = xs.new_empty(xs.shape, dtype=torch.float32)
    for tokens, continues, slot in _segments(seq_lens, input_pos, slots):
        held = ssm_state[slot].float() if continues else ssm_state.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        y, state = ssd_scan_steps(xs[None, tokens], dts[None, tokens], A, Bs[None, tokens], Cs[None, tokens],
                                  held[None])
        ssm_state[slot] = state[0].to(ssm_state.dtype)
        out[tokens] = ssd_epilogue(y[0], xs[tokens], D)
    return out.reshape(x.shape)


@torch_cached_ssd_scan.register_fake
def _torch_cached_ssd_scan_fake(x, dt, A, B, C, D, dt_bias, dt_softplus, dt_min, dt_max, ssm_state, seq_lens,
                                input_pos, slot_idx):
    return torch.empty_like(x, dtype=torch.float32)


@torch.library.custom_op("auto_deploy::torch_cached_gated_delta_rule", mutates_args=("ssm_state",))
def torch_cached_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    qk_l2norm: bool,
    ssm_state: torch.Tensor,
    seq_lens: torch.Tensor,
    input_pos: torch.Tensor,
    slot_idx: torch.Tensor,
) -> torch.Tensor:
    # [tokens, heads, dim]; g [tokens, heads] or [tokens, heads, key dim]
    qs, ks, vs, gs = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v, g))
    qs, ks, vs, gs, bs = delta_rule_inputs(qs, ks, vs, gs, _stream(beta), qk_l2norm)
    slots = slot_idx.long()
    if _decode_only(qs.shape[0], seq_lens):
        start = _starting_states(ssm_state, slots, input_pos).float()
        out, state = delta_rule_steps(qs[:, None], ks[:, None], vs[:, None], gs[:, None], bs[:, None], start)
        ssm_state.index_copy_(0, slots, state.to(ssm_state.dtype))
        return out[:, 0].to(q.dtype).reshape(v.shape)
    out = vs.new_empty(vs.shape)
    for tokens, continues, slot in _segments(seq_lens, input_pos, slots):
        held = ssm_state[slot].float() if continues else ssm_state.new_zeros(ssm_state.shape[1:], dtype=torch.float32)
        o, state = delta_rule_steps(qs[None, tokens], ks[None, tokens], vs[None, tokens], gs[None, tokens],
                                    bs[None, tokens], held[None])
        ssm_state[slot] = state[0].to(ssm_state.dtype)
        out[tokens] = o[0]
    return out.to(q.dtype).reshape(v.shape)


@torch_cached_gated_delta_rule.register_fake
def _torch_cached_gated_delta_rule_fake(q, k, v, g, beta, qk_l2norm, ssm_state, seq_lens, input_pos, slot_idx):
    return v.new_empty(v.shape, dtype=q.dtype)
