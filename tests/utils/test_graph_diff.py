"""`autodeploy graph diff`: resolving dumps, op-kind changes, rename-aware unified diff, errors."""

import pytest
import torch
from torch import nn

from autodeploy.cli import main
from autodeploy.errors import AutoDeployError
from autodeploy.utils.graph_diff import diff_dumps, resolve_dump
from autodeploy.utils.graph_writer import GraphWriter

HEADER = "# Transform: {key}\n# Stage: {stage}\n# GraphModules found: 1\n\n## GraphModule: <root> ({n} nodes)\n"

A_BODY = """\
%x : 2x8 : torch.float32
%w = get_attr[w] : 8x4 : torch.float32
%add = aten.add.Tensor(%x : 2x8 : torch.float32, 0) : 2x8 : torch.float32
%mm = aten.mm.default(%add : 2x8 : torch.float32, %w : 8x4 : torch.float32) : 2x4 : torch.float32
%relu = aten.relu.default(%mm : 2x4 : torch.float32) : 2x4 : torch.float32
output %relu
"""

# the no-op add removed, the mm renamed (mm -> mm_1) but otherwise unchanged, a sigmoid added
B_BODY = """\
%x : 2x8 : torch.float32
%w = get_attr[w] : 8x4 : torch.float32
%mm_1 = aten.mm.default(%x : 2x8 : torch.float32, %w : 8x4 : torch.float32) : 2x4 : torch.float32
%relu = aten.relu.default(%mm_1 : 2x4 : torch.float32) : 2x4 : torch.float32
%sigmoid = aten.sigmoid.default(%relu : 2x4 : torch.float32) : 2x4 : torch.float32
output %sigmoid
"""


def _write(directory, name, key, stage, body):
    (directory / name).write_text(HEADER.format(key=key, stage=stage, n=len(body.splitlines())) + body)


@pytest.fixture
def dump_dir(tmp_path):
    _write(tmp_path, "001_export_export_to_gm.txt", "export_to_gm", "export", A_BODY)
    _write(tmp_path, "002_post_export_cleanup_noop_add.txt", "cleanup_noop_add", "post_export", B_BODY)
    (tmp_path / "index.md").write_text("# Graph dumps\n")
    return tmp_path


@pytest.mark.parametrize("spec", ["2", "002", "002_post_export_cleanup_noop_add.txt",
                                  "002_post_export_cleanup_noop_add", "cleanup_noop_add"])
def test_resolve_dump_by_number_file_or_key(dump_dir, spec):
    assert resolve_dump(dump_dir, spec).name == "002_post_export_cleanup_noop_add.txt"


def test_diff_report(dump_dir):
    report = diff_dumps(dump_dir, "1", "cleanup_noop_add")
    lines = report.splitlines()
    assert lines[0] == "graph diff: 001_export_export_to_gm.txt -> 002_post_export_cleanup_noop_add.txt"
    assert "  A: 001  export/export_to_gm: 6 nodes" in lines
    assert "  B: 002  post_export/cleanup_noop_add: 6 nodes" in lines
    assert "nodes: 6 -> 6 (+0)" in lines
    added = lines[lines.index("ops added:") + 1]
    removed = lines[lines.index("ops removed:") + 1]
    assert added == "  + aten.sigmoid.default x1"
    assert removed == "  - aten.add.Tensor x1"
    assert "renamed values (shown under their name in A): 1" in lines
    # the unified diff: real changes only; the renamed mm is shown under its name in A
    assert "--- 001_export_export_to_gm.txt [<root>]" in lines
    assert "+++ 002_post_export_cleanup_noop_add.txt [<root>]" in lines
    assert "-%add = aten.add.Tensor(%x : 2x8 : torch.float32, 0) : 2x8 : torch.float32" in lines
    assert "+%mm = aten.mm.default(%x : 2x8 : torch.float32, %w : 8x4 : torch.float32) : 2x4 : torch.float32" in lines
    assert "+%sigmoid = aten.sigmoid.default(%relu : 2x4 : torch.float32) : 2x4 : torch.float32" in lines
    assert " %relu = aten.relu.default(%mm : 2x4 : torch.float32) : 2x4 : torch.float32" in lines  # context
    assert not any("mm_1" in line for line in lines)


def test_diff_counts_changes_of_existing_ops(tmp_path):
    body_b = A_BODY.replace(
        "output %relu", "%relu_1 = aten.relu.default(%relu : 2x4 : torch.float32) : 2x4 : torch.float32\noutput %relu_1"
    )
    _write(tmp_path, "001_a_x.txt", "x", "a", A_BODY)
    _write(tmp_path, "002_a_y.txt", "y", "a", body_b)
    report = diff_dumps(tmp_path, "1", "2")
    assert "  + aten.relu.default x1 (1 -> 2)" in report.splitlines()
    assert "ops removed:\n  (none)\n" in report


def test_identical_dumps(dump_dir):
    report = diff_dumps(dump_dir, "1", "export_to_gm")
    assert report.endswith("no change in the SSA listings\n")
    assert "ops added:\n  (none)\nops removed:\n  (none)\n" in report


def test_unknown_dump_and_missing_dir_are_clear_errors(dump_dir, tmp_path):
    with pytest.raises(AutoDeployError, match=r"no dump '7' in .*001_export_export_to_gm.txt"):
        diff_dumps(dump_dir, "7", "1")
    with pytest.raises(AutoDeployError, match="no dump 'fuse_gemms'"):
        diff_dumps(dump_dir, "1", "fuse_gemms")
    with pytest.raises(AutoDeployError, match="does not exist"):
        diff_dumps(tmp_path / "missing", "1", "2")


def test_key_dumped_twice_asks_for_a_number(dump_dir):
    _write(dump_dir, "003_export_export_to_gm.txt", "export_to_gm", "export", A_BODY)
    with pytest.raises(AutoDeployError, match=r"more than once .*001, 003"):
        resolve_dump(dump_dir, "export_to_gm")


def test_cli_graph_diff(dump_dir, capsys):
    assert main(["graph", "diff", str(dump_dir), "001", "002"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("graph diff: 001_export_export_to_gm.txt -> 002_post_export_cleanup_noop_add.txt\n")
    assert "  - aten.add.Tensor x1" in out

    assert main(["graph", "diff", str(dump_dir), "1", "9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autodeploy: error: no dump '9' in ")


class Net(nn.Module):
    def forward(self, x):
        return torch.relu(x + 0) * 2


def test_diff_of_writer_dumps(tmp_path, monkeypatch):
    """Dumps written by the writer round-trip: removing a node shows as that op removed."""
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(tmp_path / "d"))
    gm = torch.export.export(Net(), (torch.randn(2, 3),)).module()
    writer = GraphWriter()
    writer.dump_graph(gm, "export_to_gm", "export")
    add = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor)
    add.replace_all_uses_with(add.args[0])
    gm.graph.erase_node(add)
    gm.recompile()
    writer.dump_graph(gm, "cleanup_noop_add", "post_export")
    report = diff_dumps(tmp_path / "d", "export_to_gm", "cleanup_noop_add")
    assert "  - aten.add.Tensor x1" in report.splitlines()
    assert "ops added:\n  (none)\n" in report
    assert "-%add = aten.add.Tensor(%x : 2x3 : torch.float32, 0) : 2x3 : torch.float32" in report.splitlines()
    assert "+%relu = aten.relu.default(%x : 2x3 : torch.float32) : 2x3 : torch.float32" in report.splitlines()
