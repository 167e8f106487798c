"""A spawned rank: ``python -m autodeploy.distributed.worker CONFIG_JSON`` with the rank in the environment
(set by :func:`autodeploy.distributed.spawn_workers`). It joins the group, builds its shard of the pipeline,
serves rank 0's steps until told to stop, and reports a failure for rank 0 to name."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from ..config.loader import AutoDeployConfig
    from . import launcher_env, report_failure, report_peak_rss
    from .runner import build_model

    info = launcher_env()
    try:
        config = AutoDeployConfig.model_validate(json.loads(Path(argv[0]).read_text()))
        build_model(config)  # serves the steps (this is not rank 0), then returns
        report_peak_rss(info.rank)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then a non-zero exit
        report_failure(info.rank if info else -1, exc)
        from ..utils.logger import ad_logger

        ad_logger.error(f"{type(exc).__name__}: {exc}")
        return 1
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
