"""``auto_deploy::torch_int8_linear``: a linear layer with int8 weights (weight-only quantization).

    torch_int8_linear(x, weight_int8 [N, K], scale [N], bias=None) -> x @ (weight_int8 * scale[:, None]).T + bias

Weights are quantized per output channel, symmetric (:func:`quantize_per_channel_int8`): 4x fewer weight
bytes to read per token than fp32, which is what bounds decode speed on CPU. Below
:data:`DEQUANT_MIN_ROWS` rows (decode) the product uses torch's int8 weight-only kernel
(``aten._weight_int8pack_mm``), whose activations and output are bfloat16 with fp32 accumulation; the op
casts back, so the graph around it keeps the activation dtype (norms, attention and residuals stay in
fp32). Prompt-sized inputs are compute-bound instead: there the weights are dequantized a chunk at a time
and the product is a dense one in the activation dtype (measured 1.3x the fp32 time against 2.1x for the
kernel at 128 rows). The scales are rounded to bfloat16 before quantizing, so the kernel uses them
exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_KERNEL_DTYPE = torch.bfloat16
_ROWS_PER_CHUNK = 1024


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] -> (int8 [N, K], bfloat16 scale [N]) with ``weight ~= q * scale[:, None]``."""
    weight = weight.detach()
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=_KERNEL_DTYPE, device=weight.device)
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):  # chunks: fp32 temporaries stay small
        rows = weight[start : start + _ROWS_PER_CHUNK].to(torch.float32, copy=True)  # never edit the original
        s = (rows.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(_KERNEL_DTYPE)
        q[start : start + _ROWS_PER_CHUNK] = rows.div_(s.float()[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        scale[start : start + _ROWS_PER_CHUNK] = s
    return q, scale


#: from this many rows on (prompts), dequantizing weight chunks for the dense product beats the int8 kernel
DEQUANT_MIN_ROWS = 64
#: weight elements dequantized at a time on that path (4 MB of fp32: stays in cache, no page faults)
_DEQUANT_CHUNK_ELEMS = 1 << 20


def _dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x @ (weight * scale).T`` in x's dtype, the weights dequantized a chunk of rows at a time."""
    rows = max(1, _DEQUANT_CHUNK_ELEMS // weight.shape[1])
    scale = scale.to(x.dtype)[:, None]
    # int8 * float promotes to float: no separate cast of the chunk
    parts = [F.linear(x, weight[i : i + rows] * scale[i : i + rows]) for i in range(0, weight.shape[0], rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


@torch.library.custom_op("auto_deploy::torch_int8_linear", mutates_args=())
def torch_int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] >= DEQUANT_MIN_ROWS:  # a prompt: compute-bound, the dense kernel is 2x faster
        out = _dequantized_linear(rows, weight, scale)
    else:
        out = torch.ops.aten._weight_int8pack_mm(rows.to(_KERNEL_DTYPE), weight, scale.to(_KERNEL_DTYPE)).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@torch_int8_linear.register_fake
def _torch_int8_linear_fake(x, weight, scale, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


#: products with at most this many rows take the multiply-and-sum form under torch.compile
GEMV_MAX_ROWS = 1


def int8_linear_for_compile(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch_int8_linear`` as the graph should read it under ``torch.compile``.

    A one-row product (batch-1 decode) becomes a multiply-and-sum over K in fp32, which Inductor turns
    into one fused loop reading each int8 weight once, with the activation's producer (e.g. the RMSNorm)
    fused in: about twice as fast as the kernel inside a decode step, and more precise (fp32 activations
    instead of bfloat16). Inductor's loop order for that form degrades quickly with more rows, so those
    keep the op (its kernel)."""
    rows = x.numel() // x.shape[-1]
    if rows > GEMV_MAX_ROWS:
        return torch.ops.auto_deploy.torch_int8_linear(x, weight, scale, bias)
    out = (x.float().unsqueeze(-2) * weight.float()).sum(-1) * scale.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
