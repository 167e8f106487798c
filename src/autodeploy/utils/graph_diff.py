"""``autodeploy graph diff DIR A B``: what changed between two graph dumps of one directory.

A and B name a dump by its number (``3`` or ``003``), its file name, or its transform key. The
report gives both files, the node counts, the op kinds added/removed (with counts) and a unified
diff of the SSA listings. Values that were only renamed (same op, same arguments, another name)
are mapped back to their name in A first, so the diff shows real changes, not renumbering.
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GraphDumpError

_DUMP_FILE = re.compile(r"^(\d{3,})_.+\.txt$")
_SECTION = re.compile(r"^## GraphModule: (.*) \((\d+) nodes\)$")
_DEF = re.compile(r"^%(\w+)( = |\s:)")  # "%x = op(...)" or "%x : meta" (placeholder)
_OP = re.compile(r"^%\w+ = ([^\s(\[]+)\(")  # call ops only (not get_attr[...])
_REF = re.compile(r"%(\w+)")


class GraphDiffError(GraphDumpError):
    """A dump directory or dump given to ``graph diff`` cannot be found or read."""


@dataclass
class Dump:
    """One parsed dump file."""

    path: Path
    transform: str = "?"
    stage: str = "?"
    sections: dict[str, list[str]] = field(default_factory=dict)  # GraphModule name -> SSA lines

    @property
    def number(self) -> str:
        return self.path.name.split("_", 1)[0]

    @property
    def node_count(self) -> int:
        return sum(len(lines) for lines in self.sections.values())

    def op_counts(self) -> Counter:
        counts: Counter = Counter()
        for lines in self.sections.values():
            for line in lines:
                m = _OP.match(line)
                if m:
                    counts[m.group(1)] += 1
        return counts


def parse_dump(path: Path) -> Dump:
    dump = Dump(path)
    current: list[str] | None = None
    for line in path.read_text().splitlines():
        if line.startswith("# Transform: "):
            dump.transform = line[len("# Transform: "):].strip()
        elif line.startswith("# Stage: "):
            dump.stage = line[len("# Stage: "):].strip()
        elif (m := _SECTION.match(line)) is not None:
            current = dump.sections.setdefault(m.group(1), [])
        elif current is not None and line.strip():
            current.append(line)
    return dump


def list_dumps(directory: Path) -> list[Path]:
    """The dump files of ``directory`` in pipeline order."""
    return sorted(p for p in directory.iterdir() if p.is_file() and _DUMP_FILE.match(p.name))


def resolve_dump(directory: Path, spec: str) -> Path:
    """The dump named by ``spec``: a number (``3``/``003``), a file name, or a transform key."""
    files = list_dumps(directory)
    spec = spec.strip()
    by_name = {p.name: p for p in files}
    if spec in by_name:
        return by_name[spec]
    if spec + ".txt" in by_name:
        return by_name[spec + ".txt"]
    if spec.isdigit():
        found = [p for p in files if int(p.name.split("_", 1)[0]) == int(spec)]
        if found:
            return found[0]
    else:
        found = [p for p in files if parse_dump(p).transform == spec]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            numbers = ", ".join(p.name.split("_", 1)[0] for p in found)
            raise GraphDiffError(f"transform {spec!r} was dumped more than once in {directory} "
                                 f"(dumps {numbers}); pass the dump number instead")
    available = ", ".join(p.name for p in files) or "none"
    raise GraphDiffError(
        f"no dump {spec!r} in {directory}: give a dump number (e.g. 3), a file name or a transform key. "
        f"Dumps there: {available}"
    )


def _mask(line: str) -> str:
    """A line with every value name hidden: equal masks mean same op on same-shaped arguments."""
    return _REF.sub("%_", line)


def _rename_map(a_lines: list[str], b_lines: list[str]) -> dict[str, str]:
    """B value name -> A value name, for values defined on lines that match once names are masked."""
    mapping: dict[str, str] = {}
    matcher = difflib.SequenceMatcher(None, [_mask(x) for x in a_lines], [_mask(x) for x in b_lines],
                                      autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            ma, mb = _DEF.match(a_lines[block.a + k]), _DEF.match(b_lines[block.b + k])
            if ma and mb and ma.group(1) != mb.group(1):
                mapping[mb.group(1)] = ma.group(1)
    return mapping


def _apply_renames(b_lines: list[str], mapping: dict[str, str]) -> list[str]:
    taken = set(mapping.values())

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name in mapping:
            return "%" + mapping[name]
        # a new B value whose name an A value (renamed in B) now uses: keep them apart
        return f"%{name}'" if name in taken else m.group(0)

    return [_REF.sub(sub, line) for line in b_lines]


def _format_op_changes(before: Counter, after: Counter) -> tuple[list[str], list[str]]:
    added, removed = [], []
    for op in sorted(set(before) | set(after)):
        a, b = before.get(op, 0), after.get(op, 0)
        detail = f" ({a} -> {b})" if a and b else ""
        if b > a:
            added.append(f"  + {op} x{b - a}{detail}")
        elif a > b:
            removed.append(f"  - {op} x{a - b}{detail}")
    return added, removed


def diff_dumps(directory: str | Path, a: str, b: str) -> str:
    """A readable report of what changed from dump ``a`` to dump ``b`` in ``directory``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise GraphDiffError(f"dump directory {directory} does not exist (set AD_DUMP_GRAPHS_DIR for a build first)")
    dump_a, dump_b = parse_dump(resolve_dump(directory, a)), parse_dump(resolve_dump(directory, b))

    out = [
        f"graph diff: {dump_a.path.name} -> {dump_b.path.name}",
        f"  A: {dump_a.number}  {dump_a.stage}/{dump_a.transform}: {dump_a.node_count} nodes",
        f"  B: {dump_b.number}  {dump_b.stage}/{dump_b.transform}: {dump_b.node_count} nodes",
        f"nodes: {dump_a.node_count} -> {dump_b.node_count} ({dump_b.node_count - dump_a.node_count:+d})",
    ]
    added, removed = _format_op_changes(dump_a.op_counts(), dump_b.op_counts())
    out += ["ops added:"] + (added or ["  (none)"])
    out += ["ops removed:"] + (removed or ["  (none)"])

    diff_lines: list[str] = []
    renamed = 0
    for title in list(dump_a.sections) + [t for t in dump_b.sections if t not in dump_a.sections]:
        a_lines = dump_a.sections.get(title, [])
        b_lines = dump_b.sections.get(title, [])
        mapping = _rename_map(a_lines, b_lines)
        renamed += len(mapping)
        b_lines = _apply_renames(b_lines, mapping)
        diff_lines += difflib.unified_diff(
            a_lines, b_lines, fromfile=f"{dump_a.path.name} [{title}]", tofile=f"{dump_b.path.name} [{title}]",
            lineterm="", n=2,
        )
    if renamed:
        out.append(f"renamed values (shown under their name in A): {renamed}")
    out += diff_lines if diff_lines else ["no change in the SSA listings"]
    return "\n".join(out) + "\n"


_DIFF_STYLE = """
table.diff { font: 12px monospace; border: 1px solid #ccc; }
table.diff td { white-space: pre; padding: 0 4px; border: 0; }
.diff_header { background: #f0f0f0; text-align: right; } .diff_next { background: #f0f0f0; }
.diff_add { background: #cfc; } .diff_chg { background: #ff8; } .diff_sub { background: #fcc; }
"""


def diff_html(path_a: Path, path_b: Path) -> str:
    """A self-contained HTML page: the op kinds added/removed and a side-by-side diff of the SSA listings
    of two dumps (values only renamed in B shown under their name in A)."""
    from html import escape

    from .graph_report import page

    dump_a, dump_b = parse_dump(path_a), parse_dump(path_b)
    added, removed = _format_op_changes(dump_a.op_counts(), dump_b.op_counts())
    summary = (f"<p>{escape(dump_a.path.name)} ({dump_a.node_count} nodes) &rarr; {escape(dump_b.path.name)} "
               f"({dump_b.node_count} nodes)</p>\n<pre>ops added:\n{escape(chr(10).join(added) or '  (none)')}\n"
               f"ops removed:\n{escape(chr(10).join(removed) or '  (none)')}</pre>")
    tables = []
    for title in list(dump_a.sections) + [t for t in dump_b.sections if t not in dump_a.sections]:
        a_lines = dump_a.sections.get(title, [])
        b_lines = _apply_renames(dump_b.sections.get(title, []), _rename_map(a_lines, dump_b.sections.get(title, [])))
        if a_lines == b_lines:
            tables.append(f"<h2>{escape(title)}</h2><p>no change in the SSA listing</p>")
            continue
        table = difflib.HtmlDiff(wrapcolumn=100).make_table(
            a_lines, b_lines, dump_a.path.name, dump_b.path.name, context=True, numlines=2)
        tables.append(f"<h2>{escape(title)}</h2>\n{table}")
    body = summary + "\n" + "\n".join(tables) + '\n<p><a href="index.html">back to the report</a></p>'
    return page(f"{dump_a.stage}/{dump_a.transform} -> {dump_b.stage}/{dump_b.transform}",
                body).replace("</style>", _DIFF_STYLE + "</style>", 1)
