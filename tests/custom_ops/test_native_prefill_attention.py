"""The native prompt attention (``auto_deploy::prefill_attention``): causal attention of a fresh sequence over its
own keys matches its plain-torch implementation (SDPA) on every build this CPU runs, for GQA, MQA and MHA, head
sizes, lengths across the kernel's blocks of 16 positions, and strided inputs; cached attention takes it for a
fresh prompt and still matches uncached attention."""

import pytest
import torch

from autodeploy.custom_ops import native
from autodeploy.custom_ops.cached_attention import cached_attention_reference, prefill_attention_reference

ops = torch.ops.auto_deploy


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,v_dim",
                         [(128, 12, 4, 64, 64), (1, 4, 2, 64, 64), (37, 8, 8, 32, 32), (200, 6, 1, 128, 128),
                          (17, 4, 2, 64, 32)])
def test_matches_sdpa(kernels, tokens, heads, kv_heads, head_dim, v_dim):
    torch.manual_seed(tokens)
    q = torch.randn(tokens, heads, head_dim) * 2
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, v_dim)
    scale = head_dim ** -0.5
    out = ops.prefill_attention(q, k, v, scale)
    torch.testing.assert_close(out, prefill_attention_reference(q, k, v, scale), atol=2e-6, rtol=1e-5)


def test_reads_strided_inputs(kernels):
    torch.manual_seed(0)
    qkv = torch.randn(50, (8 + 2 * 2) * 64)  # the three as views of one fused product's output
    q, k, v = (t.view(50, -1, 64) for t in qkv.split([8 * 64, 2 * 64, 2 * 64], -1))
    torch.testing.assert_close(ops.prefill_attention(q, k, v, 0.125), prefill_attention_reference(q, k, v, 0.125),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.skipif(not native.prefill_attention_available(), reason="the native kernels do not run here")
def test_cached_attention_of_a_fresh_prompt_matches_uncached_attention():
    torch.manual_seed(1)
    tokens, heads, kv_heads, dim, page = 45, 6, 2, 64, 16
    q, k, v = torch.randn(1, tokens, heads, dim), torch.randn(1, tokens, kv_heads, dim), torch.randn(1, tokens,
                                                                                                    kv_heads, dim)
    k_cache, v_cache = torch.zeros(8, page, kv_heads, dim), torch.zeros(8, page, kv_heads, dim)
    out = cached_attention_reference(q, k, v, k_cache, v_cache, torch.tensor([tokens]), torch.tensor([0]),
                                     torch.tensor([[5, 2, 7]]))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(k_cache[[5, 2, 7]].reshape(-1, kv_heads, dim)[:tokens], k[0])  # the cache written


def test_bad_inputs_are_named():
    if not native.prefill_attention_available():
        pytest.skip("the native kernels do not run here")
    with pytest.raises(RuntimeError, match="prefill_attention: needs float32"):
        ops.prefill_attention(torch.randn(4, 3, 64), torch.randn(4, 2, 64), torch.randn(4, 2, 64), 0.1)
