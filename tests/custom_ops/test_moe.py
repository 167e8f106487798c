"""auto_deploy::torch_moe against a per-token loop over the routed experts; dtypes; fake implementation."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

moe = torch.ops.auto_deploy.torch_moe
E, H, INTER, K = 4, 16, 8, 2


def _inputs(tokens: int, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    logits = torch.randn(tokens, E, generator=gen)
    weights, selected = torch.topk(logits.softmax(-1), K)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=gen) / H**0.5).to(dtype)
    down = (torch.randn(E, H, INTER, generator=gen) / INTER**0.5).to(dtype)
    return x, selected, weights, gate_up, down


def _per_token_reference(x, selected, weights, gate_up, down):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(selected.shape[1]):
            e = int(selected[t, k])
            if e >= gate_up.shape[0]:
                continue
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, k]) * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_matches_per_token_loop_fp32(tokens):
    args = _inputs(tokens)
    out = moe(*args)
    assert out.shape == (tokens, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _per_token_reference(*args), atol=1e-5, rtol=1e-5)


def test_bf16():
    args = _inputs(9, torch.bfloat16)
    out = moe(*args)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _per_token_reference(*args), atol=3e-2, rtol=3e-2)


def test_routing_weights_in_other_dtype():
    x, selected, weights, gate_up, down = _inputs(6)
    out = moe(x, selected, weights.double(), gate_up, down)
    torch.testing.assert_close(out, moe(x, selected, weights, gate_up, down))


def test_sentinel_ids_are_ignored():
    x, selected, weights, gate_up, down = _inputs(6)
    sentinel = selected.clone()
    sentinel[:, 1] = E  # expert-parallel sentinel: not an expert of this rank
    expected = _per_token_reference(x, selected[:, :1], weights[:, :1], gate_up, down)
    torch.testing.assert_close(moe(x, sentinel, weights, gate_up, down).double(), expected, atol=1e-5, rtol=1e-5)


def test_unrouted_tokens_are_zero():
    x, selected, weights, gate_up, down = _inputs(4)
    out = moe(x, torch.full_like(selected, E), weights, gate_up, down)
    assert torch.equal(out, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_impl_shape(dtype):
    with FakeTensorMode():
        x = torch.empty(11, H, dtype=dtype)
        out = moe(x, torch.empty(11, K, dtype=torch.int64), torch.empty(11, K),
                  torch.empty(E, 2 * INTER, H, dtype=dtype), torch.empty(E, H, INTER, dtype=dtype))
    assert out.shape == (11, H) and out.dtype == dtype


def test_opcheck():
    torch.library.opcheck(moe, _inputs(5))
