"""auto_deploy::torch_rmsnorm against HF's LlamaRMSNorm; dtypes; fake (meta) implementation."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

rmsnorm = torch.ops.auto_deploy.torch_rmsnorm


def _hf_norm(hidden: int, eps: float, weight: torch.Tensor, dtype: torch.dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 16), (2, 5, 4, 16)])
def test_matches_hf_llama_rmsnorm(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).to(dtype)
    weight = torch.randn(16, generator=gen)
    norm = _hf_norm(16, 1e-6, weight, dtype)
    with torch.no_grad():
        expected = norm(x)
    out = rmsnorm(x, norm.weight.detach(), 1e-6)
    assert out.dtype == expected.dtype == dtype
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the same computation, bit for bit


def test_straightforward_math_fp32():
    x, w = torch.randn(4, 8), torch.randn(8)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), expected)


def test_fp32_weight_on_bf16_input_promotes():
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(8) + 1
    out = rmsnorm(x, w, 1e-6)
    assert out.dtype == torch.float32
    x32 = x.float()
    torch.testing.assert_close(out, w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16())


@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_fake_impl_shapes_and_dtypes(x_dtype, w_dtype):
    with FakeTensorMode():
        x = torch.empty(2, 7, 3, 16, dtype=x_dtype)
        out = rmsnorm(x, torch.empty(16, dtype=w_dtype), 1e-6)
    assert out.shape == (2, 7, 3, 16) and out.dtype == torch.promote_types(x_dtype, w_dtype)


def test_opcheck():
    torch.library.opcheck(rmsnorm, (torch.randn(3, 8), torch.randn(8), 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weightless(dtype):
    x = torch.randn(2, 5, 16).to(dtype)
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = rmsnorm(x, None, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    with FakeTensorMode() as mode:
        fake = rmsnorm(mode.from_tensor(x), None, 1e-6)
    assert fake.shape == x.shape and fake.dtype == dtype
