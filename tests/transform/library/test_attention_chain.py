"""match_attention_chain: the attention forms of xglm, bloom, mpt, gpt-neo, openai-gpt and granite-swa on
hand-built graphs (op counts before and after, numerics in fp32 and bf16), and forms that must not match."""

import math

import pytest
import torch
import torch.nn.functional as F

import autodeploy.custom_ops  # noqa: F401
from helpers import count, export_gm, num_matches, run_transforms

aten = torch.ops.aten
ad = torch.ops.auto_deploy
BNSD = {0: torch.export.Dim("batch", min=1, max=16), 2: torch.export.Dim("seq", min=2, max=64)}
CLEANUP = ("cleanup_noop_slice", "cleanup_noop_to", "cleanup_input_constraints")
N, D = 4, 8


def _qkv(b=2, s=6, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, N, s, D, generator=gen).to(dtype) for _ in range(3))


def _causal(q):
    s = q.shape[2]
    keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    return torch.zeros(s, s, dtype=q.dtype, device=q.device).masked_fill(~keep, torch.finfo(q.dtype).min)[None, None]


def _slopes(device):  # bloom's, computed in forward from constants
    return torch.pow(torch.tensor(2.0 ** -2, device=device), torch.arange(1, N + 1, device=device))


class Bmm(torch.nn.Module):
    """xglm: q scaled before, [b*h, s, d] bmm, clamp at the dtype's min, dropout off."""

    def forward(self, q, k, v):
        b, n, s, d = q.shape
        q3, k3, v3 = ((t * 0.3 if t is q else t).reshape(b * n, -1, d) for t in (q, k, v))
        w = torch.bmm(q3, k3.transpose(1, 2)).view(b, n, s, s) + _causal(q)
        w = torch.max(w, torch.tensor(torch.finfo(w.dtype).min, device=w.device))
        p = F.softmax(w.view(b * n, s, s), dim=-1).view(b, n, s, s).view(b * n, s, s)
        return torch.bmm(F.dropout(p, p=0.1, training=False), v3).view(b, n, s, d)


class BaddbmmAlibi(torch.nn.Module):
    """bloom: ALiBi ``slopes * arange`` as baddbmm's input, repeated over the batch."""

    def forward(self, q, k, v):
        b, n, s, d = q.shape
        alibi = (_slopes(q.device)[:, None, None] * torch.arange(s, device=q.device)).to(q.dtype).repeat(b, 1, 1)
        q3, k3, v3 = (t.reshape(b * n, -1, d) for t in (q, k, v))
        w = alibi.baddbmm(batch1=q3, batch2=k3.transpose(-1, -2), beta=1.0, alpha=0.3).view(b, n, s, -1)
        p = F.softmax(w + _causal(q), dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.bmm(p.view(b * n, s, -1), v3).view(b, n, s, d)


class MaskedFillAlibi(torch.nn.Module):
    """mpt: an ALiBi table over max positions sliced to the sequence, then masked_fill."""

    def forward(self, q, k, v):
        s = q.shape[2]
        table = torch.arange(1 - 128, 1, dtype=torch.int32, device=q.device).view(1, 1, 1, 128)
        slopes = (1.0 / torch.pow(2, torch.arange(1, N + 1, device=q.device).float() * 2.0)).view(1, N, 1, 1)
        alibi = (table * slopes).squeeze(0)[:, :, 128 - s:]
        w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + alibi.to(q.dtype)
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)[None, None]
        return torch.matmul(F.softmax(w.masked_fill(mask, torch.finfo(w.dtype).min).float(), dim=-1).to(v.dtype), v)


class WhereBuffer(torch.nn.Module):
    """gpt-neo: no scale, a causal buffer applied with where, plus the additive mask."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(128, 128, dtype=torch.bool))[None, None])

    def forward(self, q, k, v):
        s = q.shape[2]
        w = torch.matmul(q, k.transpose(-1, -2))
        w = torch.where(self.bias[:, :, :s, :s], w, torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype)) + _causal(q)
        return torch.matmul(F.dropout(F.softmax(w, dim=-1), p=0.0, training=False), v)


class Multiplicative(torch.nn.Module):
    """openai-gpt: k^T by permute, div scale, ``w * b + -1e4 * (1 - b)``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(128, 128))[None, None])

    def forward(self, q, k, v):
        s = q.shape[2]
        kt = k.transpose(1, 2).permute(0, 2, 3, 1)
        w = torch.matmul(q, kt) / math.sqrt(D)
        b = self.bias[:, :, :s, :s]
        w = w * b + -1e4 * (1 - b)
        return torch.matmul(F.softmax(w, dim=-1), v)


class LseSinks(torch.nn.Module):
    """granite-swa: per-head sinks applied after the product, ``out * sigmoid(lse - sinks)``."""

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(N))

    def forward(self, q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + _causal(q)
        scale = (torch.logsumexp(w, dim=-1) - self.sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
        out = torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
        return out * scale.unsqueeze(-1).to(out.dtype)


class MaxSub(torch.nn.Module):
    """mimo-v2: the row max subtracted before the softmax."""

    def forward(self, q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.3 + _causal(q)
        w = w - w.max(dim=-1, keepdim=True).values
        return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


FORMS = {"bmm": (Bmm, 1.0), "baddbmm_alibi": (BaddbmmAlibi, 0.3), "masked_fill_alibi": (MaskedFillAlibi, 0.3),
         "where_buffer": (WhereBuffer, 1.0), "multiplicative": (Multiplicative, 1 / math.sqrt(D)),
         "lse_sinks": (LseSinks, 0.3), "max_sub": (MaxSub, 0.3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", list(FORMS))
def test_form_matched(form, dtype):
    torch.manual_seed(0)
    cls, scale = FORMS[form]
    module = cls().to(dtype)
    args = _qkv(dtype=dtype)
    gm = export_gm(module, *args, dims=BNSD, strict=False, cleanup=CLEANUP)
    assert count(gm, aten.softmax.int) + count(gm, aten._softmax.default) == 1
    gm = run_transforms(gm, ["match_attention_chain"], "pattern_matcher")
    assert num_matches(gm, "match_attention_chain") == 1
    for op in (aten.softmax.int, aten._softmax.default, aten.matmul.default, aten.bmm.default, aten.baddbmm.default,
               aten.logsumexp.default, aten.dropout.default, aten.max.dim):
        assert count(gm, op) == 0, op
    (node,) = gm.graph.find_nodes(op="call_function", target=ad.torch_attention.default)
    assert node.kwargs["scale"] == pytest.approx(scale)
    assert node.kwargs["is_causal"] is True
    assert (node.kwargs.get("alibi_slopes") is not None) == form.endswith("alibi")
    assert (node.kwargs["sinks"] is not None) == (form == "lse_sinks")
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for seed, (b, s) in enumerate([(2, 6), (1, 9)]):  # the dynamic dims too
        a = _qkv(b=b, s=s, dtype=dtype, seed=seed)
        torch.testing.assert_close(gm(*a)[0], module(*a), **tol)


class LearnedBias(torch.nn.Module):
    """A learned per-head bias (T5-like): not a mask and not ALiBi."""

    def __init__(self):
        super().__init__()
        self.rel = torch.nn.Parameter(torch.randn(1, N, 128, 128))

    def forward(self, q, k, v):
        s = q.shape[2]
        w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + self.rel[:, :, :s, :s]
        return torch.matmul(F.softmax(w + _causal(q), dim=-1), v)


class LearnedSlopes(torch.nn.Module):
    """``slopes * arange`` with learned slopes: the bias depends on a parameter."""

    def __init__(self):
        super().__init__()
        self.slopes = torch.nn.Parameter(torch.rand(N))

    def forward(self, q, k, v):
        s = q.shape[2]
        bias = self.slopes[:, None, None] * torch.arange(s, device=q.device)
        w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + bias
        return torch.matmul(F.softmax(w + _causal(q), dim=-1), v)


class QueryBias(torch.nn.Module):
    """A bias that varies along the query axis (``slopes * i``): not ALiBi's form."""

    def forward(self, q, k, v):
        s = q.shape[2]
        bias = _slopes(q.device)[:, None, None] * torch.arange(s, device=q.device)[:, None]
        w = torch.matmul(q, k.transpose(-1, -2)) * 0.3 + bias
        return torch.matmul(F.softmax(w + _causal(q), dim=-1), v)


class SoftmaxDim1(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.matmul(F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.3, dim=1), v)


class DataScale(torch.nn.Module):
    """Scores scaled by a tensor computed from the inputs: not a literal scale and not a mask."""

    def forward(self, q, k, v):
        w = torch.matmul(q, k.transpose(-1, -2)) * q.mean(-1, keepdim=True)
        return torch.matmul(F.softmax(w, dim=-1), v)


@pytest.mark.parametrize("cls", [LearnedBias, LearnedSlopes, QueryBias, SoftmaxDim1, DataScale])
def test_not_matched(cls):
    torch.manual_seed(0)
    module = cls()
    args = _qkv()
    gm = export_gm(module, *args, dims=BNSD, strict=False, cleanup=CLEANUP)
    matmuls = count(gm, aten.matmul.default)
    gm = run_transforms(gm, ["match_attention_chain"], "pattern_matcher")
    assert num_matches(gm, "match_attention_chain") == 0
    assert count(gm, ad.torch_attention.default) == 0 and count(gm, aten.matmul.default) == matmuls
    torch.testing.assert_close(gm(*args)[0], module(*args))
