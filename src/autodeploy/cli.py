"""The ``autodeploy`` console script.

    autodeploy build --model PATH [--until STAGE] [--yaml-extra F]... [--set k=v]...
    autodeploy graph diff DIR A B
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .errors import AutoDeployError


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint folder (config.json + *.safetensors) or hub id")
    parser.add_argument("--yaml-extra", action="append", default=[], metavar="FILE",
                        help="extra YAML merged over the default pipeline (repeatable, in order)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="override one config value, e.g. transforms.export_to_gm.strict=true (repeatable, applied last)")


def _build_parser() -> argparse.ArgumentParser:
    from .transform import Stages

    parser = argparse.ArgumentParser(prog="autodeploy", description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)

    build = commands.add_parser("build", help="run the transform pipeline and print its log")
    _add_config_args(build)
    build.add_argument("--until", choices=[s.value for s in Stages], metavar="STAGE",
                       help="stop after this stage (one of: " + ", ".join(s.value for s in Stages) + ")")

    graph = commands.add_parser("graph", help="inspect graph dumps written with AD_DUMP_GRAPHS_DIR")
    graph_commands = graph.add_subparsers(dest="graph_command", required=True)
    diff = graph_commands.add_parser("diff", help="what changed between two dumps of one directory")
    diff.add_argument("dir", help="the dump directory")
    diff.add_argument("a", help="first dump: its number (e.g. 3), file name, or transform key")
    diff.add_argument("b", help="second dump: its number, file name, or transform key")
    return parser


def _cmd_build(args: argparse.Namespace) -> int:
    from .api import build_optimizer
    from .config import load_config
    from .utils.logger import ad_logger

    config = load_config(args.yaml_extra, args.overrides, base={"model": args.model} if args.model else None)
    if not config.model:
        raise AutoDeployError("no model given: pass --model PATH (a checkpoint folder)")
    optimizer, _ = build_optimizer(config)
    optimizer(until=args.until)
    ad_logger.info("build finished" + (f" (until stage {args.until})" if args.until else ""))
    return 0


def _cmd_graph_diff(args: argparse.Namespace) -> int:
    from .utils.graph_diff import diff_dumps

    print(diff_dumps(args.dir, args.a, args.b), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            return _cmd_build(args)
        if args.command == "graph":
            return _cmd_graph_diff(args)
    except AutoDeployError as exc:
        print(f"autodeploy: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autodeploy: interrupted", file=sys.stderr)
        return 130
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
