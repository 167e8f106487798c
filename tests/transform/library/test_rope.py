"""RoPE matchers: op counts before/after and numerics on small exported graphs and on tiny HF models."""

import copy
import operator

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv, rotate_half

from autodeploy.api import build_optimizer
from autodeploy.config import load_config
from autodeploy.transform import transform_history
from autodeploy.utils.fx import run_shape_prop
from helpers import count, export_gm, num_matches, run_transform
from tiny_models import ARCHS, hf_reference, random_batch

aten = torch.ops.aten
ROPE = torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _rope_nodes(gm) -> list[torch.fx.Node]:
    return list(gm.graph.find_nodes(op="call_function", target=ROPE))


def _unsqueeze_dim(node) -> int:
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("unsqueeze_dim", 1)


def _cos_sin(batch, seq, dim, dtype=torch.float32):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.arange(seq, dtype=torch.float32).expand(batch, seq)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _inputs(batch, seq, layout="bnsd", rot=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda n: (batch, n, seq, 16)) if layout == "bnsd" else (lambda n: (batch, seq, n, 16))
    q = torch.randn(shape(4), generator=gen).to(dtype)
    k = torch.randn(shape(2), generator=gen).to(dtype)
    return (q, k, *_cos_sin(batch, seq, rot, dtype))


def _check_meta_current(gm):
    """Every tensor node carries a fake value, and re-propagating shapes changes nothing."""
    before = {n: tuple(n.meta["val"].shape) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    run_shape_prop(gm)
    after = {n: tuple(n.meta["val"].shape) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert before == after
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target not in (operator.getitem,):
            assert "val" in node.meta, node


# the dynamic dims of (q, k, cos, sin): batch on dim 0 of each; seq on dim 2 of [b, n, s, d] q/k, else dim 1
_BATCH, _SEQ = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=64)
BNSD = tuple({0: _BATCH, seq: _SEQ} for seq in (2, 2, 1, 1))
BSND = tuple({0: _BATCH, 1: _SEQ} for _ in range(4))


# ------------------------------------------------------------------------------------------------
# hand-built graphs
# ------------------------------------------------------------------------------------------------
class HFRope(torch.nn.Module):
    """HF's apply_rotary_pos_emb on [b, n, s, d] q/k, followed by some use of both."""

    def forward(self, q, k, cos, sin):
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q * 2, k + 1


class HFRopeBSND(torch.nn.Module):
    """q/k arrive as [b, s, n, d] and are transposed to [b, n, s, d] before the rope, like HF attention."""

    def forward(self, q, k, cos, sin):
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q * 2, k + 1


class TwoLayers(torch.nn.Module):
    """Two 'layers' sharing cos/sin; layer 2's q/k depend on layer 1's outputs."""

    def forward(self, q, k, cos, sin):
        q1, k1 = apply_rotary_pos_emb(q, k, cos, sin)
        h = q1[:, :2] + k1
        q2, k2 = apply_rotary_pos_emb(q1 * 0.5, h, cos, sin)
        return q2, k2


class Commuted(torch.nn.Module):
    """The same math with every commutative operand swapped."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (sin * rotate_half(q)) + (cos * q), (sin * rotate_half(k)) + (cos * k)


class PartialRotary(torch.nn.Module):
    """StableLM/Phi style: rope on the first rot dims, the rest concatenated back."""

    def forward(self, q, k, cos, sin):
        rot = cos.shape[-1]
        q_rot, q_pass = q[..., :rot], q[..., rot:]
        k_rot, k_pass = k[..., :rot], k[..., rot:]
        q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
        return torch.cat((q_rot, q_pass), dim=-1), torch.cat((k_rot, k_pass), dim=-1)


class CosCache4D(torch.nn.Module):
    """cos/sin given already broadcastable ([b, 1, s, d]) instead of unsqueezed inside the rope."""

    def forward(self, q, k, cos, sin):
        cos4, sin4 = cos[:, None], sin[:, None]
        cos4, sin4 = cos4 + 0.0, sin4 * 1.0  # not unsqueeze nodes any more
        return q * cos4 + rotate_half(q) * sin4, k * cos4 + rotate_half(k) * sin4


class KFirst(torch.nn.Module):
    """k's rope computed before q's; the attention op shows which one is the query."""

    def forward(self, q, k, cos, sin):
        k_embed, q_embed = apply_rotary_pos_emb(k, q, cos, sin)
        k_embed = repeat_kv(k_embed, 2)
        return (torch.nn.functional.scaled_dot_product_attention(q_embed, k_embed, k_embed),)


class NotRotateHalf(torch.nn.Module):
    """Looks like a rope but rotates by a quarter: must not match."""

    def forward(self, q, k, cos, sin):
        def rot(x):
            return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)

        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class QOnly(torch.nn.Module):
    """A single rotated tensor: nothing to pair, must not match."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * 2


def _check_numerics(gm, module, *shapes, layout="bnsd", rot=16, dtype=torch.float32, exact=True):
    for i, (b, s) in enumerate(shapes):
        args = _inputs(b, s, layout, rot, dtype, seed=i)
        tol = dict(rtol=0, atol=0) if exact else {}
        for out, ref in zip(gm(*args), module(*args)):
            assert out.dtype == ref.dtype
            torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_rope_pair_becomes_one_op(dtype):
    gm = export_gm(HFRope(), *_inputs(2, 5, dtype=dtype), dims=BNSD, strict=False)
    assert count(gm, aten.neg.default) == 2 and count(gm, aten.cat.default) == 2
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert _unsqueeze_dim(node) == 1
    assert [a.name for a in node.args[:4]] == ["q", "k", "cos", "sin"]
    assert count(gm, aten.neg.default) == count(gm, aten.cat.default) == count(gm, aten.slice.Tensor) == 0
    _check_meta_current(gm)
    _check_numerics(gm, HFRope(), (2, 5), (3, 9), dtype=dtype)


def test_layout_feeds_untransposed_inputs():
    module = HFRopeBSND()
    gm = export_gm(module, *_inputs(2, 5, "bsnd"), dims=BSND, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    transposes = count(gm, aten.transpose.int)
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_layout") == 1
    (node,) = _rope_nodes(gm)
    assert _unsqueeze_dim(node) == 2
    assert [a.name for a in node.args[:2]] == ["q", "k"]  # the [b, s, n, d] placeholders themselves
    assert count(gm, aten.transpose.int) == transposes  # two input transposes out, two output ones in
    _check_meta_current(gm)
    _check_numerics(gm, module, (2, 5), (1, 17), layout="bsnd")


def test_layout_inserts_transposes_for_other_inputs():
    gm = export_gm(HFRope(), *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_layout") == 1
    (node,) = _rope_nodes(gm)
    assert _unsqueeze_dim(node) == 2
    assert all(a.target == aten.transpose.int for a in node.args[:2])
    _check_numerics(gm, HFRope(), (2, 5), (4, 3))
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")  # already canonical: nothing to do
    assert num_matches(gm, "match_rope_layout") == 0


def test_two_layers_shared_cos_sin():
    module = TwoLayers()
    gm = export_gm(module, *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 2
    assert len(_rope_nodes(gm)) == 2
    _check_numerics(gm, module, (2, 5), (3, 8))
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    assert [_unsqueeze_dim(n) for n in _rope_nodes(gm)] == [2, 2]
    _check_numerics(gm, module, (2, 6))


def test_commuted_operands():
    module = Commuted()
    gm = export_gm(module, *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    assert count(gm, aten.neg.default) == 0
    _check_numerics(gm, module, (2, 5), (1, 11))


def test_q_and_k_roles_follow_attention():
    module = KFirst()
    gm = export_gm(module, *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    (node,) = _rope_nodes(gm)
    assert [a.name for a in node.args[:2]] == ["q", "k"]
    _check_numerics(gm, module, (2, 5), (1, 9), exact=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotary_folded_into_op(dtype):
    module = PartialRotary()
    gm = export_gm(module, *_inputs(2, 5, rot=8, dtype=dtype), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert [a.name for a in node.args[:2]] == ["q", "k"]  # the whole q/k, not their rotary slices
    assert node.args[2].meta["val"].shape[-1] == 8
    assert count(gm, aten.cat.default) == count(gm, aten.slice.Tensor) == 0
    _check_numerics(gm, module, (2, 5), (3, 7), rot=8, dtype=dtype)
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    _check_numerics(gm, module, (2, 6), rot=8, dtype=dtype)


def test_broadcastable_4d_cos_sin():
    module = CosCache4D()
    gm = export_gm(module, *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert node.args[2].meta["val"].dim() == 3  # squeezed back to [b, s, d]
    _check_numerics(gm, module, (2, 5), (3, 4))
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    _check_numerics(gm, module, (2, 5))


@pytest.mark.parametrize("module", [NotRotateHalf(), QOnly()], ids=["quarter_rotation", "q_only"])
def test_no_match_leaves_graph_alone(module):
    gm = export_gm(module, *_inputs(2, 5), dims=BNSD, strict=False)
    code = gm.code
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    info = transform_history(gm)["match_rope_pattern"].info
    assert info.num_matches == 0 and not info.skipped and info.has_valid_shapes
    assert not _rope_nodes(gm) and gm.code == code
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_layout") == 0


# ------------------------------------------------------------------------------------------------
# tiny HF models
# ------------------------------------------------------------------------------------------------
SHAPES = [(1, 7), (3, 12)]


def _logits_close(gm, reference, shapes=SHAPES, atol=1e-4):
    for batch, seq in shapes:
        input_ids, position_ids = random_batch(batch, seq, seed=batch * 10 + seq)
        with torch.no_grad():
            torch.testing.assert_close(
                gm(input_ids, position_ids)[0],
                reference(input_ids=input_ids, position_ids=position_ids).logits,
                atol=atol,
                rtol=0,
            )


def _build(path, **overrides):
    """The pipeline up to pattern_matcher, match_rope_layout off (tested on a copy), and its optimizer."""
    overrides = {"transforms.match_rope_layout.enabled": False, **overrides}
    optimizer, _ = build_optimizer(load_config(overrides=overrides, base={"model": str(path)}))
    return optimizer(until="pattern_matcher"), optimizer


def _load_weights(gm, optimizer):
    load = next(t for t in optimizer.transforms if t.get_transform_key() == "load_weights")
    return load(gm, optimizer.ctx)


def _check_model(path, num_layers):
    """One export: rope matched (unsqueeze_dim 1) and, on a copy, moved to [b, s, n, d]; both vs HF."""
    gm, optimizer = _build(path)
    assert num_matches(gm, "match_rope_pattern") == num_layers
    nodes = _rope_nodes(gm)
    assert len(nodes) == num_layers and all(_unsqueeze_dim(n) == 1 for n in nodes)
    assert all(n.args[0].meta["val"].shape[1] == 4 and n.args[1].meta["val"].shape[1] == 2 for n in nodes)  # q, k (GQA)
    assert count(gm, aten.neg.default) == 0
    gm_layout = run_transform("match_rope_layout", copy.deepcopy(gm), "pattern_matcher")
    assert num_matches(gm_layout, "match_rope_layout") == num_layers
    nodes = _rope_nodes(gm_layout)
    assert len(nodes) == num_layers and all(_unsqueeze_dim(n) == 2 for n in nodes)
    _check_meta_current(gm_layout)
    reference = hf_reference(path)
    _logits_close(_load_weights(gm, optimizer), reference)
    _logits_close(_load_weights(gm_layout, optimizer), reference)


@pytest.mark.slow  # every architecture against HF
@pytest.mark.parametrize("arch", ARCHS)
def test_models(arch, tiny_checkpoint):
    _check_model(tiny_checkpoint(arch), num_layers=2)


@pytest.fixture(scope="module")
def partial_rotary_checkpoint(tmp_path_factory):
    """StableLM with a quarter of each head rotated (transformers' own partial-rotary model)."""
    import transformers

    config = transformers.StableLmConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, partial_rotary_factor=0.25, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt_stablelm")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.slow  # a partial-rotary architecture against HF
def test_partial_rotary_model(partial_rotary_checkpoint):
    _check_model(partial_rotary_checkpoint, num_layers=2)


def test_bf16_model_unchanged_by_rope_ops(tiny_checkpoint):
    """bf16: HF casts cos/sin to bf16 before the rope; the rewrite must compute the very same logits."""
    gm, optimizer = _build(tiny_checkpoint("llama"), dtype="bfloat16",
                           **{"transforms.match_rope_pattern.enabled": False})
    matched = run_transform("match_rope_pattern", copy.deepcopy(gm), "pattern_matcher")
    matched = run_transform("match_rope_layout", matched, "pattern_matcher")
    assert num_matches(matched, "match_rope_pattern") == num_matches(matched, "match_rope_layout") == 2
    assert [_unsqueeze_dim(n) for n in _rope_nodes(matched)] == [2, 2]
    gm, matched = _load_weights(gm, optimizer), _load_weights(matched, optimizer)
    for batch, seq in SHAPES:
        input_ids, position_ids = random_batch(batch, seq)
        with torch.no_grad():
            expected, logits = gm(input_ids, position_ids)[0], matched(input_ids, position_ids)[0]
        assert logits.dtype == torch.bfloat16
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# interleaved rope (GPT-J / CodeGen rotate_every_two, Cohere / GLM / Helium / ERNIE rotate_half)
# ------------------------------------------------------------------------------------------------
def _rotate_interleaved(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _interleave(cos, sin):
    """cos/sin of the rotate_half convention -> each frequency twice in a row (repeat_interleave)."""
    half = cos.shape[-1] // 2
    return cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)


class InterleavedRope(torch.nn.Module):
    """Helium/GLM's apply_rotary_pos_emb: cos/sin interleaved inside, x[..., ::2] / x[..., 1::2] pairs."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        return (q * cos) + (_rotate_interleaved(q) * sin), (k * cos) + (_rotate_interleaved(k) * sin)


class GPTJRope(torch.nn.Module):
    """GPT-J: [b, s, n, d] q/k, partial rotary, rotate_every_two with explicit 4D indexing, commuted terms."""

    def forward(self, q, k, cos, sin):
        cos, sin = _interleave(cos, sin)
        rot = cos.shape[-1]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]

        def rotate_every_two(x):
            return torch.stack((-x[:, :, :, 1::2], x[:, :, :, ::2]), dim=-1).flatten(-2)

        out = []
        for x in (q, k):
            x_rot, x_pass = x[:, :, :, :rot], x[:, :, :, rot:]
            x_rot = (sin * rotate_every_two(x_rot)) + (x_rot * cos)
            out.append(torch.cat([x_rot, x_pass], dim=-1))
        return tuple(out)


class InterleavedWrongOrder(torch.nn.Module):
    """stack((x_even, -x_odd)): the rotation the other way round, must not match."""

    def forward(self, q, k, cos, sin):
        def rot(x):
            return torch.stack((x[..., ::2], -x[..., 1::2]), dim=-1).flatten(-2)

        cos, sin = _interleave(cos.unsqueeze(1), sin.unsqueeze(1))
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class InterleavedStep3(torch.nn.Module):
    """Strided by 3, not pairs: must not match."""

    def forward(self, q, k, cos, sin):
        def rot(x):
            return torch.stack((-x[..., 1::3], x[..., ::3]), dim=-1).flatten(-2)

        cos, sin = cos.unsqueeze(1)[..., :10], sin.unsqueeze(1)[..., :10]
        return q[..., :10] * cos + rot(q[..., :15]) * sin, k[..., :10] * cos + rot(k[..., :15]) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_pair_becomes_one_op(dtype):
    module = InterleavedRope()
    gm = export_gm(module, *_inputs(2, 5, dtype=dtype), dims=BNSD, strict=False)
    assert count(gm, aten.neg.default) == 2 and count(gm, aten.stack.default) == 2
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert _unsqueeze_dim(node) == 1 and node.args[5] is True
    assert [a.name for a in node.args[:2]] == ["q", "k"]
    assert count(gm, aten.neg.default) == count(gm, aten.stack.default) == 0
    _check_meta_current(gm)
    _check_numerics(gm, module, (2, 5), (3, 9), dtype=dtype)
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    (node,) = _rope_nodes(gm)
    assert _unsqueeze_dim(node) == 2 and node.args[5] is True  # the layout pass keeps the form
    _check_numerics(gm, module, (2, 6), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptj_partial_interleaved_rope(dtype):
    module = GPTJRope()
    gm = export_gm(module, *_inputs(2, 5, "bsnd", rot=8, dtype=dtype), dims=BSND, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert [a.name for a in node.args[:2]] == ["q", "k"]  # the whole q/k: partial rotary folded in
    assert _unsqueeze_dim(node) == 2 and node.args[5] is True
    assert node.args[2].meta["val"].shape[-1] == 8
    assert count(gm, aten.cat.default) == count(gm, aten.stack.default) == 0
    _check_meta_current(gm)
    _check_numerics(gm, module, (2, 5), (3, 7), layout="bsnd", rot=8, dtype=dtype)


@pytest.mark.parametrize("module", [InterleavedWrongOrder(), InterleavedStep3()], ids=["reversed", "step3"])
def test_interleaved_no_match(module):
    gm = export_gm(module, *_inputs(2, 5), dims=BNSD, strict=False)
    code = gm.code
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 0 and not _rope_nodes(gm) and gm.code == code


class FlippedRotateHalf(torch.nn.Module):
    """NanoChat: rotate_half = cat(x2, -x1), a rotation by -angle: the usual op with -sin."""

    def forward(self, q, k, cos, sin):
        def rot(x):
            half = x.shape[-1] // 2
            return torch.cat((x[..., half:], -x[..., :half]), dim=-1)

        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flipped_rotate_half(dtype):
    module = FlippedRotateHalf()
    gm = export_gm(module, *_inputs(2, 5, dtype=dtype), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert node.args[3].target == aten.neg.default and node.args[3].args[0].name == "sin"
    assert count(gm, aten.cat.default) == 0 and count(gm, aten.neg.default) == 1  # only -sin is left
    _check_meta_current(gm)
    _check_numerics(gm, module, (2, 5), (3, 9), dtype=dtype)


class QUsedBeforeK(torch.nn.Module):
    """Gemma 4: q's rope and a transpose of it come before k is even computed from its input."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = q * cos + rotate_half(q) * sin
        q_t = q_embed.transpose(1, 2) * 3
        k = k * 2 + 1  # k's input comes after q's uses
        k_embed = k * cos + rotate_half(k) * sin
        return q_t, k_embed


class KInputNeedsQ(torch.nn.Module):
    """k's input depends on q's rope output: one op cannot compute both, must not match."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = q * cos + rotate_half(q) * sin
        k = k + q_embed[:, :2]
        return q_embed, k * cos + rotate_half(k) * sin


def test_early_uses_move_after_the_op():
    module = QUsedBeforeK()
    gm = export_gm(module, *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    gm.graph.lint()
    _check_meta_current(gm)
    _check_numerics(gm, module, (2, 5), (3, 9))


def test_k_input_depending_on_q_output_left_alone():
    gm = export_gm(KInputNeedsQ(), *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 0 and not _rope_nodes(gm)


# ------------------------------------------------------------------------------------------------
# MLA ropes (DeepSeek-V2's complex frequencies, DeepSeek-V3's de-interleaving form): a slice of q,
# the single shared k head
# ------------------------------------------------------------------------------------------------
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb as complex_rope  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (  # noqa: E402
    apply_rotary_pos_emb_interleave as deinterleaving_rope,
)

_NOPE, _ROT = 8, 8


def _mla_inputs(batch, seq, dtype=torch.float32, seed=0):
    """q [b, 4, s, nope + rot] with its rope part last, k [b, 1, s, rot], cos/sin [b, s, rot]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, seq, _NOPE + _ROT, generator=gen).to(dtype)
    k = torch.randn(batch, 1, seq, _ROT, generator=gen).to(dtype)
    return (q, k, *_cos_sin(batch, seq, _ROT, dtype))


def _check_mla_numerics(gm, module, *shapes, dtype=torch.float32, exact=True):
    for i, (b, s) in enumerate(shapes):
        args = _mla_inputs(b, s, dtype, seed=i)
        tol = dict(rtol=0, atol=0) if exact else {}
        for out, ref in zip(gm(*args), module(*args)):
            assert out.dtype == ref.dtype
            torch.testing.assert_close(out, ref, **tol)


class DeepseekV3Rope(torch.nn.Module):
    """DeepSeek-V3's MLA: the de-interleaving rope on q's last rot features and on k, q reassembled by a cat."""

    def forward(self, q, k, cos, sin):
        q_pass, q_rot = torch.split(q, [_NOPE, _ROT], dim=-1)
        q_rot, k_rot = deinterleaving_rope(q_rot, k, cos, sin)
        return torch.cat((q_pass, q_rot), dim=-1), k_rot * 2


class DeepseekV2Rope(torch.nn.Module):
    """DeepSeek-V2's MLA: the complex-frequency rope (freqs_cis from cos/sin) on q's rope slice and on k."""

    def forward(self, q, k, cos, sin):
        half = cos.shape[-1] // 2
        freqs_cis = torch.complex(cos[..., :half].float(), sin[..., :half].float())
        q_pass, q_rot = torch.split(q, [_NOPE, _ROT], dim=-1)
        q_rot, k_rot = complex_rope(q_rot, k, freqs_cis)
        return torch.cat((q_pass, q_rot), dim=-1), k_rot * 2


class DeinterleavingWrongSign(torch.nn.Module):
    """cat(x1 * cos + x2 * sin, x2 * cos - x1 * sin): the rotation the other way round, must not match."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos[..., : _ROT // 2].unsqueeze(1), sin[..., : _ROT // 2].unsqueeze(1)

        def rope(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)

        return rope(q[..., _NOPE:]), rope(k)


class ComplexPerHeadFreqs(torch.nn.Module):
    """Complex multiply by a per-head factor (not frequencies broadcast over the heads): must not match."""

    def forward(self, q, k, cos, sin):
        factor = torch.view_as_complex(q[..., :_ROT].float().reshape(*q.shape[:-1], -1, 2))

        def mul(x):
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * factor).flatten(3)

        return mul(q[..., _NOPE:]), mul(k.expand(-1, 4, -1, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deinterleaving_rope_pair_becomes_one_op(dtype):
    module = DeepseekV3Rope()
    gm = export_gm(module, *_mla_inputs(2, 5, dtype), dims=BNSD, strict=False)
    assert count(gm, aten.sub.Tensor) == 2 and count(gm, aten.cat.default) == 3  # 2 ropes + q's reassembly
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert _unsqueeze_dim(node) == 1 and len(node.args) == 5  # the rotate_half op on de-interleaved q/k
    assert [a.meta["val"].shape[-1] for a in node.args[:4]] == [_ROT] * 4  # cos/sin back to the full width
    assert count(gm, aten.sub.Tensor) == 0 and count(gm, aten.mul.Tensor) == 1  # only k_rot * 2 is left
    _check_meta_current(gm)
    _check_mla_numerics(gm, module, (2, 5), (3, 9), dtype=dtype)
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    assert [_unsqueeze_dim(n) for n in _rope_nodes(gm)] == [2]
    _check_mla_numerics(gm, module, (2, 6), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_frequency_rope_pair_becomes_one_op(dtype):
    module = DeepseekV2Rope()
    gm = export_gm(module, *_mla_inputs(2, 5, dtype), dims=BNSD, strict=False)
    assert count(gm, aten.view_as_complex.default) == 2
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert _unsqueeze_dim(node) == 1 and node.args[5] is True  # neighbouring pairs, interleaved output
    assert count(gm, aten.view_as_complex.default) == 0
    _check_meta_current(gm)
    # complex multiplication rounds the four products' sums in its own way: float32-close, not bitwise
    _check_mla_numerics(gm, module, (2, 5), (3, 9), dtype=dtype, exact=False)
    gm = run_transform("match_rope_layout", gm, "pattern_matcher")
    _check_mla_numerics(gm, module, (2, 6), dtype=dtype, exact=False)


@pytest.mark.parametrize("module", [DeinterleavingWrongSign(), ComplexPerHeadFreqs()], ids=["wrong_sign", "per_head"])
def test_mla_rope_no_match(module):
    gm = export_gm(module, *_mla_inputs(2, 5), dims=BNSD, strict=False)
    code = gm.code
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 0 and not _rope_nodes(gm) and gm.code == code


class Halves(torch.nn.Module):
    """gpt-oss: chunk into halves, ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, cos/sin half as wide."""

    def forward(self, q, k, cos, sin):
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)

        def rot(x):
            x1, x2 = torch.chunk(x, 2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        return rot(q), rot(k)


class HalvesSwapped(torch.nn.Module):
    """The halves form with its signs swapped (a rotation by -angle, written without rotate_half's sign
    convention): must not match, since the op would rotate the other way."""

    def forward(self, q, k, cos, sin):
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half].unsqueeze(1), sin[..., :half].unsqueeze(1)

        def rot(x):
            x1, x2 = torch.chunk(x, 2, dim=-1)
            return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)

        return rot(q), rot(k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_halves_form(dtype):
    module = Halves()
    gm = export_gm(module, *_inputs(2, 5, dtype=dtype), dims=BNSD, strict=False)
    assert count(gm, aten.chunk.default) == 2
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 1
    (node,) = _rope_nodes(gm)
    assert node.args[2].target == aten.cat.default and node.args[3].target == aten.cat.default  # cat(cos, cos)
    assert count(gm, aten.chunk.default) == 0 and count(gm, aten.sub.Tensor) == 0
    _check_meta_current(gm)
    _check_numerics(gm, module, (2, 5), (3, 9), dtype=dtype)


def test_halves_with_other_signs_not_matched():
    gm = export_gm(HalvesSwapped(), *_inputs(2, 5), dims=BNSD, strict=False)
    gm = run_transform("match_rope_pattern", gm, "pattern_matcher")
    assert num_matches(gm, "match_rope_pattern") == 0 and count(gm, aten.chunk.default) == 2
