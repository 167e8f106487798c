"""quantize_weights with dtype bf16 / fp16 / int4: op counts and freed bytes, numerics against the
unquantized graph, exclude, int4's in-features rule, fuse_gemms after each, config errors naming the key, a
bf16 checkpoint kept in bf16 by load_weights (no fp32 copy of its linear weights), and the LLM end to end."""

import pytest
import torch

import autodeploy
from autodeploy import LLM, SamplingParams
from autodeploy.custom_ops import native
from autodeploy.custom_ops.int4_linear import dequantize_int4, int4_decode_reference
from autodeploy.errors import ConfigError
from autodeploy.transform import transform_history
from helpers import count, run_transform
from tiny_models import hf_reference, make_config, random_batch

aten = torch.ops.aten
HALF = torch.ops.auto_deploy.half_linear.default
HALF_PACKED = torch.ops.auto_deploy.half_packed_linear.default  # a whole pipeline packs them where builds read panels
INT4 = torch.ops.auto_deploy.int4_linear.default
INT4_PACKED = torch.ops.auto_deploy.int4_packed_linear.default  # a whole pipeline packs int4 where kernels read tiles
INT8 = torch.ops.auto_deploy.torch_int8_linear.default
OPS = {"bf16": HALF, "fp16": HALF, "int4": INT4, "int8": INT8}
LAYERS = 2
LINEARS = 7 * LAYERS + 1
#: the products of a whole pipeline: fuse_gemms (on by default) makes q/k/v and gate/up one product each
FUSED = 4 * LAYERS + 1
# bounds on |logits - fp32 logits| / std(fp32 logits) on the tiny llama's batch below (std 0.16), 1.5x the
# measured max / mean: bf16 0.0102 / 0.0020, fp16 0.0015 / 0.00024, int4 (group 32) 0.55 / 0.098 (int8 for
# comparison: 0.036 / 0.0073)
MAX_ERR = {"bf16": 0.015, "fp16": 0.0022, "int4": 0.8}
MEAN_ERR = {"bf16": 0.003, "fp16": 0.0004, "int4": 0.15}


def _tensors(gm):
    return {**dict(gm.named_parameters()), **dict(gm.named_buffers())}


def _logits(gm, ids, pos):
    with torch.no_grad():
        return gm(ids, pos)[0]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    path = tiny_checkpoint("llama")

    def make():
        return autodeploy.optimize(path, until="weight_load")

    return make


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "int4"])
def test_counts_bytes_and_numerics(loaded, dtype):
    gm = loaded()
    ids, pos = random_batch(4, 16, seed=1)
    plain = _logits(gm, ids, pos)
    weights = {n.args[1].target: _tensors(gm)[n.args[1].target]
               for n in gm.graph.find_nodes(op="call_function", target=aten.linear.default)}
    assert len(weights) == LINEARS
    before = sum(t.numel() * t.element_size() for t in _tensors(gm).values())
    gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype=dtype)
    assert count(gm, aten.linear.default) == 0 and count(gm, OPS[dtype]) == LINEARS
    assert transform_history(gm)["quantize_weights"].info.num_matches == LINEARS
    tensors = _tensors(gm)
    assert not set(weights) & set(tensors)  # the fp32 originals are gone
    after = sum(t.numel() * t.element_size() for t in tensors.values())
    fp32 = sum(w.numel() * 4 for w in weights.values())
    if dtype == "int4":
        new = sum(w.numel() // 2 + w.numel() // 32 * 2 for w in weights.values())  # nibbles + bf16 scales
        for node in gm.graph.find_nodes(op="call_function", target=INT4):
            q, scale = tensors[node.args[1].target], tensors[node.args[2].target]
            assert node.args[3] == 32 and q.dtype == torch.uint8 and scale.dtype == torch.bfloat16
            assert scale.shape == (q.shape[0], q.shape[1] * 2 // 32)
    else:
        new = fp32 // 2
        for node in gm.graph.find_nodes(op="call_function", target=HALF):
            assert tensors[node.args[1].target].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert after == before - fp32 + new
    out = _logits(gm, ids, pos)
    assert out.dtype == torch.float32
    std, err = float(plain.std()), (out - plain).abs()
    assert 0 < float(err.mean()) < MEAN_ERR[dtype] * std, (float(err.mean()) / std)
    assert float(err.max()) < MAX_ERR[dtype] * std, (float(err.max()) / std)


def test_bf16_is_the_rounded_weights_in_fp32(loaded):
    """bf16 weights with fp32 arithmetic: the same logits as the fp32 graph over the bf16-rounded weights."""
    gm = loaded()
    ids, pos = random_batch(2, 8, seed=2)
    for node in gm.graph.find_nodes(op="call_function", target=aten.linear.default):
        w = gm.get_parameter(node.args[1].target)
        w.data.copy_(w.data.bfloat16().float())
    rounded = _logits(gm, ids, pos)
    gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype="bf16")
    torch.testing.assert_close(_logits(gm, ids, pos), rounded, atol=2e-6, rtol=0)


def test_int4_matches_its_dequantized_weights(loaded):
    """The int4 graph computes what the same graph computes over the dequantized weights: as fp32 linears, or
    where the native kernels run, in their arithmetic for these 16 rows (activations rounded to 8 bits per block,
    int4_decode_reference)."""
    integer = native.int4_linear_available()  # loads the kernels first: then every int4 product below takes them
    gm = loaded()
    ids, pos = random_batch(2, 8, seed=3)
    gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype="int4", group_size=64)
    out = _logits(gm, ids, pos)
    nodes = gm.graph.find_nodes(op="call_function", target=INT4)
    assert {n.args[3] for n in nodes} == {64}
    for node in nodes:
        with gm.graph.inserting_before(node):
            if integer:
                lin = gm.graph.call_function(int4_decode_reference, (*node.args[:3], 64))
            else:
                q, scale = gm.get_buffer(node.args[1].target), gm.get_buffer(node.args[2].target)
                gm.register_buffer(node.args[1].target + "_deq", dequantize_int4(q, scale, 64))
                w = gm.graph.get_attr(node.args[1].target + "_deq")
                lin = gm.graph.call_function(aten.linear.default, (node.args[0], w))
        node.replace_all_uses_with(lin)
        gm.graph.erase_node(node)
    gm.recompile()
    torch.testing.assert_close(out, _logits(gm, ids, pos), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_exclude(loaded, dtype):
    gm = run_transform("quantize_weights", loaded(), "post_load_fusion", dtype=dtype,
                       exclude=["lm_head*", "*.q_proj.*"])
    assert count(gm, OPS[dtype]) == LINEARS - 1 - LAYERS
    kept = [n.args[1].target for n in gm.graph.find_nodes(op="call_function", target=aten.linear.default)]
    assert sorted(kept) == sorted(["lm_head.weight"] + [f"model.layers.{i}.self_attn.q_proj.weight"
                                                         for i in range(LAYERS)])
    assert all(gm.get_parameter(name).dtype == torch.float32 for name in kept)


def test_int4_leaves_in_features_not_a_multiple_of_the_group(tiny_checkpoint):
    # intermediate 96: down_proj's K is not a multiple of 64 -> stays fp32, the rest int4
    gm = autodeploy.optimize(tiny_checkpoint("llama"), until="weight_load")
    gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype="int4", group_size=64)
    kept = [n.args[1].target for n in gm.graph.find_nodes(op="call_function", target=aten.linear.default)]
    assert sorted(kept) == [f"model.layers.{i}.mlp.down_proj.weight" for i in range(LAYERS)]
    assert count(gm, INT4) == LINEARS - LAYERS


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "int4", "int8"])
def test_fuse_gemms_after_quantization(loaded, dtype):
    """q/k/v and gate/up products of each format fuse (weights and scales concatenated) with the same
    logits as unfused."""
    ids, pos = random_batch(2, 8, seed=4)
    gm = run_transform("quantize_weights", loaded(), "post_load_fusion", dtype=dtype)
    unfused = _logits(gm, ids, pos)
    gm = run_transform("fuse_gemms", gm, "post_load_fusion")
    assert count(gm, OPS[dtype]) == 4 * LAYERS + 1 and count(gm, aten.linear.default) == 0
    assert transform_history(gm)["fuse_gemms"].info.num_matches == 2 * LAYERS
    torch.testing.assert_close(_logits(gm, ids, pos), unfused, atol=1e-5, rtol=0)


def test_fuse_gemms_keeps_group_sizes_apart(loaded):
    """int4 products of different group sizes reading one input do not fuse: q and v (group 32) fuse, k
    (group 64, quantized by a second run) stays alone."""
    ids, pos = random_batch(2, 8, seed=6)
    gm = run_transform("quantize_weights", loaded(), "post_load_fusion", dtype="int4", exclude=["*k_proj*"])
    gm = run_transform("quantize_weights", gm, "post_load_fusion", dtype="int4", group_size=64)  # k_proj only
    sizes = [n.args[3] for n in gm.graph.find_nodes(op="call_function", target=INT4)]
    assert sizes.count(64) == LAYERS and sizes.count(32) == LINEARS - LAYERS
    unfused = _logits(gm, ids, pos)
    gm = run_transform("fuse_gemms", gm, "post_load_fusion")
    assert count(gm, INT4) == 5 * LAYERS + 1  # q+v, k, o, gate+up, down per layer; the head
    sizes = [n.args[3] for n in gm.graph.find_nodes(op="call_function", target=INT4)]
    assert sizes.count(64) == LAYERS
    torch.testing.assert_close(_logits(gm, ids, pos), unfused, atol=1e-5, rtol=0)


@pytest.mark.parametrize("key, value, message", [
    ("dtype", "int3", "transforms.quantize_weights.dtype"),
    ("group_size", 48, "transforms.quantize_weights.group_size"),
    ("group_size", 256, "transforms.quantize_weights.group_size"),
])
def test_bad_config_names_the_key(tiny_checkpoint, key, value, message):
    with pytest.raises(ConfigError, match=message):
        autodeploy.optimize(tiny_checkpoint("llama"), until="factory", overrides={
            "transforms.quantize_weights.enabled": True, f"transforms.quantize_weights.{key}": value})


def test_dtype_aliases(loaded):
    gm = run_transform("quantize_weights", loaded(), "post_load_fusion", dtype="bfloat16")
    assert count(gm, HALF) == LINEARS


# -- a bf16 checkpoint ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama"), dtype=torch.bfloat16)
    path = tmp_path_factory.mktemp("ckpt_bf16")
    model.save_pretrained(path)
    return path


def test_bf16_checkpoint_keeps_its_linear_weights(bf16_checkpoint, monkeypatch):
    """dtype float32 + quantize_weights bf16 on a bf16 checkpoint: the checkpoint is read in bf16, its linear
    weights stay bf16 (half_linear) and are never upcast; norms and the embedding are float32; the logits
    are HF's fp32 model over the same (exactly upcast) weights."""
    from autodeploy.models.hf import HFCheckpointFactory

    asked, upcast = [], []
    load_state = HFCheckpointFactory.load_state

    def spy(self, device="cpu", dtype=None):
        asked.append(dtype)
        state = load_state(self, device, dtype)
        return state

    to = torch.Tensor.to

    def watch(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if self.dtype == torch.bfloat16 and out.dtype == torch.float32 and self.dim() == 2 and self.shape[0] != 128:
            upcast.append(tuple(self.shape))  # a 2-D bf16 tensor other than the [vocab, hidden] embedding
        return out

    monkeypatch.setattr(HFCheckpointFactory, "load_state", spy)
    monkeypatch.setattr(torch.Tensor, "to", watch)
    gm = autodeploy.optimize(bf16_checkpoint, until="post_load_fusion", overrides={
        "dtype": "float32", "transforms.quantize_weights.enabled": True, "transforms.quantize_weights.dtype": "bf16"})
    monkeypatch.undo()
    assert asked == [torch.bfloat16]
    assert not upcast, upcast
    assert count(gm, HALF) + count(gm, HALF_PACKED) == FUSED and count(gm, aten.linear.default) == 0
    for node in [*gm.graph.find_nodes(op="call_function", target=HALF),
                 *gm.graph.find_nodes(op="call_function", target=HALF_PACKED)]:
        assert _tensors(gm)[node.args[1].target].dtype == torch.bfloat16
    others = {n: t.dtype for n, t in _tensors(gm).items() if "norm" in n or "embed" in n}
    assert others and set(others.values()) == {torch.float32}
    ids, pos = random_batch(2, 8, seed=5)
    out = _logits(gm, ids, pos)
    assert out.dtype == torch.float32
    with torch.no_grad():
        ref = hf_reference(bf16_checkpoint)(ids, position_ids=pos).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_bf16_checkpoint_int4_and_excluded(bf16_checkpoint):
    gm = autodeploy.optimize(bf16_checkpoint, until="post_load_fusion", overrides={
        "dtype": "float32", "transforms.quantize_weights.enabled": True,
        "transforms.quantize_weights.dtype": "int4", "transforms.quantize_weights.exclude": ["lm_head*"]})
    assert count(gm, INT4) + count(gm, INT4_PACKED) == FUSED - 1 and count(gm, HALF) == 0
    # native_linear, and pack_f32_weights on AVX-512
    float32_products = (aten.linear.default, torch.ops.auto_deploy.f32_linear.default,
                        torch.ops.auto_deploy.f32_packed_linear.default)
    (head,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in float32_products]
    assert gm.get_parameter(head.args[1].target).dtype == torch.float32  # excluded: upcast as before


def test_without_quantize_weights_a_bf16_checkpoint_is_upcast(bf16_checkpoint):
    gm = autodeploy.optimize(bf16_checkpoint, until="weight_load", overrides={"dtype": "float32"})
    assert count(gm, HALF) == 0 and all(t.dtype == torch.float32 for t in _tensors(gm).values()
                                        if t.is_floating_point())


# -- end to end ------------------------------------------------------------------------------------
def _generate(path, overrides, prompts, max_tokens=8):
    llm = LLM(path, max_batch_size=4, max_seq_len=32, kv_cache_config={"max_tokens": 128, "page_size": 16},
              overrides=overrides)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs]


def _greedy_uncached(gm, prompts, max_tokens):
    """Greedy tokens from the pre-cache graph (the whole sequence each step, no KV cache), one prompt at a time."""
    tokens = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(max_tokens):
            pos = torch.arange(ids.shape[1])[None]
            ids = torch.cat([ids, _logits(gm, ids, pos)[:, -1].argmax(-1, keepdim=True)], dim=1)
        tokens.append(ids[0, len(prompt):].tolist())
    return tokens


@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_llm_end_to_end(tiny_checkpoint, dtype):
    """Greedy tokens through the whole pipeline (cached attention, gathered logits, the runtime): bf16
    weights give fp32's tokens; int4 gives the tokens of its own weights run without the cache (its
    logit error against fp32 is bounded in test_counts_bytes_and_numerics: max 0.8, mean 0.15 of the
    logits' std), and differs from fp32's somewhere in 8 tokens of 4 prompts. Every product here has at most 16
    rows (4 prompts of 4 tokens, one sequence of at most 12 without the cache), which the native 4-bit
    kernels of every build take with one arithmetic (test_native.py), so the two agree on every CPU."""
    path = tiny_checkpoint("llama")
    ids, _ = random_batch(4, 4, seed=3)
    prompts = ids.tolist()
    overrides = {"transforms.quantize_weights.enabled": True, "transforms.quantize_weights.dtype": dtype}
    _, ref_tokens = _generate(path, {}, prompts)
    llm, tokens = _generate(path, overrides, prompts)
    ops = [OPS[dtype], {"int4": INT4_PACKED, "bf16": HALF_PACKED}[dtype]]
    assert sum(count(llm.engine.model, op) for op in ops) == FUSED
    if dtype == "bf16":
        assert tokens == ref_tokens
        return
    gm = autodeploy.optimize(path, until="post_load_fusion", overrides=overrides)
    assert count(gm, INT4) + count(gm, INT4_PACKED) == FUSED
    assert tokens == _greedy_uncached(gm, prompts, 8)
    assert tokens != ref_tokens  # it really runs 4-bit weights
