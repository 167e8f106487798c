"""Graph visualization for ``debug_visualize_dir``: Graphviz DOT (and SVG when ``dot`` exists).

One ``<transform_key>.dot`` per transform (``<transform_key>_<graphmodule>.dot`` when the module
holds several GraphModules), drawn with :class:`torch.fx.passes.graph_drawer.FxGraphDrawer`.
The SVG is optional: a missing or failing ``dot`` program is logged, never raised.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from torch import nn

from .fx import named_graphmodules
from .logger import ad_logger

_SVG_TIMEOUT_S = 60


def _file_stem(transform_key: str, gm_name: str, several: bool) -> str:
    if not several:
        return transform_key
    suffix = re.sub(r"[^\w\-]+", "_", gm_name) if gm_name else "root"
    return f"{transform_key}_{suffix}"


def _write_svg(dot_path: Path) -> Path | None:
    dot_program = shutil.which("dot")
    if dot_program is None:
        return None
    svg_path = dot_path.with_suffix(".svg")
    try:
        subprocess.run(
            [dot_program, "-Tsvg", str(dot_path), "-o", str(svg_path)],
            check=True, capture_output=True, timeout=_SVG_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None)
        detail = detail.decode(errors="replace").strip() if isinstance(detail, bytes) and detail else str(exc)
        ad_logger.warning(f"graph visualization: no SVG for {dot_path.name} ({detail})")
        return None
    return svg_path


def write_graph_visualization(mod: nn.Module, directory: str | Path, transform_key: str) -> list[Path]:
    """Write the DOT (and SVG if possible) of every GraphModule under ``mod``; the paths written."""
    from torch.fx.passes.graph_drawer import FxGraphDrawer

    gms = list(named_graphmodules(mod))
    if not gms:
        return []
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for gm_name, gm in gms:
        stem = _file_stem(transform_key, gm_name, len(gms) > 1)
        try:
            dot_graph = FxGraphDrawer(gm, stem).get_dot_graph()
            dot_text = dot_graph.to_string()
        except Exception as exc:  # noqa: BLE001 - debug output must not break the pipeline
            ad_logger.warning(f"graph visualization of {stem} failed: {type(exc).__name__}: {exc}")
            continue
        dot_path = out_dir / f"{stem}.dot"
        dot_path.write_text(dot_text)
        written.append(dot_path)
        svg_path = _write_svg(dot_path)
        if svg_path is not None:
            written.append(svg_path)
    if written:
        ad_logger.info(f"graph visualization written to {out_dir}: {', '.join(p.name for p in written)}")
    return written
