"""Process launch and rank coordination over torch.distributed.

Two ways to run ``world_size`` ranks:

- Without a launcher, :func:`spawn_workers` starts ranks 1..N-1 on this machine (one process each) while
  the calling process is rank 0: it builds its own shard of the model and drives the
  scheduler; each step's inputs are broadcast to the other ranks (:class:`RankZeroModule`), which run the
  same graph on their shard (:func:`serve_steps`).
- Under ``torchrun`` (its environment variables present, :func:`launcher_env`), the processes are taken as
  given: every rank runs the same program, rank 0 drives, the others serve steps.

The process group is gloo on CPU and NCCL on CUDA (``dist_backend: auto``). A rank that fails reports its
error before it exits; the others notice the broken group (gloo errors out when a peer goes, and every
collective has a timeout, ``AUTODEPLOY_DIST_TIMEOUT`` seconds) and raise one
:class:`~autodeploy.errors.AutoDeployError` naming the failed rank and its cause. Spawned workers end when
rank 0 closes, and get SIGTERM if rank 0's process dies.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import AutoDeployError
from ..utils.logger import ad_logger, refresh_level

#: seconds a collective may wait for the other ranks before the run is declared failed
TIMEOUT_ENV = "AUTODEPLOY_DIST_TIMEOUT"
_DEFAULT_TIMEOUT_S = 300.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launcher_env() -> RankInfo | None:
    """This process's rank as a launcher (torchrun) set it in the environment, or None."""
    if not all(name in os.environ for name in _TORCHRUN_VARS):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return RankInfo(int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]),
                    int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S))


def resolve_backend(backend: str, device: str) -> str:
    """``auto`` -> NCCL for CUDA devices, gloo otherwise."""
    if backend != "auto":
        return backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(info: RankInfo, backend: str, device: str) -> None:
    """Join the default process group (once per process), with this rank's share of the CPU threads."""
    if dist.is_initialized():
        return
    os.environ["RANK"] = str(info.rank)  # the logger and the graph writer read the rank from here too
    refresh_level()
    threads = max(1, (os.cpu_count() or 1) // max(1, info.local_world_size))
    torch.set_num_threads(threads)
    dist.init_process_group(resolve_backend(backend, device), rank=info.rank, world_size=info.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s()))
    ad_logger.info(f"rank {info.rank} of {info.world_size} joined ({dist.get_backend()}, {threads} thread(s))")


def agree_min(value: int) -> int:
    """The smallest of every rank's ``value`` (1 rank: ``value``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- steps: rank 0 broadcasts each forward's inputs, the others run them --------------------------------
# Each step is two broadcasts: a fixed-size int64 header (the inputs' dtypes and shapes; -1 means stop),
# then the inputs (integer tensors: token ids and cache metadata) packed into one int64 tensor.
_HEADER_LEN = 64
_STOP = -1
_INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def _broadcast_inputs(args: tuple[torch.Tensor, ...]) -> None:
    header = [len(args)]
    for a in args:
        if a.dtype not in _INT_DTYPES:
            raise AutoDeployError(f"a distributed step's inputs are integer tensors, got {a.dtype}")
        header += [_INT_DTYPES.index(a.dtype), a.dim(), *a.shape]
    if len(header) > _HEADER_LEN:
        raise AutoDeployError(f"a step's {len(args)} inputs need a header longer than {_HEADER_LEN}")
    dist.broadcast(torch.tensor(header + [0] * (_HEADER_LEN - len(header)), dtype=torch.int64), src=0)
    dist.broadcast(torch.cat([a.reshape(-1).to(torch.int64) for a in args]), src=0)


def _receive_inputs() -> list[torch.Tensor] | None:
    header = torch.empty(_HEADER_LEN, dtype=torch.int64)
    dist.broadcast(header, src=0)
    values = header.tolist()
    if values[0] == _STOP:
        return None
    specs, at = [], 1
    for _ in range(values[0]):
        dtype, ndim = _INT_DTYPES[values[at]], values[at + 1]
        specs.append((dtype, tuple(values[at + 2:at + 2 + ndim])))
        at += 2 + ndim
    sizes = [int(torch.Size(shape).numel()) for _, shape in specs]
    packed = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(packed, src=0)
    return [part.reshape(shape).to(dtype) for part, (dtype, shape) in zip(packed.split(sizes), specs)]


class RankZeroModule(nn.Module):
    """Rank 0's view of the model: each call first sends its inputs to the other ranks, then runs the local
    shard (every rank's collectives then meet inside the graph). The local module stays a submodule, so the
    runtime finds the cached graph in it."""

    def __init__(self, local: nn.Module, workers: "Workers | None" = None):
        super().__init__()
        self.local = local
        self._workers = workers

    def forward(self, *args: torch.Tensor):
        try:
            _broadcast_inputs(args)
            return self.local(*args)
        except RuntimeError as err:
            raise failed_rank_error(err, self._workers) from err


def serve_steps(module: nn.Module) -> int:
    """The loop of ranks other than 0: run every forward rank 0 announces until it says stop. Returns the
    number of steps served."""
    steps = 0
    while (args := _receive_inputs()) is not None:
        with torch.no_grad():
            module(*args)
        steps += 1
    return steps


def stop_workers() -> None:
    """Rank 0: tell the other ranks' step loops to end (a no-op without a group)."""
    if dist.is_initialized() and dist.get_rank() == 0 and dist.get_world_size() > 1:
        try:
            dist.broadcast(torch.tensor([_STOP] + [0] * (_HEADER_LEN - 1), dtype=torch.int64), src=0)
        except RuntimeError:  # the others are gone already
            pass


# -- spawned workers ------------------------------------------------------------------------------------
WORKER_DIR_ENV = "AUTODEPLOY_WORKER_DIR"


def _die_with_parent() -> None:
    """In a worker, before exec: get SIGTERM when rank 0's process goes, however it goes (Linux)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Workers:
    """Ranks 1..N-1 started by this process (rank 0), and the errors they report (one file per failed rank
    in their scratch folder)."""

    def __init__(self, processes: list, scratch: Any):
        self.processes, self._scratch = processes, scratch
        self.peak_rss_bytes: dict[int, int] = {}  # rank -> its peak RSS, as it reported when it stopped
        atexit.register(self.close)

    def failure(self, wait_s: float = 2.0) -> str | None:
        """The first error a worker reported (waiting up to ``wait_s`` for one), or a dead worker's exit code."""
        import time
        from pathlib import Path

        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(1, len(self.processes) + 1):
                report = Path(self._scratch.name) / f"error-rank{rank}.txt"
                if report.is_file() and report.stat().st_size:
                    return f"rank {rank} failed: {report.read_text().strip()}"
            dead = [(rank, p.poll()) for rank, p in enumerate(self.processes, start=1) if p.poll() not in (None, 0)]
            if time.monotonic() >= deadline:
                return f"rank {dead[0][0]} exited with code {dead[0][1]}" if dead else None
            time.sleep(0.05)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the step loops, then make sure no worker outlives rank 0."""
        if not self.processes:
            return
        stop_workers()
        for process in self.processes:
            try:
                process.wait(timeout)
            except Exception:  # noqa: BLE001 - still running: it goes now
                process.terminate()
                try:
                    process.wait(timeout)
                except Exception:  # noqa: BLE001
                    process.kill()
        from pathlib import Path

        for rank in range(1, len(self.processes) + 1):
            report = Path(self._scratch.name) / f"peak-rss-rank{rank}.txt"
            if report.is_file():
                self.peak_rss_bytes[rank] = int(report.read_text())
        self.processes = []
        self._scratch.cleanup()


def failed_rank_error(err: BaseException, workers: Workers | None) -> AutoDeployError:
    """One error naming the rank that failed and its cause (``err``: what this rank saw)."""
    cause = workers.failure() if workers is not None else None
    if cause is None:
        cause = f"a collective failed on rank {dist.get_rank() if dist.is_initialized() else 0}: {err}"
    return AutoDeployError(f"distributed run failed: {cause}")


def report_failure(rank: int, exc: BaseException) -> None:
    """In a spawned worker: leave the error for rank 0 to name."""
    from pathlib import Path

    folder = os.environ.get(WORKER_DIR_ENV)
    if folder:
        (Path(folder) / f"error-rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")


def report_peak_rss(rank: int) -> None:
    """In a spawned worker that served its steps: its peak RSS, for rank 0's figures."""
    from pathlib import Path

    from ..utils.memory import peak_rss_bytes

    folder = os.environ.get(WORKER_DIR_ENV)
    if folder:
        (Path(folder) / f"peak-rss-rank{rank}.txt").write_text(str(peak_rss_bytes()))


def spawn_workers(world_size: int, backend: str, device: str, config_data: dict) -> Workers:
    """Start ranks 1..world_size-1 as ``python -m autodeploy.distributed.worker`` processes (each builds its
    shard of ``config_data``'s pipeline and serves steps), then join the group as rank 0 from this process.
    Subprocesses rather than multiprocessing's ``spawn``: that re-imports the user's main module in every
    worker, which a script without a ``__main__`` guard would run again."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    port = _free_port()
    scratch = tempfile.TemporaryDirectory(prefix="autodeploy-ranks-")
    config_file = Path(scratch.name) / "config.json"
    config_file.write_text(json.dumps(config_data))
    processes = []
    for rank in range(1, world_size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
               WORKER_DIR_ENV: scratch.name}
        processes.append(subprocess.Popen([sys.executable, "-m", "autodeploy.distributed.worker", str(config_file)],
                                          env=env, preexec_fn=_die_with_parent))
    workers = Workers(processes, scratch)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        init_process_group(RankInfo(0, world_size, 0, world_size), backend, device)
    except RuntimeError as err:
        failure = failed_rank_error(err, workers)
        workers.close(timeout=1.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise failure from err
    return workers
