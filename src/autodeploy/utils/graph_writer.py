"""Graph dumps: one text file per transform when ``AD_DUMP_GRAPHS_DIR`` is set.

Files are named ``{NNN}_{stage}_{transform_key}.txt`` (NNN a three-digit counter over the dumps
of this process, so a lexicographic sort is the pipeline order) and hold the headers
``# Transform:``, ``# Stage:``, ``# GraphModules found:`` followed by an SSA listing with
shape/dtype of every GraphModule under the module. Only rank 0 writes. A module with no
GraphModule (before export) produces no file and no counter increment.

Directory lifecycle (safer than the reference): the first dump of a process clears the directory
only if it is empty, does not exist, or holds our marker file (it was written by an earlier dump).
Anything else is refused with :class:`GraphDumpError` and nothing is deleted.

Beside the dumps, ``index.md`` and ``index.json`` list one row per transform: number, stage, key,
result, time, node count and the op kinds it added or removed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.fx import GraphModule, Node

from ..errors import GraphDumpError
from .fx import named_graphmodules, op_name
from .logger import ad_logger, get_rank

if TYPE_CHECKING:
    from ..transform.interface import TransformRecord

MARKER_FILE = ".autodeploy-graph-dumps"
INDEX_JSON = "index.json"
INDEX_MD = "index.md"


# -- SSA listing ---------------------------------------------------------------------------------
def _format_dim(dim) -> str:
    if isinstance(dim, int):
        return str(dim)
    if isinstance(dim, torch.SymInt):
        expr = dim.node.expr
        return str(int(expr)) if getattr(expr, "is_number", False) else str(expr).replace(" ", "")
    return "?"


def format_value_meta(val) -> str:
    """``2x8 : torch.float32`` for a tensor, a tuple of those for multi-output, ``?`` if unknown."""
    if isinstance(val, torch.Tensor):
        shape = "x".join(_format_dim(d) for d in val.shape) or "scalar"
        return f"{shape} : {val.dtype}"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(format_value_meta(v) for v in val) + ")"
    if isinstance(val, torch.SymInt):
        return f"{_format_dim(val)} : SymInt"
    if isinstance(val, (int, float, bool)):
        return f"{val!r} : {type(val).__name__}"
    return "?"


def node_meta(node: Node) -> str:
    if "val" in node.meta:
        return format_value_meta(node.meta["val"])
    tensor_meta = node.meta.get("tensor_meta")
    if tensor_meta is not None and hasattr(tensor_meta, "shape"):
        shape = "x".join(_format_dim(d) for d in tensor_meta.shape) or "scalar"
        return f"{shape} : {tensor_meta.dtype}"
    return "?"


def _format_arg(arg) -> str:
    if isinstance(arg, Node):
        return f"%{arg.name} : {node_meta(arg)}"
    if isinstance(arg, (tuple, list)):
        inner = ", ".join(_format_arg(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner}{',' if len(arg) == 1 else ''})"
    return repr(arg)


def dump_ssa_with_meta(gm: GraphModule) -> str:
    """An SSA-style listing of ``gm`` with shape/dtype from ``node.meta`` on every value."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            lines.append(f"%{node.name} : {node_meta(node)}")
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, (tuple, list)) else (outs,)
            lines.append("output " + ", ".join(f"%{o.name}" if isinstance(o, Node) else repr(o) for o in outs))
        elif node.op == "get_attr":
            lines.append(f"%{node.name} = get_attr[{node.target}] : {node_meta(node)}")
        else:
            args = [_format_arg(a) for a in node.args]
            args += [f"{k}={_format_arg(v)}" for k, v in node.kwargs.items()]
            lines.append(f"%{node.name} = {op_name(node)}({', '.join(args)}) : {node_meta(node)}")
    return "\n".join(lines) + "\n"


def op_kind_counts(mod: nn.Module) -> Counter:
    """How many nodes of each op kind the module's graphs hold (placeholders/outputs excluded)."""
    counts: Counter = Counter()
    for _, gm in named_graphmodules(mod):
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                counts[op_name(node)] += 1
    return counts


# -- the writer ----------------------------------------------------------------------------------
class GraphWriter:
    DUMP_GRAPHS_ENV = "AD_DUMP_GRAPHS_DIR"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the current directory: the next dump starts a new dump session."""
        self._dir: Path | None = None
        self._counter = 0
        self._rows: list[dict] = []
        self._prev_counts: Counter = Counter()

    @staticmethod
    def target_dir() -> Path | None:
        value = os.environ.get(GraphWriter.DUMP_GRAPHS_ENV)
        return Path(value) if value else None

    @staticmethod
    def check_dir_usable(path: Path) -> None:
        """Raise unless ``path`` may be cleared: missing, empty, or written by an earlier dump."""
        if not path.exists():
            return
        if not path.is_dir():
            raise GraphDumpError(f"{GraphWriter.DUMP_GRAPHS_ENV}={path} is a file, not a directory")
        entries = list(path.iterdir())
        if entries and not (path / MARKER_FILE).exists():
            raise GraphDumpError(
                f"{GraphWriter.DUMP_GRAPHS_ENV}={path} is not empty and was not written by autodeploy "
                f"(no {MARKER_FILE} file); refusing to clear it. Point it at a new or empty directory."
            )

    def _active_dir(self) -> Path | None:
        target = self.target_dir()
        if target is None or get_rank() != 0:
            return None
        if self._dir is None or self._dir != target:
            self.reset()
            self.check_dir_usable(target)
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            (target / MARKER_FILE).write_text("Graph dumps written by autodeploy; this directory is cleared on the next run.\n")
            self._dir = target
        return self._dir

    def dump_graph(self, mod: nn.Module, transform_name: str, stage: str, record: "TransformRecord | None" = None) -> Path | None:
        """Write ``{NNN}_{stage}_{transform_name}.txt`` for ``mod`` (nothing if disabled or no GraphModule)."""
        if self.target_dir() is None or get_rank() != 0:
            return None
        gms = list(named_graphmodules(mod))
        if not gms:
            return None
        out_dir = self._active_dir()
        self._counter += 1
        path = out_dir / f"{self._counter:03d}_{stage}_{transform_name}.txt"
        parts = [f"# Transform: {transform_name}\n# Stage: {stage}\n# GraphModules found: {len(gms)}\n"]
        for name, gm in gms:
            title = name or "<root>"
            parts.append(f"\n## GraphModule: {title} ({len(gm.graph.nodes)} nodes)\n")
            parts.append(dump_ssa_with_meta(gm))
        path.write_text("".join(parts))

        counts = op_kind_counts(mod)
        added = {k: v - self._prev_counts.get(k, 0) for k, v in counts.items() if v > self._prev_counts.get(k, 0)}
        removed = {k: v - counts.get(k, 0) for k, v in self._prev_counts.items() if v > counts.get(k, 0)}
        self._prev_counts = counts
        self._add_row(
            number=f"{self._counter:03d}",
            file=path.name,
            stage=stage,
            transform=transform_name,
            result=_result_text(record),
            time_s=round(record.time_s, 4) if record else None,
            nodes=sum(len(gm.graph.nodes) for _, gm in gms),
            added=added,
            removed=removed,
        )
        ad_logger.debug(f"graph dumped to {path}")
        return path

    def record_disabled(self, transform_name: str, stage: str) -> None:
        """A disabled transform gets an index row (no dump file) once dumps have started."""
        if self._dir is not None and self.target_dir() == self._dir and get_rank() == 0:
            self._add_row(number="-", file=None, stage=stage, transform=transform_name, result="disabled",
                          time_s=None, nodes=None, added={}, removed={})

    def _add_row(self, **row) -> None:
        self._rows.append(row)
        (self._dir / INDEX_JSON).write_text(json.dumps(self._rows, indent=1) + "\n")
        (self._dir / INDEX_MD).write_text(_index_markdown(self._rows))


def _result_text(record) -> str:
    if record is None:
        return "?"
    if record.disabled:
        return "disabled"
    return "skipped" if record.info.skipped else f"matches={record.info.num_matches}"


def _format_ops(ops: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(ops.items())) or "-"


def _index_markdown(rows: list[dict]) -> str:
    lines = [
        "# Graph dumps",
        "",
        "| # | stage | transform | result | time (s) | nodes | ops added | ops removed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        time_s = f"{r['time_s']:.3f}" if r["time_s"] is not None else "-"
        nodes = r["nodes"] if r["nodes"] is not None else "-"
        lines.append(
            f"| {r['number']} | {r['stage']} | {r['transform']} | {r['result']} | {time_s} | {nodes} "
            f"| {_format_ops(r['added'])} | {_format_ops(r['removed'])} |"
        )
    return "\n".join(lines) + "\n"


graph_writer = GraphWriter()
