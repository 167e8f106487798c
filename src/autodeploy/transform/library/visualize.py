"""visualize stage: ``visualize_graph`` draws the final graph as SVG (Graphviz through pydot), with repeated
decoder layers collapsed so that a 32-layer model stays readable.

Layer ``i`` of a node comes from its ``nn_module_stack`` (``...layers.3...``) or the tensor it reads
(``model.layers.3.mlp.up_proj.weight``); a node with neither (a canonical op a pattern matcher inserted)
takes its first input's. The first decoder layer is drawn in full inside a cluster; every node of the other
layers becomes one box, ``layers 1-31 (as layer 0)``. The files go to ``output_dir``, or the graph-dump
directory (``AD_DUMP_GRAPHS_DIR``), where the HTML report links them; without either the transform is
skipped. Without Graphviz's ``dot`` only the ``.dot`` file is written.
"""

from __future__ import annotations

import re
from pathlib import Path

import pydot
from pydantic import Field
from torch import nn
from torch.fx import GraphModule, Node

from ...utils.fx import op_name
from ...utils.graph_writer import format_value_meta, graph_writer
from ...utils.logger import ad_logger
from ...verify.runner import pipeline_graph
from ..interface import BaseTransform, PipelineContext, TransformConfig, TransformInfo, TransformRegistry

_LAYER = re.compile(r"layers\.(\d+)\b")


class VisualizeGraphConfig(TransformConfig):
    run_per_gm: bool = False
    output_dir: str | None = Field(default=None, description="Folder of the SVG; None: the graph-dump directory.")
    collapse_layers: bool = Field(default=True, description="Draw the first decoder layer only; the others as one box.")


def _own_layer(node: Node) -> int | None:
    texts = [str(node.target)] if node.op == "get_attr" else []
    texts += [str(path) for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for text in texts:
        m = _LAYER.search(text)
        if m:
            return int(m.group(1))
    return None


def node_layers(gm: GraphModule) -> dict[Node, int | None]:
    layers: dict[Node, int | None] = {}
    for node in gm.graph.nodes:
        layer = _own_layer(node)
        if layer is None and node.op not in ("placeholder", "output"):
            layer = next((layers.get(a) for a in node.all_input_nodes if layers.get(a) is not None), None)
        layers[node] = layer
    return layers


def _label(node: Node) -> str:
    what = node.op if node.op in ("placeholder", "output") else op_name(node)
    meta = format_value_meta(node.meta["val"]) if "val" in node.meta else ""
    return f"{node.name}\\n{what}" + (f"\\n{meta}" if meta and len(meta) < 60 else "")


def build_dot(gm: GraphModule, name: str, collapse: bool = True) -> pydot.Dot:
    """The graph as a pydot graph, decoder layers after the first collapsed into one node."""
    dot = pydot.Dot(name, graph_type="digraph", rankdir="TB")
    dot.set_node_defaults(shape="box", fontsize="10", fontname="monospace")
    layers = node_layers(gm)
    indices = sorted({v for v in layers.values() if v is not None})
    first = indices[0] if indices else None
    collapsed = collapse and len(indices) > 1
    box = f"layers_{indices[1]}_{indices[-1]}" if collapsed else None
    cluster = pydot.Cluster(f"layer_{first}", label=f"decoder layer {first}") if first is not None else None

    def dot_name(node: Node) -> str:
        layer = layers[node]
        return box if collapsed and layer is not None and layer != first else node.name

    for node in gm.graph.nodes:
        if dot_name(node) != node.name:
            continue
        item = pydot.Node(node.name, label=_label(node))
        if node.op == "get_attr":
            item.set("style", "dashed")
        (cluster if cluster is not None and layers[node] == first else dot).add_node(item)
    if cluster is not None:
        dot.add_subgraph(cluster)
    if collapsed:
        dot.add_node(pydot.Node(box, label=f"layers {indices[1]}-{indices[-1]} (as layer {first})",
                                style="filled", fillcolor="lightgrey"))
    edges = set()
    for node in gm.graph.nodes:
        for src in node.all_input_nodes:
            edge = (dot_name(src), dot_name(node))
            if edge[0] != edge[1] and edge not in edges:
                edges.add(edge)
                dot.add_edge(pydot.Edge(*edge))
    return dot


@TransformRegistry.register("visualize_graph")
class VisualizeGraph(BaseTransform):
    """Write the pipeline's graph as ``visualize_graph.svg`` (and ``.dot``); the graph is not changed."""

    config: VisualizeGraphConfig

    def _apply_to_full_model(self, mod: nn.Module, ctx: PipelineContext) -> tuple[nn.Module, TransformInfo]:
        gm = pipeline_graph(mod)
        out_dir = Path(self.config.output_dir) if self.config.output_dir else graph_writer.output_dir()
        if gm is None or out_dir is None:
            ad_logger.info("nothing to draw" if gm is None else
                           "no output_dir and no AD_DUMP_GRAPHS_DIR: nothing written")
            return mod, TransformInfo.unchanged()
        out_dir.mkdir(parents=True, exist_ok=True)
        dot = build_dot(gm, "pipeline", self.config.collapse_layers)
        dot_path = out_dir / f"{self._key}.dot"
        dot_path.write_text(dot.to_string())
        written = dot_path
        try:
            svg = dot.create_svg()
        except (OSError, AssertionError, FileNotFoundError) as exc:  # no Graphviz `dot` on this machine
            ad_logger.warning(f"no SVG (Graphviz `dot` failed or is not installed: {exc}); wrote {dot_path}")
        else:
            written = out_dir / f"{self._key}.svg"
            written.write_bytes(svg)
        graph_writer.add_file(f"the final graph ({written.suffix[1:]}, decoder layers collapsed)", written)
        ad_logger.info(f"graph drawn to {written}")
        return mod, TransformInfo.unchanged(skipped=False)
