"""Collectives as canonical ops, so sharded graphs export, dump, shape-propagate and compile like any other.

    torch_dist_all_reduce(x) -> the sum of x over all ranks
    torch_dist_all_gather(x, dim=-1) -> the ranks' x concatenated along dim, in rank order

They run on torch.distributed's default process group (gloo on CPU, NCCL on CUDA, chosen when the group is
created, see :mod:`autodeploy.distributed`); without one (a single process) they return a copy of ``x``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Ranks of the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.library.custom_op("auto_deploy::torch_dist_all_reduce", mutates_args=())
def torch_dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()  # an op's output may not alias its input
    if world_size() > 1:
        dist.all_reduce(out)
    return out


@torch_dist_all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("auto_deploy::torch_dist_all_gather", mutates_args=())
def torch_dist_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    ranks = world_size()
    if ranks == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(ranks)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


@torch_dist_all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = shape[dim] * world_size()
    return x.new_empty(shape)
