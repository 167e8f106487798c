"""A representative architecture per family through the coverage program's checks (export, canonical,
logits vs HF, greedy generate vs HF), in this process. One fast family; the rest are slow."""

import pytest

from autodeploy.coverage import STEPS, check_architecture

ALL = dict.fromkeys(STEPS, True)

#: family representative -> the columns it must pass (all of them unless stated), and why it is here
FAMILIES = {
    "gpt2": ALL,            # learned positions, nn.LayerNorm with bias -> torch_layernorm
    "llama": ALL,           # rotate_half RoPE, RMSNorm, GQA
    "qwen3": ALL,           # q/k RMSNorms over heads
    "mixtral": ALL,         # MoE
    "phi3": ALL,            # fused qkv / gate_up
    "gpt_neox": ALL,        # partial rotary, parallel residual, LayerNorm
    "gptj": ALL,            # interleaved partial rotary (rotate_every_two)
    "cohere": ALL,          # interleaved RoPE, Cohere's decomposed bias-free LayerNorm
    "falcon": ALL,          # list indices in forward: tensor constants exported off the meta device
    "nanochat": ALL,        # flipped rotate_half, weightless RMSNorm
    "gemma4_text": ALL,     # q's rope used before k is projected
    "deepseek_v2": ALL,     # MLA: complex-frequency rope on q's rope slice and the shared k head, v head dim of its own
    "deepseek_v3": ALL,     # MLA: de-interleaving rope, K built by slice copies, grouped top-k MoE
    "mamba": ALL,           # state space: conv1d + selective scan ops, a state cache beside the KV cache
    "jamba": ALL,           # Mamba-1 layers beside attention and MoE layers
    "bamba": ALL,           # Mamba-2 (SSD scan) layers beside attention layers
    "lfm2": ALL,            # short-convolution layers (match_causal_conv1d) beside attention layers
    "qwen3_next": ALL,      # Gated DeltaNet layers (torch_gated_delta_rule) beside attention, MoE
    "bloom": ALL,           # ALiBi as baddbmm's input, [b*h, s, d] bmm attention -> alibi_slopes
    "mpt": ALL,             # ALiBi table sliced to the sequence, masked_fill mask
    "gpt_neo": ALL,         # unscaled scores, where() causal buffer, local (sliding-window) layers
    "xglm": ALL,            # q scaled before the bmm, clamp at the dtype's min
    "granite_swa": ALL,     # sinks applied after the product (sigmoid(lse - sink)), sliding-window layers
    "mimo_v2_flash": ALL,   # x - max(x) before the softmax; v head_dim != q head_dim
    "hrm_text": ALL,        # no_grad reasoning cycles inside forward (exported under no_grad)
    "gemma3n_text": ALL,    # a linear whose input is a linear (native_linear keeps the order)
    "beam": ALL,            # NoPE full-attention layers (rope expected in the RoPE layers only)
}
FAST = {"gpt2"}


@pytest.mark.parametrize(
    "arch", [a if a in FAST else pytest.param(a, marks=pytest.mark.slow) for a in FAMILIES]
)
def test_family(arch, tmp_path):
    result = check_architecture(arch, tmp_path)
    got = {step: bool(getattr(result, step)) for step in STEPS}
    assert got == FAMILIES[arch], result.reason
