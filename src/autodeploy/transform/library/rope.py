"""pattern_matcher stage: rotary position embeddings -> ``auto_deploy::torch_rope_with_explicit_cos_sin``.

- ``match_rope_pattern``: finds ``x * cos + rotate_half(x) * sin`` (HF's ``apply_rotary_pos_emb``,
  rotate_half = ``cat(-x[..., h:], x[..., :h])``) for the query and the key of one attention layer
  sharing ``cos``/``sin``, and replaces the pair with ONE ``torch_rope_with_explicit_cos_sin(q, k,
  cos, sin, unsqueeze_dim)``. Partial rotary (StableLM, Phi, GPT-NeoX: ``x[..., :r]`` rotates,
  ``x[..., r:]`` is concatenated back) is folded into the op: it takes the whole q/k. The interleaved
  form (GPT-J/CodeGen's ``rotate_every_two``, Cohere/GLM/Helium/ERNIE's ``rotate_half`` over
  ``x[..., ::2]`` / ``x[..., 1::2]``: ``stack((-x_odd, x_even), -1).flatten(-2)``) becomes the same op
  with ``interleaved=True``; its cos/sin are whatever the model multiplies with (usually
  ``repeat_interleave(2)`` of the frequencies), partial rotary folded in the same way. NanoChat's
  ``rotate_half`` the other way round (``cat(x2, -x1)``) is the usual op with ``-sin``. Two more forms
  rotate neighbouring pairs (DeepSeek and the MLA models after it, which rope a slice of q/k):
  the complex-frequency one (DeepSeek-V2, Llama 4: ``view_as_real(view_as_complex(x.reshape(..., -1, 2)) *
  freqs_cis).flatten(3)``) is ``interleaved=True`` with cos/sin the real/imaginary parts of ``freqs_cis``,
  each twice in a row; the de-interleaving one (DeepSeek-V3: ``cat(x1 * cos - x2 * sin, x2 * cos + x1 *
  sin)`` over ``x1, x2 = x[..., ::2], x[..., 1::2]`` and half-width cos/sin) is the usual op on the
  de-interleaved ``cat(x1, x2)``, with cos/sin ``cat(c, c)`` of the half-width ones. gpt-oss's halves form
  (``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` over ``x1, x2 = chunk(x, 2, -1)``, half-width cos/sin) is
  the usual op on q/k as they are, with cos/sin ``cat(c, c)``.
- ``match_rope_layout``: brings every rope op to the canonical [batch, seq, heads, head_dim] layout
  (``unsqueeze_dim=2``): q/k that are ``transpose(1, 2)`` of a [b, s, n, d] tensor are fed
  untransposed, other inputs get a transpose, and the outputs are transposed back (a later pass
  cancels the transpose pairs).

How the match works: the single-tensor expression is an export-traced pattern (``utils.pattern``)
matched with torch.fx's SubgraphMatcher, literals as wildcards, in each commutative operand order.
Every match is then checked on what the nodes compute (slice dims/bounds, cat dim, how cos/sin
broadcast, output shape == input shape); ``cos``/``sin`` are pattern inputs, so the dtype casts HF
inserts before them (bf16) and the way they were produced never matter. Matches sharing cos/sin are
paired in graph order (q before k, as HF computes them), with the roles swapped where the outputs
visibly feed an attention op's key/query arguments the other way round; a pair is fused where one op
can be placed after both inputs with every use of both outputs after it: uses that come earlier (Gemma 4
ropes and transposes q before it projects k) move after the op when none of its inputs depends on them.

Invariants: the graph is clean and every ``node.meta["val"]`` is current after either transform.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from ...utils.fx import is_call, node_val, same_shape, sizes_equal, static_int
from ...utils.pattern import find_matches, trace_pattern
from ..interface import BaseTransform, GraphRewriteConfig, PipelineContext, TransformInfo, TransformRegistry

aten = torch.ops.aten
ROPE_OP = torch.ops.auto_deploy.torch_rope_with_explicit_cos_sin.default

_INT_MAX = 2**63 - 1


# ------------------------------------------------------------------------------------------------
# patterns
# ------------------------------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_half_flipped(x: torch.Tensor) -> torch.Tensor:
    """NanoChat's rotate_half, ``cat(x2, -x1)``: minus the usual one (a rotation by -angle)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


def _make_rope_fn(x_first: bool, rot_first: bool, cos_term_first: bool, flipped: bool = False):
    """``x * cos + rotate_half(x) * sin`` with the operands of each commutative op in a given order."""
    rotate = _rotate_half_flipped if flipped else _rotate_half

    def fn(x, cos, sin):
        cos_term = x * cos if x_first else cos * x
        sin_term = rotate(x) * sin if rot_first else sin * rotate(x)
        return cos_term + sin_term if cos_term_first else sin_term + cos_term

    return fn


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _make_interleaved_fn(x_first: bool, rot_first: bool, cos_term_first: bool):
    """``x * cos + rotate_interleaved(x) * sin`` (GPT-J's rotate_every_two, Cohere/GLM's rotate_half)."""

    def fn(x, cos, sin):
        cos_term = x * cos if x_first else cos * x
        sin_term = _rotate_interleaved(x) * sin if rot_first else sin * _rotate_interleaved(x)
        return cos_term + sin_term if cos_term_first else sin_term + cos_term

    return fn


def _make_deinterleaving_fn(x_first: bool, cos_term_first: bool):
    """DeepSeek-V3's ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` over ``x1, x2 = x[..., ::2], x[..., 1::2]``
    (cos/sin half the rotary width): the rotate_half rope of the de-interleaved ``cat(x1, x2)``."""

    def mul(a, b):
        return a * b if x_first else b * a

    def fn(x, cos, sin):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        second = mul(x2, cos) + mul(x1, sin) if cos_term_first else mul(x1, sin) + mul(x2, cos)
        return torch.cat((mul(x1, cos) - mul(x2, sin), second), dim=-1)

    return fn


@functools.cache
def _deinterleaving_patterns() -> tuple[GraphModule, ...]:
    """The single-tensor de-interleaving rope, traced once per operand order (4 graphs)."""
    x, cs = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 4)
    return tuple(
        trace_pattern(_make_deinterleaving_fn(*order), [x, cs, cs.clone()])
        for order in itertools.product((True, False), repeat=2)
    )


@functools.cache
def _interleaved_patterns() -> tuple[GraphModule, ...]:
    """The single-tensor interleaved rope, traced once per commutative operand order (8 graphs)."""
    x, cs = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 8)
    return tuple(
        trace_pattern(_make_interleaved_fn(*order), [x, cs, cs.clone()])
        for order in itertools.product((True, False), repeat=3)
    )


def _rope_halves(x, cos, sin):
    """gpt-oss's ``_apply_rotary_emb``: rotate_half's rotation on the two halves, cos/sin half as wide."""
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@functools.cache
def _halves_patterns() -> tuple[GraphModule, ...]:
    x, cs = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 4)
    return (trace_pattern(_rope_halves, [x, cs, cs.clone()]),)


@functools.cache
def _rope_patterns(flipped: bool = False) -> tuple[GraphModule, ...]:
    """The single-tensor rotate_half rope, traced once per commutative operand order (8 graphs)."""
    x, cs = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 8)
    return tuple(
        trace_pattern(_make_rope_fn(*order, flipped=flipped), [x, cs, cs.clone()])
        for order in itertools.product((True, False), repeat=3)
    )


# ------------------------------------------------------------------------------------------------
# node helpers
# ------------------------------------------------------------------------------------------------
def _norm_dim(dim, ndim: int) -> int | None:
    if not isinstance(dim, int):
        return None
    return dim + ndim if dim < 0 else dim


def _arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _slice_bounds(node: Node) -> tuple[int | None, object, object, object] | None:
    """(normalized dim, start, end, step) of an ``aten.slice.Tensor`` node; None if not a slice."""
    if not is_call(node, aten.slice.Tensor):
        return None
    src = node_val(node.args[0])
    if src is None:
        return None
    start = _arg(node, 2, "start")
    end = _arg(node, 3, "end")
    return (
        _norm_dim(_arg(node, 1, "dim", 0), src.dim()),
        0 if start is None else start,
        _INT_MAX if end is None else end,
        _arg(node, 4, "step", 1),
    )


def _is_last_dim_slice(node: Node, start: int, min_end: int, max_end: int | None = None) -> bool:
    """``node`` is ``src[..., start:end]`` with step 1 and min_end <= end (<= max_end when given)."""
    bounds = _slice_bounds(node)
    if bounds is None:
        return False
    dim, s, e, step = bounds
    ndim = node_val(node.args[0]).dim()
    if dim != ndim - 1 or step != 1 or not isinstance(s, int) or not isinstance(e, int) or s != start:
        return False
    return e >= min_end and (max_end is None or e <= max_end)


def _positions(gm: GraphModule) -> dict[Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _insert_after(gm: GraphModule, node: Node):
    """Insert point right after ``node`` that keeps the order of the nodes created under it."""
    return gm.graph.inserting_before(node.next)


# ------------------------------------------------------------------------------------------------
# match_rope_pattern
# ------------------------------------------------------------------------------------------------
@dataclass
class _Rope:
    """One verified single-tensor rope: ``out`` (replaced) = rope(``x``) with cos/sin broadcast at ``dim``."""

    x: Node  # the whole q or k (before a partial-rotary slice)
    out: Node  # the node whose value the op output replaces
    cos: Node  # pre-broadcast cos/sin, or the 4D ones when ``squeeze`` (a squeeze is inserted)
    sin: Node
    dim: int  # unsqueeze_dim of the canonical op (1 or 2)
    squeeze: bool
    interleaved: bool = False  # pairs are neighbouring features (the op's ``interleaved``)
    flipped: bool = False  # rotate_half the other way round (``cat(x2, -x1)``): the op gets -sin
    # how cos/sin become the op's: "full" as they are; "half" (de-interleaving form) cat(c, c), and the op
    # gets cat(x[..., ::2], x[..., 1::2]); "chunk" (gpt-oss's halves form) cat(c, c) with q/k as they
    # are; "complex" (``cos`` and ``sin`` both the complex freqs_cis) the
    # real and imaginary parts, each twice in a row
    cos_form: str = "full"


def _broadcast_source(node: Node, x_ndim: int) -> tuple[Node, int, bool] | None:
    """How a 4D cos/sin operand broadcasts over the heads dim: (source, unsqueeze_dim, needs_squeeze).

    ``unsqueeze(c, d)`` of a 3D ``c`` gives (c, d, False); a 4D tensor with size 1 at dim 1 or 2
    (e.g. a sliced cos cache) gives (node, dim, True).
    """
    val = node_val(node)
    if val is None or val.dim() != x_ndim:
        return None
    if is_call(node, aten.unsqueeze.default):
        src = node.args[0]
        src_val = node_val(src)
        dim = _norm_dim(_arg(node, 1, "dim"), x_ndim)
        if src_val is not None and src_val.dim() == x_ndim - 1 and dim in (1, 2):
            return src, dim, False
    for dim in (1, 2):
        if sizes_equal(val.shape[dim], 1):
            return node, dim, True
    return None


def _verify(match) -> _Rope | None:
    """Check what a pattern match computes; None when it is not a rotate_half rope we can replace."""
    x, cos_u, sin_u = match.inputs.values()
    out = match.outputs[0]
    xv, outv = node_val(x), node_val(out)
    if xv is None or outv is None or xv.dim() != 4 or not same_shape(xv, outv):
        return None
    rot = xv.shape[-1]
    if not isinstance(rot, int) or rot % 2:
        return None
    half = rot // 2
    cat = next(n for n in match.nodes if n.target == aten.cat.default)
    neg = next(n for n in match.nodes if n.target == aten.neg.default)
    flipped = cat.args[0][1] is neg  # cat(x2, -x1)
    hi, lo = (cat.args[0][0], neg.args[0]) if flipped else (neg.args[0], cat.args[0][1])
    if _norm_dim(_arg(cat, 1, "dim", 0), 4) != 3:
        return None
    if not (_is_last_dim_slice(lo, 0, half, half) and _is_last_dim_slice(hi, half, rot)):
        return None
    rope = _finish(x, out, cos_u, sin_u, rot, interleaved=False)
    if rope is not None:
        rope.flipped = flipped
    return rope


def _verify_halves(match) -> _Rope | None:
    """Check a halves-pattern match: ``chunk(x, 2, -1)`` and half-width cos/sin (gpt-oss)."""
    x, cos_u, sin_u = match.inputs.values()
    out = match.outputs[0]
    xv, outv = node_val(x), node_val(out)
    if xv is None or outv is None or xv.dim() != 4 or not same_shape(xv, outv):
        return None
    rot = xv.shape[-1]
    if not isinstance(rot, int) or rot % 2:
        return None
    chunk = next(n for n in match.nodes if n.target == aten.chunk.default)
    cat = next(n for n in match.nodes if n.target == aten.cat.default)
    if _arg(chunk, 1, "chunks") != 2 or _norm_dim(_arg(chunk, 2, "dim", 0), 4) != 3:
        return None
    if _norm_dim(_arg(cat, 1, "dim", 0), 4) != 3:
        return None
    cos_src, sin_src = _broadcast_source(cos_u, 4), _broadcast_source(sin_u, 4)
    if cos_src is None or sin_src is None or cos_src[1:] != sin_src[1:]:
        return None
    if not all(sizes_equal(node_val(t).shape[-1], rot // 2) for t in (cos_u, sin_u)):
        return None
    base, replaced = _partial_rotary(x, out, rot)
    return _Rope(x=base, out=replaced, cos=cos_src[0], sin=sin_src[0], dim=cos_src[1], squeeze=cos_src[2],
                 cos_form="chunk")


def _is_step2_slice(node: Node, start: int, rot: int) -> bool:
    """``node`` is ``src[..., start::2]`` over all ``rot`` last-dim features."""
    bounds = _slice_bounds(node)
    if bounds is None:
        return False
    dim, s, e, step = bounds
    return dim == node_val(node.args[0]).dim() - 1 and s == start and step == 2 and isinstance(e, int) and e >= rot


def _verify_interleaved(match) -> _Rope | None:
    """Check an interleaved-pattern match: ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``."""
    x, cos_u, sin_u = match.inputs.values()
    out = match.outputs[0]
    xv, outv = node_val(x), node_val(out)
    if xv is None or outv is None or xv.dim() != 4 or not same_shape(xv, outv):
        return None
    rot = xv.shape[-1]
    if not isinstance(rot, int) or rot % 2:
        return None
    stack = next(n for n in match.nodes if n.target == aten.stack.default)
    flat = next(n for n in match.nodes if n.target == aten.flatten.using_ints)
    neg = next(n for n in match.nodes if n.target == aten.neg.default)
    odd, even = neg.args[0], stack.args[0][1]
    if _norm_dim(_arg(stack, 1, "dim", 0), 5) != 4:
        return None
    if _norm_dim(_arg(flat, 1, "start_dim", 0), 5) != 3 or _norm_dim(_arg(flat, 2, "end_dim", -1), 5) != 4:
        return None
    if not (_is_step2_slice(even, 0, rot) and _is_step2_slice(odd, 1, rot)):
        return None
    return _finish(x, out, cos_u, sin_u, rot, interleaved=True)


def _verify_deinterleaving(match) -> _Rope | None:
    """Check a de-interleaving-pattern match: x[..., ::2] / x[..., 1::2] over the whole last dim, the cat on it,
    cos/sin broadcast over the heads with half the rotary width."""
    x, cos_u, sin_u = match.inputs.values()
    out = match.outputs[0]
    xv, outv = node_val(x), node_val(out)
    if xv is None or outv is None or xv.dim() != 4 or not same_shape(xv, outv):
        return None
    rot = xv.shape[-1]
    if not isinstance(rot, int) or rot % 2:
        return None
    slices = [n for n in match.nodes if n.target == aten.slice.Tensor]
    if sorted(_slice_bounds(n)[1] for n in slices) != [0, 1] or not all(_is_step2_slice(n, _slice_bounds(n)[1], rot)
                                                                         for n in slices):
        return None
    if _norm_dim(_arg(out, 1, "dim", 0), 4) != 3:
        return None
    cos_src, sin_src = _broadcast_source(cos_u, 4), _broadcast_source(sin_u, 4)
    if cos_src is None or sin_src is None or cos_src[1:] != sin_src[1:]:
        return None
    if not all(sizes_equal(node_val(src).shape[-1], rot // 2) for src in (cos_u, sin_u)):
        return None
    return _Rope(x=x, out=out, cos=cos_src[0], sin=sin_src[0], dim=cos_src[1], squeeze=cos_src[2], cos_form="half")


def _single_user(node: Node, targets) -> Node | None:
    """The only user of ``node`` when it calls one of ``targets``."""
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if user.op == "call_function" and user.target in targets else None


def _find_complex_ropes(gm: GraphModule) -> list[_Rope]:
    """``view_as_real(view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs).flatten(3)`` (x 4D, maybe cast to
    float first; ``freqs`` complex, broadcast over the heads): DeepSeek-V2's and Llama 4's complex-frequency rope."""
    ropes = []
    for vc in gm.graph.find_nodes(op="call_function", target=aten.view_as_complex.default):
        pairs = vc.args[0]
        if not is_call(pairs, aten.reshape.default) and not is_call(pairs, aten.view.default):
            continue
        x, pv = pairs.args[0], node_val(pairs)
        xv = node_val(x)
        if xv is None or pv is None or xv.dim() != 4 or pv.dim() != 5 or not sizes_equal(pv.shape[-1], 2):
            continue
        if not all(sizes_equal(a, b) for a, b in zip(pv.shape[:3], xv.shape[:3])):
            continue
        rot = static_int(xv.shape[-1])
        if rot is None or rot % 2 or not sizes_equal(pv.shape[3], rot // 2):
            continue
        mul = _single_user(vc, (aten.mul.Tensor,))
        if mul is None or len(mul.args) != 2:
            continue
        freqs = mul.args[1] if mul.args[0] is vc else mul.args[0]
        fv = node_val(freqs)
        if not isinstance(freqs, Node) or fv is None or not fv.is_complex() or not sizes_equal(fv.shape[-1], rot // 2):
            continue
        src = _broadcast_source(freqs, 4)  # over the [b, n, s, rot/2] complex view
        as_real = _single_user(mul, (aten.view_as_real.default,))
        flat = as_real and _single_user(as_real, (aten.flatten.using_ints,))
        if src is None or flat is None or not same_shape(node_val(flat), xv):
            continue
        if _norm_dim(_arg(flat, 1, "start_dim", 0), 5) != 3 or _norm_dim(_arg(flat, 2, "end_dim", -1), 5) != 4:
            continue
        ropes.append(_Rope(x=x, out=flat, cos=src[0], sin=src[0], dim=src[1], squeeze=src[2], interleaved=True,
                           cos_form="complex"))
    return ropes


def _finish(x: Node, out: Node, cos_u: Node, sin_u: Node, rot: int, interleaved: bool) -> _Rope | None:
    """The checks both forms share: how cos/sin broadcast, their size, partial rotary."""
    cos_src, sin_src = _broadcast_source(cos_u, 4), _broadcast_source(sin_u, 4)
    if cos_src is None or sin_src is None or cos_src[1:] != sin_src[1:]:
        return None
    for src in (cos_u, sin_u):
        if not sizes_equal(node_val(src).shape[-1], rot):
            return None
    dim, squeeze = cos_src[1], cos_src[2]
    base, replaced = _partial_rotary(x, out, rot)
    return _Rope(x=base, out=replaced, cos=cos_src[0], sin=sin_src[0], dim=dim, squeeze=squeeze,
                 interleaved=interleaved)


def _partial_rotary(x: Node, out: Node, rot: int) -> tuple[Node, Node]:
    """Partial rotary: ``cat(rope(q[..., :rot]), q[..., rot:])`` -> (q, the cat); else (x, out).

    Also covers GPT-NeoX-style full rotary, where the pass-through slice is empty.
    """
    base = x.args[0] if _is_last_dim_slice(x, 0, rot, rot) else x
    base_val = node_val(base)
    if base_val is None or base_val.dim() != 4 or len(out.users) != 1:
        return x, out
    cat = next(iter(out.users))
    if not is_call(cat, aten.cat.default) or _norm_dim(_arg(cat, 1, "dim", 0), 4) != 3:
        return x, out
    parts = cat.args[0]
    if len(parts) != 2 or parts[0] is not out:
        return x, out
    rest = parts[1]
    head_dim = base_val.shape[-1]
    if not isinstance(head_dim, int) or not _is_last_dim_slice(rest, rot, head_dim) or rest.args[0] is not base:
        return x, out
    if not same_shape(node_val(cat), base_val):
        return x, out
    return base, cat


_LAYOUT_OPS = {
    aten.view.default, aten.reshape.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
    aten.expand.default, aten.contiguous.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
}


def _consumer_slots(node: Node, depth: int = 6) -> set[tuple[Node, int]]:
    """(consumer, arg index) where ``node``'s value reaches a non-layout op through layout-only ops."""
    slots: set[tuple[Node, int]] = set()
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for user in n.users:
                if user.op == "call_function" and user.target in _LAYOUT_OPS:
                    nxt.append(user)
                else:
                    slots.update((user, i) for i, a in enumerate(user.args) if a is n)
        frontier = nxt
    return slots


def _looks_swapped(q: _Rope, k: _Rope) -> bool:
    """True when the 'k' candidate feeds the query slot (arg 0) of an op whose key slot (arg 1) the
    'q' candidate feeds (an attention op, or eager attention's q @ k^T)."""
    q_slots, k_slots = _consumer_slots(q.out), _consumer_slots(k.out)
    return any((c, 1) in q_slots for c, i in k_slots if i == 0)


def _early_users(pos: dict[Node, int], q: _Rope, k: _Rope) -> list[Node] | None:
    """The nodes that depend on an output and come before the last input (q, k, cos, sin), in graph order:
    they move after the fused op (e.g. Gemma 4 transposes q's rope output before it projects k). None when
    an input itself depends on an output (no single op can then replace both)."""
    inputs = (q.x, k.x, q.cos, q.sin)
    last = max(pos[n] for n in inputs)
    early: set[Node] = set()
    frontier = [u for r in (q, k) for u in r.out.users]
    while frontier:
        node = frontier.pop()
        if node in early or pos[node] > last:
            continue
        early.add(node)
        frontier.extend(node.users)
    if any(n in early for n in inputs):
        return None
    return sorted(early, key=pos.__getitem__)


def _can_fuse(pos: dict[Node, int], q: _Rope, k: _Rope) -> bool:
    """One op after both inputs (and cos/sin), with every use of both outputs after it (moved there when
    nothing the op needs depends on them)."""
    return _early_users(pos, q, k) is not None


def _find_single_ropes(gm: GraphModule) -> list[_Rope]:
    ropes: dict[Node, _Rope] = {}
    forms = [(p, _verify) for p in _rope_patterns() + _rope_patterns(flipped=True)]
    forms += [(p, _verify_interleaved) for p in _interleaved_patterns()]
    forms += [(p, _verify_deinterleaving) for p in _deinterleaving_patterns()]
    forms += [(p, _verify_halves) for p in _halves_patterns()]
    for pattern, verify in forms:
        for match in find_matches(gm, pattern, ignore_literals=True):
            if match.outputs[0] in ropes:
                continue
            rope = verify(match)
            if rope is not None:
                ropes[match.outputs[0]] = rope
    return list(ropes.values()) + _find_complex_ropes(gm)


def _pair_ropes(gm: GraphModule, ropes: list[_Rope]) -> list[tuple[_Rope, _Rope]]:
    """Pair q and k ropes that share cos/sin, in graph order."""
    pos = _positions(gm)
    groups: dict[tuple, list[_Rope]] = {}
    for rope in ropes:
        key = (rope.cos, rope.sin, rope.dim, rope.squeeze, rope.interleaved, rope.flipped, rope.cos_form)
        groups.setdefault(key, []).append(rope)
    pairs = []
    for group in groups.values():
        group.sort(key=lambda r: pos[r.out])
        i = 0
        while i + 1 < len(group):
            q, k = group[i], group[i + 1]
            if _can_fuse(pos, q, k):
                pairs.append((k, q) if _looks_swapped(q, k) else (q, k))
                i += 2
            else:
                i += 1
    return pairs


def _deinterleave(graph, x: Node) -> Node:
    """``cat(x[..., ::2], x[..., 1::2], -1)``: neighbouring pairs split into the two halves rotate_half pairs."""
    halves = [graph.call_function(aten.slice.Tensor, (x, -1, start, _INT_MAX, 2)) for start in (0, 1)]
    return graph.call_function(aten.cat.default, (halves, -1))


def _fuse_pair(gm: GraphModule, pos: dict[Node, int], q: _Rope, k: _Rope) -> bool:
    early = _early_users(pos, q, k)
    if early is None:  # an earlier pair's rewrite moved things: leave this one
        return False
    anchor = max((q.x, k.x, q.cos, q.sin), key=pos.__getitem__)
    for node in reversed(early):  # after the anchor, in their order; the op goes between
        anchor.append(node)
    with _insert_after(gm, anchor):
        graph = gm.graph
        cos, sin = q.cos, q.sin
        if q.squeeze:
            cos = graph.call_function(aten.squeeze.dim, (cos, q.dim))
            sin = graph.call_function(aten.squeeze.dim, (sin, q.dim))
        if q.flipped:  # rotate_half the other way round: the same rotation by -angle
            sin = graph.call_function(aten.neg.default, (sin,))
        qx, kx = q.x, k.x
        if q.cos_form == "half":  # the rotate_half rope of the de-interleaved q/k
            cos, sin = (graph.call_function(aten.cat.default, ([c, c], -1)) for c in (cos, sin))
            qx, kx = (_deinterleave(graph, x) for x in (qx, kx))
        elif q.cos_form == "chunk":  # gpt-oss: each frequency once, repeated over the two halves
            cos, sin = (graph.call_function(aten.cat.default, ([c, c], -1)) for c in (cos, sin))
        elif q.cos_form == "complex":  # (cos, sin) of each pair's angle, once per feature of the pair
            parts = graph.call_function(aten.view_as_real.default, (cos,))
            cos, sin = (graph.call_function(aten.repeat_interleave.self_int,
                                            (graph.call_function(aten.select.int, (parts, -1, i)), 2, -1))
                        for i in (0, 1))
        op = graph.call_function(ROPE_OP, (qx, kx, cos, sin, q.dim) + ((True,) if q.interleaved else ()))
        q_out = gm.graph.call_function(operator.getitem, (op, 0))
        k_out = gm.graph.call_function(operator.getitem, (op, 1))
    q.out.replace_all_uses_with(q_out)
    k.out.replace_all_uses_with(k_out)
    return True



@TransformRegistry.register("match_rope_pattern")
class MatchRopePattern(BaseTransform):
    """Replace each attention layer's q/k rotate_half RoPE with one ``torch_rope_with_explicit_cos_sin``."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        pairs = _pair_ropes(gm, _find_single_ropes(gm))
        fused = sum(_fuse_pair(gm, _positions(gm), q, k) for q, k in pairs)  # positions move with early users
        return gm, TransformInfo.changed(fused)


# ------------------------------------------------------------------------------------------------
# match_rope_layout
# ------------------------------------------------------------------------------------------------
def _is_swap_1_2(node: Node) -> bool:
    """``node`` swaps dims 1 and 2 of a 4D tensor (``transpose(1, 2)`` or ``permute(0, 2, 1, 3)``)."""
    src = node_val(node.args[0]) if isinstance(node, Node) and node.args else None
    if src is None or src.dim() != 4 or node.op != "call_function":
        return False
    if node.target == aten.transpose.int:
        return {_norm_dim(node.args[1], 4), _norm_dim(node.args[2], 4)} == {1, 2}
    if node.target == aten.permute.default:
        return [_norm_dim(d, 4) for d in node.args[1]] == [0, 2, 1, 3]
    return False


def _to_bsnd(gm: GraphModule, x: Node) -> Node:
    """[b, n, s, d] -> [b, s, n, d]: the untransposed source when ``x`` is a transpose, else a transpose."""
    if _is_swap_1_2(x):
        return x.args[0]
    return gm.graph.call_function(aten.transpose.int, (x, 1, 2))


def _rope_unsqueeze_dim(node: Node) -> int | None:
    dim = _arg(node, 4, "unsqueeze_dim", 1)
    cos = node_val(node.args[2])
    return _norm_dim(dim, cos.dim() + 1) if cos is not None else None


@TransformRegistry.register("match_rope_layout")
class MatchRopeLayout(BaseTransform):
    """Make every rope op work on [batch, seq, heads, head_dim] q/k (``unsqueeze_dim=2``)."""

    config: GraphRewriteConfig

    def _apply(self, gm: GraphModule, ctx: PipelineContext) -> tuple[GraphModule, TransformInfo]:
        num = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=ROPE_OP)):
            q, k, cos, sin = node.args[:4]
            qv, kv = node_val(q), node_val(k)
            if qv is None or kv is None or qv.dim() != 4 or kv.dim() != 4 or _rope_unsqueeze_dim(node) != 1:
                continue
            if not all(u.op == "call_function" and u.target == operator.getitem for u in node.users):
                continue
            with gm.graph.inserting_before(node):
                extra = (True,) if _arg(node, 5, "interleaved", False) else ()
                new = gm.graph.call_function(ROPE_OP, (_to_bsnd(gm, q), _to_bsnd(gm, k), cos, sin, 2, *extra))
                outs = {}
                for i in (0, 1):
                    item = gm.graph.call_function(operator.getitem, (new, i))
                    outs[i] = gm.graph.call_function(aten.transpose.int, (item, 1, 2))
            for user in list(node.users):
                user.replace_all_uses_with(outs[user.args[1]])
            num += 1
        return gm, TransformInfo.changed(num)
