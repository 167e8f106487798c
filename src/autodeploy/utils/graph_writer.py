"""Graph dumps: one text file per transform when ``AD_DUMP_GRAPHS_DIR`` is set.

Files are named ``{NNN}_{stage}_{transform_key}.txt`` (NNN a three-digit counter over the dumps
of this process, so a lexicographic sort is the pipeline order) and hold the headers
``# Transform:``, ``# Stage:``, ``# GraphModules found:`` followed by an SSA listing with
shape/dtype of every GraphModule under the module. Symbolic dims are printed by the name of the
``torch.export.Dim`` they come from (``batchxseq``, ``batchx(seq+1)``), else as ShapeEnv symbols.
Only rank 0 writes. A module with no GraphModule (before export) produces no file and no counter
increment (its transform still gets an index row).

Directory lifecycle (safer than the reference): the first dump of a process clears the directory
only if it is empty, does not exist, or holds our marker file (it was written by an earlier dump).
Anything else is refused with :class:`GraphDumpError` and nothing is deleted.

Beside the dumps, ``index.md`` and ``index.json`` list one row per transform: number, stage, key,
result (matches=N / skipped / disabled), time, memory change, node count and the op kinds it added or
removed (compared with the previous dump), and ``--verify``'s result when it ran; ``index.html``
(utils/graph_report.py) shows them with links to each dump and to ``diff_NNN.html``, its side-by-side diff
with the dump before it. ``autodeploy graph diff`` (utils/graph_diff.py) reads the dumps.
"""

from __future__ import annotations

import json
import os
import shutil
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.fx import GraphModule, Node

from ..errors import GraphDumpError
from .fx import named_graphmodules, op_name
from .logger import ad_logger, get_rank


class TransformRecord(Protocol):
    """What the writer reads of a transform's history record (``autodeploy.transform.TransformRecord``;
    described here so that utils never imports the transform package)."""

    time_s: float
    disabled: bool
    mem_delta_bytes: int
    info: Any  # .skipped, .num_matches

MARKER_FILE = ".autodeploy-graph-dumps"
INDEX_JSON = "index.json"
INDEX_MD = "index.md"


# -- SSA listing ---------------------------------------------------------------------------------
# Per ShapeEnv: its symbols -> the torch.export.Dim names they were created from ("batch", "seq").
_dim_name_cache: "weakref.WeakKeyDictionary[object, tuple[int, dict]]" = weakref.WeakKeyDictionary()


def _dim_names(shape_env) -> dict:
    """``{sympy.Symbol: sympy.Symbol(dim_name)}`` for the symbols of ``shape_env`` that come from a
    named ``torch.export.Dim`` (export records ``source name -> Dim name`` in the shape env)."""
    debug_names = getattr(shape_env, "source_name_to_debug_name", None) or {}
    var_to_sources = getattr(shape_env, "var_to_sources", None) or {}
    key = (len(debug_names), len(var_to_sources))
    try:
        cached = _dim_name_cache.get(shape_env)
    except TypeError:  # not weak-referenceable
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    import sympy

    mapping = {}
    for sym, sources in var_to_sources.items():
        for source in sources:
            name = getattr(source, "name", None)
            name = name() if callable(name) else name
            if name in debug_names:
                mapping[sym] = sympy.Symbol(debug_names[name], integer=True, positive=True)
                break
    try:
        _dim_name_cache[shape_env] = (key, mapping)
    except TypeError:
        pass
    return mapping


def _format_dim(dim) -> str:
    """``8``, a symbolic dim by its ``Dim`` name (``batch``, ``(seq+1)``), or ``?``."""
    if isinstance(dim, int):
        return str(dim)
    if isinstance(dim, torch.SymInt):
        node = dim.node
        expr = node.expr
        if getattr(expr, "is_number", False):
            return str(int(expr))
        try:
            names = _dim_names(node.shape_env)
            if names:
                expr = expr.xreplace(names)
        except Exception:  # noqa: BLE001 - the raw symbol is still a correct (if less readable) name
            pass
        text = str(expr).replace(" ", "")
        return text if getattr(expr, "is_Symbol", False) else f"({text})"
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


def _format_arg(arg, with_meta: bool = True) -> str:
    """``%x : 2x8 : torch.float32`` (or ``%x`` alone for the ``output`` line), containers kept."""
    if isinstance(arg, Node):
        return f"%{arg.name} : {node_meta(arg)}" if with_meta else f"%{arg.name}"
    if isinstance(arg, (tuple, list)):
        inner = ", ".join(_format_arg(a, with_meta) for a in arg)
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
            lines.append("output " + ", ".join(_format_arg(o, with_meta=False) for o in outs))
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
        """Forget the current directory: the next dump starts a new dump session (and clears it)."""
        self._target: Path | None = None  # the directory this session's rows belong to
        self._dir: Path | None = None  # set once the directory was prepared (first dump)
        self._counter = 0
        self._rows: list[dict] = []
        self._prev_counts: Counter = Counter()
        self._prev_file: str | None = None
        self._coverage: str | None = None
        self._config_yaml: str | None = None
        self._files: dict[str, str] = {}  # other files of the run the report links to: title -> file name

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
        if entries and not (path / MARKER_FILE).is_file():
            shown = ", ".join(sorted(e.name for e in entries)[:3]) + (", ..." if len(entries) > 3 else "")
            raise GraphDumpError(
                f"{GraphWriter.DUMP_GRAPHS_ENV}={path} is not empty ({shown}) and was not written by "
                f"autodeploy (no {MARKER_FILE} file); refusing to clear it. "
                f"Point it at a new or empty directory."
            )

    def _session(self) -> Path | None:
        """The target directory if this process dumps (env set, rank 0); starts a new session
        (counter, index rows) when the target changed. Does not touch the disk."""
        target = self.target_dir()
        if target is None or get_rank() != 0:
            return None
        if self._target != target:
            self.reset()
            self._target = target
        return target

    def _prepare_dir(self) -> Path:
        """On the first dump of a session: check, clear and recreate the directory, mark it ours."""
        if self._dir is None:
            target = self._target
            self.check_dir_usable(target)
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            (target / MARKER_FILE).write_text(
                "Graph dumps written by autodeploy; this directory is cleared on the next run.\n"
            )
            self._dir = target
        return self._dir

    def dump_graph(
        self, mod: nn.Module, transform_name: str, stage: str, record: TransformRecord | None = None
    ) -> Path | None:
        """Write ``{NNN}_{stage}_{transform_name}.txt`` for ``mod`` (nothing if disabled or no GraphModule)."""
        if self._session() is None:
            return None
        gms = list(named_graphmodules(mod))
        if not gms:
            # before export: no file, no counter increment; the index still lists the transform
            self._add_row(number="-", file=None, stage=stage, transform=transform_name, result=_result_text(record),
                          time_s=_time(record), mem_delta_bytes=_mem(record), nodes=None, added={}, removed={})
            return None
        out_dir = self._prepare_dir()
        self._counter += 1
        path = out_dir / f"{self._counter:03d}_{stage}_{transform_name}.txt"
        parts = [f"# Transform: {transform_name}\n# Stage: {stage}\n# GraphModules found: {len(gms)}\n"]
        for name, gm in gms:
            title = name or "<root>"
            parts.append(f"\n## GraphModule: {title} ({len(gm.graph.nodes)} nodes)\n")
            parts.append(dump_ssa_with_meta(gm))
        path.write_text("".join(parts))

        counts = op_kind_counts(mod)
        prev = self._prev_counts
        added = {k: v - prev.get(k, 0) for k, v in counts.items() if v > prev.get(k, 0)}
        removed = {k: v - counts.get(k, 0) for k, v in prev.items() if v > counts.get(k, 0)}
        self._prev_counts = counts
        diff = self._write_diff_page(path)
        self._prev_file = path.name
        self._add_row(
            number=f"{self._counter:03d}",
            file=path.name,
            diff=diff,
            stage=stage,
            transform=transform_name,
            result=_result_text(record),
            time_s=_time(record),
            mem_delta_bytes=_mem(record),
            nodes=sum(len(gm.graph.nodes) for _, gm in gms),
            added=added,
            removed=removed,
        )
        ad_logger.debug(f"graph dumped to {path}")
        return path

    def record_disabled(self, transform_name: str, stage: str) -> None:
        """A disabled transform gets an index row (no dump file, no counter increment)."""
        if self._session() is None:
            return
        self._add_row(number="-", file=None, stage=stage, transform=transform_name, result="disabled",
                      time_s=None, mem_delta_bytes=None, nodes=None, added={}, removed={})

    def record_verification(self, transform_name: str, verify: dict) -> None:
        """Add ``--verify``'s result to the transform's index row."""
        row = self._last_row(transform_name)
        if row is not None:
            row["verify"] = verify
            if self._dir is not None:
                self._write_index()

    def dump_pair(self, transform_name: str) -> tuple[Path | None, Path | None]:
        """The dumps before and after the transform's last run (None where there is none)."""
        if self._dir is None:
            return None, None
        files = [r["file"] for r in self._rows if r["file"]]
        row = self._last_row(transform_name)
        if row is None or not row["file"]:
            return None, None
        index = files.index(row["file"])
        return (self._dir / files[index - 1] if index else None), self._dir / row["file"]

    def diff_page(self, dump: Path) -> Path | None:
        """The report's side-by-side diff page of ``dump`` against the dump before it, if written."""
        row = next((r for r in self._rows if r["file"] == dump.name), None)
        return dump.parent / row["diff"] if row and row.get("diff") else None

    def record_coverage(self, line: str) -> None:
        """The pattern matcher's coverage line, for the report."""
        if self._session() is not None:
            self._coverage = line
            self._write_index_if_ready()

    def record_config(self, config_yaml: str) -> None:
        """The merged configuration of the run, for the report."""
        if self._session() is not None:
            self._config_yaml = config_yaml
            self._write_index_if_ready()

    def output_dir(self) -> Path | None:
        """The dump directory, prepared for writing (for other files of the run, linked with :meth:`add_file`),
        or None when this process does not dump."""
        return self._prepare_dir() if self._session() is not None else None

    def add_file(self, title: str, path: Path) -> None:
        """Link ``path`` (a file inside the dump directory) from the report."""
        if self._session() is not None:
            self._files[title] = Path(path).name
            self._write_index_if_ready()

    def _write_diff_page(self, path: Path) -> str | None:
        if self._prev_file is None:
            return None
        from .graph_diff import diff_html

        name = f"diff_{path.name.split('_', 1)[0]}.html"
        try:
            (path.parent / name).write_text(diff_html(path.parent / self._prev_file, path))
        except Exception as exc:  # noqa: BLE001 - the report is an aid: the dumps themselves are written
            ad_logger.warning(f"no diff page for {path.name}: {type(exc).__name__}: {exc}")
            return None
        return name

    def _write_index_if_ready(self) -> None:
        if self._dir is not None:
            self._write_index()

    def _last_row(self, transform_name: str) -> dict | None:
        return next((r for r in reversed(self._rows) if r["transform"] == transform_name), None)

    def _add_row(self, **row) -> None:
        """Keep the row; (re)write the index once the directory exists (rows before the first
        dump are written with it)."""
        self._rows.append(row)
        if self._dir is not None:
            self._write_index()

    def _write_index(self) -> None:
        from .graph_report import INDEX_HTML, index_html

        (self._dir / INDEX_JSON).write_text(json.dumps(self._rows, indent=1) + "\n")
        (self._dir / INDEX_MD).write_text(_index_markdown(self._rows))
        (self._dir / INDEX_HTML).write_text(index_html(self._rows, self._coverage, self._config_yaml, self._files))


def _time(record) -> float | None:
    return round(record.time_s, 4) if record is not None and not record.disabled else None


def _mem(record) -> int | None:
    return record.mem_delta_bytes if record is not None and not record.disabled else None


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
