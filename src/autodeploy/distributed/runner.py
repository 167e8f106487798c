"""Build a pipeline on every rank of a ``world_size`` run: the module rank 0 serves, or the step loop of the
other ranks (see :mod:`autodeploy.distributed`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import AutoDeployError, ConfigError
from . import (
    RankInfo,
    RankZeroModule,
    Workers,
    failed_rank_error,
    init_process_group,
    launcher_env,
    serve_steps,
    spawn_workers,
    stop_workers,
)


@dataclass
class BuiltModel:
    """What this process got: rank 0 the module to serve (``module``), the others served their steps and
    got None. ``factory`` describes the checkpoint either way."""

    module: nn.Module | None
    factory: Any
    rank: int
    workers: Workers | None = None

    def close(self) -> dict[int, int]:
        """Rank 0: end the other ranks' step loops, wait for spawned workers, and leave the process group.
        Returns the peak RSS of each rank whose figure is known (rank 0's, and spawned workers')."""
        import torch.distributed as dist

        from ..utils.memory import peak_rss_bytes

        peaks = {self.rank: peak_rss_bytes()}
        if self.workers is not None:
            self.workers.close()
            peaks.update(self.workers.peak_rss_bytes)
            self.workers = None
        elif self.rank == 0:
            stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        return peaks


def _backend(config) -> str:
    return (config.transforms.get("detect_sharding") or {}).get("dist_backend", "auto")


def _build(config):
    from ..api import build_optimizer

    optimizer, factory = build_optimizer(config)
    return optimizer(), factory


def _failure(err: BaseException, workers: Workers | None) -> AutoDeployError | None:
    """Rank 0's build failed: a worker's own failure explains it best (None: nothing more to say)."""
    if workers is None:
        return None
    cause = workers.failure(wait_s=0.5)
    workers.close(timeout=2.0)
    if cause is not None:
        return AutoDeployError(f"distributed run failed: {cause}")
    return failed_rank_error(err, None) if isinstance(err, RuntimeError) else None


def _leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def build_model(config) -> BuiltModel:
    """The pipeline of ``config`` on this rank: one process for ``world_size`` 1; under a launcher (torchrun)
    the ranks it started; otherwise ranks 1.. spawned here, this process rank 0."""
    world = config.world_size
    if world == 1:
        module, factory = _build(config)
        return BuiltModel(module, factory, 0)
    launched = launcher_env()
    workers = None
    if launched is not None:
        if launched.world_size != world:
            raise ConfigError(f"world_size={world} but the launcher started {launched.world_size} processes")
        init_process_group(RankInfo(launched.rank, world, launched.local_rank, launched.local_world_size),
                           _backend(config), config.device)
        rank = launched.rank
    else:
        workers = spawn_workers(world, _backend(config), config.device, config.model_dump(mode="json"))
        rank = 0
    try:
        module, factory = _build(config)
    except (AutoDeployError, RuntimeError) as err:
        failure = _failure(err, workers)
        _leave_group()
        if failure is not None:
            raise failure from err
        raise
    if rank != 0:
        serve_steps(module)
        return BuiltModel(None, factory, rank)
    return BuiltModel(RankZeroModule(module, workers), factory, 0, workers)
