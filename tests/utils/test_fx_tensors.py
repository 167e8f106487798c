"""utils.fx tensor helpers: copy_out_cpu_tensors (releasing a shared, e.g. memory-mapped, storage)."""

import torch
from torch import nn

from autodeploy.utils.fx import copy_out_cpu_tensors


def test_copy_out_cpu_tensors_releases_the_shared_storage_and_keeps_ties():
    base = torch.arange(100.0)  # stands for a memory-mapped checkpoint: every weight a view into it
    mod = nn.Module()
    mod.emb = nn.Parameter(base[:40].view(10, 4), requires_grad=False)
    mod.sub = nn.Module()
    mod.sub.head = mod.emb  # tied: one tensor under two names
    mod.sub.register_buffer("norm", base[40:44])
    kept = torch.ones(3)
    mod.register_buffer("q", kept)

    copied = copy_out_cpu_tensors(mod, keep={kept.data_ptr()})

    assert copied == (40 + 4) * 4  # the tied tensor is copied once
    assert mod.sub.head is mod.emb and isinstance(mod.emb, nn.Parameter) and not mod.emb.requires_grad
    assert "norm" in mod.sub._buffers and mod.q is kept
    for t, expected in ((mod.emb, base[:40].view(10, 4)), (mod.sub.norm, base[40:44])):
        torch.testing.assert_close(t, expected, atol=0, rtol=0)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # its own storage, not the base's
        assert t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
