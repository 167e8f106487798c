"""The pipeline's HTML report: ``index.html`` beside the graph dumps (``AD_DUMP_GRAPHS_DIR``).

One row per transform (number, stage, key, result, time, memory change, node count, op kinds added and
removed, ``--verify``'s error), each linking to its SSA dump and to a side-by-side diff page with the dump
before it (``diff_NNN.html``, :func:`autodeploy.utils.graph_diff.diff_html`); the coverage line; the merged
configuration as YAML; links to other files of the run (the ``visualize`` stage's SVG). Plain HTML with an
inline style sheet: no scripts, nothing fetched, readable from ``file://``.
"""

from __future__ import annotations

from html import escape

from .memory import format_bytes

INDEX_HTML = "index.html"

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.disabled td { color: #888; }
.fail { color: #b00; font-weight: bold; } .pass { color: #070; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; }
code { font-size: 13px; }
"""

COLUMNS = ("#", "stage", "transform", "result", "time (s)", "memory", "nodes", "verify", "graph", "ops added",
           "ops removed")


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n<h1>{escape(title)}</h1>\n{body}\n</body></html>\n")


def _ops(ops: dict) -> str:
    text = ", ".join(f"<code>{escape(k)}</code> x{v}" for k, v in sorted(ops.items())) or "-"
    # long lists (the first dump adds every op kind) fold, without a script
    return f"<details><summary>{len(ops)} op kinds</summary>{text}</details>" if len(ops) > 6 else text


def _verify_cell(verify: dict | None) -> str:
    if not verify:
        return "-"
    css = "pass" if verify["result"] == "pass" else "fail"
    error = verify["max_abs_error"]
    text = f"{error:.2e}" if error is not None else "n/a"
    title = escape(f"max rel error {verify['max_rel_error']}, against {verify['against']}. {verify['note']}")
    return f'<span class="{css}" title="{title}">{escape(verify["result"])} {text}</span>'


def _row(r: dict) -> str:
    links = "-"
    if r["file"]:
        links = f'<a href="{escape(r["file"])}">dump</a>'
        if r.get("diff"):
            links += f' · <a href="{escape(r["diff"])}">diff</a>'
    mem = r.get("mem_delta_bytes")
    cells = [
        ("num", r["number"]), ("", escape(r["stage"])), ("", f"<code>{escape(r['transform'])}</code>"),
        ("", escape(r["result"])), ("num", f"{r['time_s']:.3f}" if r["time_s"] is not None else "-"),
        ("num", format_bytes(mem) if mem else "-"), ("num", str(r["nodes"]) if r["nodes"] is not None else "-"),
        ("", _verify_cell(r.get("verify"))), ("", links), ("", _ops(r["added"])), ("", _ops(r["removed"])),
    ]
    css = ' class="disabled"' if r["result"] == "disabled" else ""
    tds = "".join(f'<td class="{c}">{v}</td>' if c else f"<td>{v}</td>" for c, v in cells)
    return f'<tr id="t{escape(r["transform"])}"{css}>{tds}</tr>'


def index_html(rows: list[dict], coverage: str | None, config_yaml: str | None, files: dict[str, str]) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
    parts = [f'<table id="transforms"><thead><tr>{head}</tr></thead><tbody>',
             *(_row(r) for r in rows), "</tbody></table>"]
    if coverage:
        parts.append(f'<h2>Coverage</h2>\n<p id="coverage"><code>{escape(coverage)}</code></p>')
    if files:
        items = "".join(f'<li><a href="{escape(path)}">{escape(name)}</a></li>' for name, path in files.items())
        parts.append(f"<h2>Files</h2>\n<ul>{items}</ul>")
    if config_yaml:
        parts.append(f'<h2>Configuration</h2>\n<pre id="config">{escape(config_yaml)}</pre>')
    return page("autodeploy pipeline", "\n".join(parts))
