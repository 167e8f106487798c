"""post_export clean-ups: op counts before/after and unchanged numerics on small exported graphs."""

import pytest
import torch

from autodeploy.transform import transform_history
from helpers import count, export_gm, run_transform

aten = torch.ops.aten
BATCH = {0: torch.export.Dim("batch", min=1, max=16)}  # dim 0 of every input


class Slices(torch.nn.Module):
    def forward(self, x, y):
        whole = y[: x.shape[0]]  # no-op: x and y share the batch dim (export keeps this slice)
        half = x[:, : x.shape[1] // 2]  # a real slice
        return whole * 2, half


class Adds(torch.nn.Module):
    def forward(self, x):
        a = x + torch.zeros_like(x)  # no-op
        b = 0 + a  # no-op (scalar)
        c = b + torch.zeros(1, 8)  # no-op: broadcasting keeps x's shape and dtype
        d = torch.zeros(3, 8) + x[:1]  # NOT a no-op: the zeros broadcast x[:1] to 3 rows
        return c, d


def test_noop_slice_removed_real_slice_kept():
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    gm = export_gm(Slices(), x, y, dims=BATCH)
    before = count(gm, aten.slice.Tensor)
    expected = gm(x, y)
    gm = run_transform("cleanup_noop_slice", gm, "post_export")
    info = transform_history(gm)["cleanup_noop_slice"].info
    assert info.num_matches >= 1 and not info.skipped
    assert count(gm, aten.slice.Tensor) == before - info.num_matches
    assert count(gm, aten.slice.Tensor) >= 1  # x[:, :4] stays
    for out, ref in zip(gm(x, y), expected):
        torch.testing.assert_close(out, ref)
    x5, y5 = torch.randn(5, 8), torch.randn(5, 8)  # still dynamic
    torch.testing.assert_close(gm(x5, y5)[0], y5 * 2)


def test_noop_add_removed_broadcasting_add_kept():
    x = torch.randn(3, 8)
    gm = export_gm(Adds(), x, dims=BATCH)
    before = count(gm, aten.add.Tensor)
    expected = gm(x)
    gm = run_transform("cleanup_noop_add", gm, "post_export")
    assert transform_history(gm)["cleanup_noop_add"].info.num_matches == 3
    assert count(gm, aten.add.Tensor) == before - 3 == 1
    for out, ref in zip(gm(x), expected):
        torch.testing.assert_close(out, ref)


class Guarded(torch.nn.Module):
    def forward(self, x):
        n = x.shape[0]
        torch._check(n <= 16)
        return x.sum(0) * n


def test_input_constraints_removed():
    x = torch.randn(3, 8)
    gm = export_gm(Guarded(), x, dims=BATCH)
    constraints = [n for n in gm.graph.nodes if n.op == "call_module" or "assert" in str(n.target)]
    assert constraints, "export should have produced guard/assert nodes"
    gm = run_transform("cleanup_input_constraints", gm, "post_export")
    assert transform_history(gm)["cleanup_input_constraints"].info.num_matches == len(constraints)
    assert not [n for n in gm.graph.nodes if n.op == "call_module" or "assert" in str(n.target)]
    assert not hasattr(gm, "_guards_fn")
    torch.testing.assert_close(gm(x)[0], x.sum(0) * 3)


def test_nothing_to_clean_reports_zero_matches():
    gm = export_gm(Slices(), torch.randn(3, 8), torch.randn(3, 8), dims=BATCH)
    gm = run_transform("cleanup_noop_add", gm, "post_export")
    info = transform_history(gm)["cleanup_noop_add"].info
    assert info.num_matches == 0 and not info.skipped


class Casts(torch.nn.Module):
    def forward(self, x):
        same = x.to(torch.float32)  # no-op on fp32 input
        residual = same + 1  # refers to the cast node after export
        half = same.to(torch.bfloat16)  # a real conversion
        return residual, half


def test_noop_casts_removed_real_casts_kept():
    x = torch.randn(3, 8)
    gm = export_gm(Casts(), x, dims=BATCH)
    conversions = (aten.to.dtype, aten._to_copy.default)
    before = sum(count(gm, t) for t in conversions)
    gm = run_transform("cleanup_noop_to", gm, "post_export")
    assert transform_history(gm)["cleanup_noop_to"].info.num_matches == 1
    assert sum(count(gm, t) for t in conversions) == before - 1 >= 1
    residual, half = gm(x)
    torch.testing.assert_close(residual, x + 1)
    assert half.dtype == torch.bfloat16


class SliceWrites(torch.nn.Module):
    """HF's MLA ``expand_kv``: a fresh key buffer filled by two slice copies (the second an expanded k_rot)."""

    def forward(self, k_nope, k_rot):
        key = k_nope.new_empty(*k_nope.shape[:-1], 12)
        key[..., :8].copy_(k_nope)
        key[..., 8:].copy_(k_rot.expand(-1, k_nope.shape[1], -1, -1))
        return (key * 2,)


class SliceWritesGap(torch.nn.Module):
    """Slices that leave features 8..9 unwritten: not a cat, must stay."""

    def forward(self, k_nope, k_rot):
        key = k_nope.new_empty(*k_nope.shape[:-1], 14)
        key[..., :8].copy_(k_nope)
        key[..., 10:].copy_(k_rot.expand(-1, k_nope.shape[1], -1, -1))
        return (key * 2,)


class SliceWritesReadBetween(torch.nn.Module):
    """The buffer is read between the two writes: the read sees only the first, must stay."""

    def forward(self, k_nope, k_rot):
        key = k_nope.new_empty(*k_nope.shape[:-1], 12)
        key[..., :8].copy_(k_nope)
        early = key[..., :8].sum()
        key[..., 8:].copy_(k_rot.expand(-1, k_nope.shape[1], -1, -1))
        return (key * early,)


class SliceWritesBroadcast(torch.nn.Module):
    """``copy_`` broadcasting a single head over the slice: not a value of the slice's own shape, must stay."""

    def forward(self, k_nope, k_rot):
        key = k_nope.new_empty(*k_nope.shape[:-1], 12)
        key[..., :8].copy_(k_nope)
        key[..., 8:].copy_(k_rot)
        return (key * 2,)


def _kv_inputs(batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, 5, 8, generator=gen), torch.randn(batch, 1, 5, 4, generator=gen)


def test_slice_writes_become_a_cat():
    gm = export_gm(SliceWrites(), *_kv_inputs(), dims=BATCH, strict=False)
    assert count(gm, aten.copy_.default) == 2 and count(gm, aten.new_empty.default) == 1
    gm = run_transform("cleanup_slice_writes", gm, "post_export")
    info = transform_history(gm)["cleanup_slice_writes"].info
    assert info.num_matches == 1 and info.has_valid_shapes
    assert count(gm, aten.copy_.default) == count(gm, aten.new_empty.default) == count(gm, aten.slice.Tensor) == 0
    (cat,) = gm.graph.find_nodes(op="call_function", target=aten.cat.default)
    assert cat.args[1] == 3 and cat.args[0][0].name == "k_nope"
    gm.graph.lint()
    for batch in (2, 3):
        args = _kv_inputs(batch, seed=batch)
        torch.testing.assert_close(gm(*args), SliceWrites()(*args), rtol=0, atol=0)


@pytest.mark.parametrize("module", [SliceWritesGap(), SliceWritesReadBetween(), SliceWritesBroadcast()],
                         ids=["gap", "read_between", "broadcast"])
def test_slice_writes_left_alone(module):
    gm = export_gm(module, *_kv_inputs(), dims=BATCH, strict=False)
    code = gm.code
    gm = run_transform("cleanup_slice_writes", gm, "post_export")
    assert transform_history(gm)["cleanup_slice_writes"].info.num_matches == 0 and gm.code == code
