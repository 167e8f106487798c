"""auto_deploy::torch_layernorm against torch's layer_norm and Cohere's hand-written norm; fake impl."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

layernorm = torch.ops.auto_deploy.torch_layernorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 16)])
def test_matches_torch_layer_norm(shape, affine, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    weight = torch.randn(16, generator=gen).to(dtype) if affine != "none" else None
    bias = torch.randn(16, generator=gen).to(dtype) if affine == "weight_bias" else None
    out = layernorm(x, weight, bias, 1e-5)
    expected = torch.nn.functional.layer_norm(x, [16], weight, bias, 1e-5)
    assert out.dtype == expected.dtype == dtype and out.shape == expected.shape
    tol = dict(atol=2e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **tol)


def test_matches_cohere_layernorm_bf16_exactly():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    norm = CohereLayerNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    norm = norm.to(torch.bfloat16)
    x = torch.randn(2, 5, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = norm(x)
    # Cohere multiplies by weight.float() in fp32: the op given the fp32 weight computes the same
    out = layernorm(x, norm.weight.detach().float(), None, 1e-5)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_fake_keeps_shape_and_dtype():
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(2, 3, 16, dtype=torch.bfloat16))
        w = mode.from_tensor(torch.randn(16))
        out = layernorm(x, w, None, 1e-5)
    assert out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
