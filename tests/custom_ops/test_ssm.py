"""auto_deploy::torch_causal_conv1d and torch_selective_scan against HF's Mamba functions and mixers (fp32,
bf16); their fake implementations under export with a dynamic sequence dim; the mixer export patch."""

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.export.patches.mamba import is_mamba1_mixer, mamba_mixer_forward

ops = torch.ops.auto_deploy


def _mixer(arch: str, dtype: torch.dtype, seed: int = 0):
    """An HF Mamba-1 mixer of ``arch`` with random weights."""
    from transformers import CONFIG_MAPPING
    from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
    from transformers.models.mamba.modeling_mamba import MambaMixer

    config = CONFIG_MAPPING[arch](hidden_size=32, state_size=8, intermediate_size=48, num_hidden_layers=1,
                                  time_step_rank=4, conv_kernel=4)
    torch.manual_seed(seed)
    mixer = {"mamba": MambaMixer, "falcon_mamba": FalconMambaMixer}[arch](config, 0, initialize_mixer_weights=False)
    with torch.no_grad():  # random, larger weights than HF's init so every term matters; A < 0 as in HF
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.copy_(torch.log(torch.arange(1.0, 9.0)).expand(48, 8) + mixer.A_log * 0.1)
    return mixer.to(dtype).eval()


def test_causal_conv1d_matches_hf():
    from transformers.models.mamba.modeling_mamba import causal_conv1d_fn

    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(2, 7, 6, generator=gen), torch.randn(6, 1, 4, generator=gen), torch.randn(6)
    expected = causal_conv1d_fn(x.transpose(1, 2), weight.squeeze(1), bias).transpose(1, 2)
    torch.testing.assert_close(ops.torch_causal_conv1d(x, weight, bias), expected)
    # causal: the output at t does not depend on inputs after t
    changed = x.clone()
    changed[:, 4:] += 1.0
    torch.testing.assert_close(ops.torch_causal_conv1d(changed, weight, None)[:, :4],
                               ops.torch_causal_conv1d(x, weight, None)[:, :4])


def test_selective_scan_matches_hf():
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    gen = torch.Generator().manual_seed(0)
    b, s, d, n = 2, 9, 6, 4
    x, dt, z = (torch.randn(b, s, d, generator=gen) for _ in range(3))
    B, C = torch.randn(b, s, n, generator=gen), torch.randn(b, s, n, generator=gen)
    A = -torch.rand(d, n, generator=gen) * 2 - 0.1
    D, dt_bias = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    expected = mamba_selective_scan(x.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
                                    D=D, z=z.transpose(1, 2), delta_bias=dt_bias, delta_softplus=True)
    out = ops.torch_selective_scan(x, dt, A, B, C, D, z, dt_bias, True)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_selective_scan_rejects_a_of_the_wrong_shape():
    x = torch.randn(1, 3, 6)
    with pytest.raises(ValueError, match="A must be"):
        ops.torch_selective_scan(x, x, torch.randn(4, 2), torch.randn(1, 3, 2), torch.randn(1, 3, 2))


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mixer_through_the_ops_matches_hf_mixer(arch, dtype, atol):
    mixer = _mixer(arch, dtype)
    assert is_mamba1_mixer(mixer)
    x = torch.randn(2, 11, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = mixer(x)
        out = mamba_mixer_forward(mixer, x)
    assert out.dtype == expected.dtype == dtype
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol * max(scale, 1.0), rtol=0)


def test_mixer_exports_with_a_dynamic_sequence_through_the_patch():
    from autodeploy.export.patches import apply_export_patches

    mixer = _mixer("mamba", torch.float32)
    model = torch.nn.Sequential(mixer)
    x = torch.randn(2, 5, 32)
    seq = torch.export.Dim("seq", min=1, max=64)
    with pytest.raises(Exception, match="(?i)constraints violated|specializ|guard"):  # HF's loop over seq
        torch.export.export(model, (x,), dynamic_shapes=({1: seq},))
    with apply_export_patches(model, None, ["mamba_mixer_ops"]) as applied:
        assert applied == ["mamba_mixer_ops"]
        program = torch.export.export(model, (x,), dynamic_shapes=({1: seq},))
    assert "forward" not in vars(mixer)  # restored: the class's forward again
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.torch_causal_conv1d.default) == targets.count(ops.torch_selective_scan.default) == 1
    longer = torch.randn(2, 13, 32)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(longer), mixer(longer), atol=1e-5, rtol=1e-5)


def test_non_mixers_are_not_patched():
    assert not is_mamba1_mixer(torch.nn.Linear(4, 4))
    mixer = _mixer("mamba", torch.float32)
    mixer.D = torch.nn.Parameter(torch.ones(7))  # D of the wrong size: not what a Mamba-1 mixer holds
    assert not is_mamba1_mixer(mixer)


# -- Mamba-2 ------------------------------------------------------------------------------------
def _mamba2_mixer(dtype: torch.dtype, seed: int = 0):
    """An HF Bamba (Mamba-2) mixer: 8 heads of 12 channels in 2 groups, state 16, random weights."""
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer

    config = BambaConfig(hidden_size=48, num_hidden_layers=1, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
                         mamba_chunk_size=4, time_step_limit=(0.01, 2.0))
    torch.manual_seed(seed)
    mixer = BambaMixer(config, 0, initialize_mixer_weights=False)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.copy_(torch.log(torch.arange(1.0, 9.0)))
    return mixer.to(dtype).eval()


def test_ssd_scan_matches_hf_chunked_scan():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    gen = torch.Generator().manual_seed(0)
    b, s, h, p, g, n = 2, 11, 4, 3, 2, 5
    x, dt = torch.randn(b, s, h, p, generator=gen), torch.randn(b, s, h, generator=gen)
    B, C = torch.randn(b, s, g, n, generator=gen), torch.randn(b, s, g, n, generator=gen)
    A, D, dt_bias = -torch.rand(h, generator=gen) - 0.1, torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    for limit in ((0.0, float("inf")), (0.05, 0.5)):
        # chunks of 4 over 11 positions: HF's padding and inter-chunk recurrence are exercised
        expected = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=4, D=D, dt_bias=dt_bias, dt_softplus=True,
                                     dt_limit=limit)
        dt_max = None if limit[1] == float("inf") else limit[1]
        out = ops.torch_ssd_scan(x, dt, A, B, C, D, dt_bias, True, limit[0], dt_max)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_ssd_scan_rejects_heads_not_a_multiple_of_the_groups():
    x = torch.randn(1, 3, 3, 2)
    with pytest.raises(ValueError, match="multiple of B's groups"):
        ops.torch_ssd_scan(x, torch.randn(1, 3, 3), -torch.rand(3), torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mamba2_mixer_through_the_ops_matches_hf_mixer(dtype, atol):
    from autodeploy.export.patches.mamba import is_mamba2_mixer, mamba2_mixer_forward

    mixer = _mamba2_mixer(dtype)
    assert is_mamba2_mixer(mixer) and not is_mamba1_mixer(mixer)
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = mixer(x)
        out = mamba2_mixer_forward(mixer, x)
    assert out.dtype == expected.dtype == dtype
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol * max(scale, 1.0), rtol=0)


def test_mamba2_mixer_exports_with_a_dynamic_sequence_through_the_patch():
    from autodeploy.export.patches import apply_export_patches

    mixer = _mamba2_mixer(torch.float32)
    model = torch.nn.Sequential(mixer)
    seq = torch.export.Dim("seq", min=1, max=64)
    with apply_export_patches(model, None, ["mamba_mixer_ops"]):
        program = torch.export.export(model, (torch.randn(2, 5, 48),), dynamic_shapes=({1: seq},))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.torch_ssd_scan.default) == targets.count(ops.torch_causal_conv1d.default) == 1
    longer = torch.randn(2, 13, 48)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(longer), mixer(longer), atol=1e-5, rtol=1e-5)


# -- gated delta rule -----------------------------------------------------------------------------
def _delta_inputs(dtype=torch.float32, b=2, s=10, hk=2, hv=4, dk=8, dv=6):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, s, hk, dk, generator=gen), torch.randn(b, s, hk, dk, generator=gen)
    v = torch.randn(b, s, hv, dv, generator=gen)
    g = -torch.rand(b, s, hv, generator=gen) * 2  # log decay < 0
    beta = torch.rand(b, s, hv, generator=gen)
    return tuple(t.to(dtype) for t in (q, k, v)) + (g, beta.to(dtype))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gated_delta_rule_matches_hf_chunked_rule(dtype, atol):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _delta_inputs(dtype)
    # chunks of 4 over 10 positions: HF's padding and inter-chunk recurrence are exercised
    expected, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=4, use_qk_l2norm_in_kernel=True)
    out = ops.torch_gated_delta_rule(q, k, v, g, beta, True)
    assert out.dtype == expected.dtype == dtype and out.shape == v.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=atol)


def test_gated_delta_rule_rejects_value_heads_not_a_multiple_of_key_heads():
    q, k, v, g, beta = _delta_inputs(hv=3)
    with pytest.raises(ValueError, match="multiple of the q/k heads"):
        ops.torch_gated_delta_rule(q, k, v, g[..., :3], beta[..., :3], True)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_text", "olmo_hybrid"])  # the three projection layouts
def test_gated_delta_net_through_the_ops_matches_hf_mixer(arch):
    from transformers import CONFIG_MAPPING
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from autodeploy.export.patches.gated_delta import gated_delta_net_forward, is_gated_delta_net

    config = CONFIG_MAPPING[arch](hidden_size=32, num_hidden_layers=2, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                                  layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    classes = {"qwen3_next": Qwen3NextGatedDeltaNet, "qwen3_5_text": Qwen3_5GatedDeltaNet,
               "olmo_hybrid": OlmoHybridGatedDeltaNet}
    mixer = classes[arch](config, 0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    assert is_gated_delta_net(mixer) and not is_mamba1_mixer(mixer)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gated_delta_net_forward(mixer, x), mixer(x), atol=1e-5, rtol=1e-5)


def test_gated_delta_rule_with_a_decay_per_key_channel_matches_hf_kimi_rule():
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    q, k, v, _, beta = _delta_inputs(hk=4, hv=4)
    g = -torch.rand(*k.shape, generator=torch.Generator().manual_seed(3))  # [b, s, heads, dk]
    expected, _ = chunk_kimi_delta_attention(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                             use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ops.torch_gated_delta_rule(q, k, v, g, beta, True), expected, atol=1e-5, rtol=1e-5)


def test_kimi_delta_attention_through_the_ops_matches_hf_mixer():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    from autodeploy.export.patches.gated_delta import (
        is_gated_delta_net,
        is_kimi_delta_attention,
        kimi_delta_attention_forward,
    )

    config = KimiLinearConfig(hidden_size=32, num_hidden_layers=2, linear_num_heads=4, linear_head_dim=8,
                              layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    mixer = KimiLinearDeltaAttention(config, 0).eval()
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    assert is_kimi_delta_attention(mixer) and not is_gated_delta_net(mixer)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(kimi_delta_attention_forward(mixer, x), mixer(x), atol=1e-5, rtol=1e-5)


def test_zamba_mixer_through_the_ops_matches_hf_mixer():
    """Zamba's multi-head Mamba-1 mixer: one selective scan per head."""
    from transformers import ZambaConfig
    from transformers.models.zamba.modeling_zamba import ZambaMambaMixer

    from autodeploy.export.patches.mamba import is_mamba2_mixer, is_zamba_mixer, zamba_mixer_forward

    config = ZambaConfig(hidden_size=32, num_hidden_layers=2, n_mamba_heads=2, mamba_d_state=8,
                         layers_block_type=["linear_attention", "hybrid"])
    torch.manual_seed(0)
    mixer = ZambaMambaMixer(config, 0).eval()
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            if name != "A_log":
                p.copy_(torch.randn_like(p) * 0.3)
    assert is_zamba_mixer(mixer) and not is_mamba1_mixer(mixer) and not is_mamba2_mixer(mixer)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(zamba_mixer_forward(mixer, x), mixer(x), atol=1e-5, rtol=1e-5)
