"""visualize_graph: the final graph as SVG with decoder layers after the first collapsed, linked from the
report."""

import shutil

from autodeploy.cli import main
from autodeploy.transform.library.visualize import build_dot, node_layers
from helpers import export_tiny_hf


def test_layers_after_the_first_become_one_box():
    _, gm = export_tiny_hf("llama", num_hidden_layers=4)
    layers = node_layers(gm)
    assert {v for v in layers.values() if v is not None} == {0, 1, 2, 3}
    dot = build_dot(gm, "g")
    text = dot.to_string()
    assert "layers 1-3 (as layer 0)" in text and "decoder layer 0" in text
    drawn = len(dot.get_nodes()) + sum(len(s.get_nodes()) for s in dot.get_subgraphs())
    assert drawn < len(gm.graph.nodes) / 2
    assert not any(layers[n] == 2 and f'"{n.name}"' in text for n in gm.graph.nodes)
    full = build_dot(gm, "g", collapse=False)
    assert "as layer 0" not in full.to_string()


def test_visualize_stage_writes_svg_linked_from_the_report(tiny_checkpoint, tmp_path):
    out = tmp_path / "report"
    assert main(["build", "--model", str(tiny_checkpoint("llama")), "--set", "max_seq_len=64",
                 "--set", "transforms.visualize_graph.enabled=true", "--report", str(out)]) == 0
    suffix = "svg" if shutil.which("dot") else "dot"
    drawn = out / f"visualize_graph.{suffix}"
    assert drawn.is_file() and f'href="{drawn.name}"' in (out / "index.html").read_text()
    if suffix == "svg":
        assert "<svg" in drawn.read_text() and "as layer 0" in drawn.read_text()


def test_disabled_by_default():
    from autodeploy.config import load_config

    assert load_config().transforms["visualize_graph"]["enabled"] is False
