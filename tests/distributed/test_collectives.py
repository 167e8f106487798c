"""The collectives as canonical ops: without a process group they are copies; their fake implementations
give the gathered shape, so sharded graphs shape-propagate (the real collectives run in
test_tensor_parallel.py across processes)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autodeploy.custom_ops  # noqa: F401  (registers the ops)

all_reduce = torch.ops.auto_deploy.torch_dist_all_reduce
all_gather = torch.ops.auto_deploy.torch_dist_all_gather


def test_one_process_is_a_copy():
    x = torch.randn(2, 3, 8)
    reduced, gathered = all_reduce(x), all_gather(x, -1)
    assert torch.equal(reduced, x) and torch.equal(gathered, x)
    assert reduced.data_ptr() != x.data_ptr() and gathered.data_ptr() != x.data_ptr()


def test_fake_shapes_and_opcheck(monkeypatch):
    from autodeploy.custom_ops import distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 4)
    with FakeTensorMode():
        x = torch.empty(2, 3, 8)
        assert all_reduce(x).shape == (2, 3, 8)
        assert all_gather(x, -1).shape == (2, 3, 32) and all_gather(x, 0).shape == (8, 3, 8)
    monkeypatch.undo()
    torch.library.opcheck(all_reduce.default, (torch.randn(3, 4),))
    torch.library.opcheck(all_gather.default, (torch.randn(3, 4), -1))
