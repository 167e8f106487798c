"""Graph dumps (AD_DUMP_GRAPHS_DIR): SSA format, file naming, rank rule, directory lifecycle, index."""

import json

import pytest
import torch
from torch import nn

from autodeploy.errors import AutoDeployError, GraphDumpError
from autodeploy.transform.interface import Stages, TransformInfo, TransformRecord
from autodeploy.utils.graph_writer import MARKER_FILE, GraphWriter, dump_ssa_with_meta, format_value_meta


class MatMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return torch.mm(x, self.w)


class CatDyn(nn.Module):
    def forward(self, input_ids, position_ids):
        return torch.cat([input_ids, position_ids[:, :1]], dim=1)


class TopK(nn.Module):
    def forward(self, x):
        values, indices = torch.topk(x, 2)
        return values, indices


def _export(mod, args, dynamic_shapes=None):
    gm = torch.export.export(mod, args, dynamic_shapes=dynamic_shapes).module()
    for node in list(gm.graph.nodes):  # drop export's input guard call: only the ops under test remain
        if node.op == "call_module" and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


@pytest.fixture
def mm_gm():
    return _export(MatMul(), (torch.randn(2, 8),))


def _lines(gm):
    return dump_ssa_with_meta(gm).splitlines()


# -- SSA listing ---------------------------------------------------------------------------------
def test_ssa_placeholder_op_and_output_lines(mm_gm):
    lines = _lines(mm_gm)
    assert "%x : 2x8 : torch.float32" in lines
    assert "%w = get_attr[w] : 8x4 : torch.float32" in lines
    assert "%mm = aten.mm.default(%x : 2x8 : torch.float32, %w : 8x4 : torch.float32) : 2x4 : torch.float32" in lines
    assert lines[-1] == "output %mm"
    assert len(lines) == len(mm_gm.graph.nodes)


def test_ssa_integer_input_dtype():
    gm = _export(CatDyn(), (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)))
    assert "%input_ids : 2x8 : torch.int64" in _lines(gm)


def test_ssa_symbolic_dims_use_export_dim_names():
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    args = (torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    gm = _export(CatDyn(), args, dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    lines = _lines(gm)
    assert "%input_ids : batchxseq : torch.int64" in lines
    assert "%position_ids : batchxseq : torch.int64" in lines
    cat = next(line for line in lines if line.startswith("%cat = aten.cat.default("))
    assert cat.endswith(") : batchx(seq+1) : torch.int64")
    assert "%input_ids : batchxseq : torch.int64" in cat


def test_ssa_multi_output_is_a_tuple():
    gm = _export(TopK(), (torch.randn(3, 5),))
    lines = _lines(gm)
    topk = next(line for line in lines if line.startswith("%topk = aten.topk.default("))
    assert topk.endswith(") : (3x2 : torch.float32, 3x2 : torch.int64)")
    assert any(line.startswith("%getitem = getitem(%topk : (3x2 : torch.float32, 3x2 : torch.int64), 0)")
               for line in lines)
    assert lines[-1] == "output %getitem, %getitem_1"


def test_ssa_unknown_meta_is_question_mark_and_shape_prop_is_used():
    gm = torch.fx.symbolic_trace(MatMul())
    lines = _lines(gm)
    assert "%x : ?" in lines
    assert "%mm = torch.mm(%x : ?, %w : ?) : ?" not in lines  # op naming is the function's name
    assert any(line.startswith("%mm = mm(%x : ?, %w : ?) : ?") for line in lines)

    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(gm).propagate(torch.randn(2, 8))
    lines = _lines(gm)
    assert "%x : 2x8 : torch.float32" in lines
    assert "%mm = mm(%x : 2x8 : torch.float32, %w : 8x4 : torch.float32) : 2x4 : torch.float32" in lines


def test_format_value_meta_scalars_and_unknown():
    assert format_value_meta(torch.zeros(())) == "scalar : torch.float32"
    assert format_value_meta(3) == "3 : int"
    assert format_value_meta(object()) == "?"
    pair = [torch.zeros(2), torch.zeros(1, dtype=torch.bool)]
    assert format_value_meta(pair) == "(2 : torch.float32, 1 : torch.bool)"


# -- the writer ----------------------------------------------------------------------------------
def _record(key, matches=1, skipped=False, time_s=0.5):
    return TransformRecord(key, Stages.POST_EXPORT, TransformInfo(skipped=skipped, num_matches=matches), time_s=time_s)


def test_no_env_writes_nothing(mm_gm, tmp_path):
    writer = GraphWriter()
    assert writer.dump_graph(mm_gm, "t", "post_export") is None
    assert list(tmp_path.iterdir()) == []


def test_dump_files_headers_counter_and_index(mm_gm, tmp_path, monkeypatch):
    out = tmp_path / "dumps"
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    writer = GraphWriter()

    # before export: no GraphModule -> no file, no counter increment (but an index row)
    assert writer.dump_graph(nn.Linear(2, 2), "build_model", "factory", _record("build_model")) is None
    assert not out.exists()

    first = writer.dump_graph(mm_gm, "export_to_gm", "export", _record("export_to_gm"))
    writer.record_disabled("cleanup_noop_add", "post_export")
    second = writer.dump_graph(mm_gm, "cleanup_noop_slice", "post_export", _record("cleanup_noop_slice", skipped=True))
    assert first.name == "001_export_export_to_gm.txt"
    assert second.name == "002_post_export_cleanup_noop_slice.txt"
    assert sorted(p.name for p in out.glob("*.txt")) == [first.name, second.name]
    assert (out / MARKER_FILE).is_file()

    text = first.read_text()
    assert text.startswith("# Transform: export_to_gm\n# Stage: export\n# GraphModules found: 1\n")
    assert f"## GraphModule: <root> ({len(mm_gm.graph.nodes)} nodes)" in text
    assert "\n%x : 2x8 : torch.float32\n" in text
    assert text.endswith("output %mm\n")

    rows = json.loads((out / "index.json").read_text())
    assert [(r["number"], r["transform"], r["result"]) for r in rows] == [
        ("-", "build_model", "matches=1"),
        ("001", "export_to_gm", "matches=1"),
        ("-", "cleanup_noop_add", "disabled"),
        ("002", "cleanup_noop_slice", "skipped"),
    ]
    assert rows[1]["added"] == {"aten.mm.default": 1} and rows[1]["removed"] == {}
    assert rows[1]["nodes"] == len(mm_gm.graph.nodes) and rows[1]["time_s"] == 0.5
    assert rows[2]["file"] is None and rows[2]["time_s"] is None
    assert rows[3]["added"] == {} and rows[3]["removed"] == {}
    md = (out / "index.md").read_text()
    assert "| 001 | export | export_to_gm | matches=1 | 0.500 |" in md
    assert "| - | post_export | cleanup_noop_add | disabled | - | - | - | - |" in md


def test_index_records_removed_ops(tmp_path, monkeypatch):
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(tmp_path / "d"))
    writer = GraphWriter()
    gm = _export(MatMul(), (torch.randn(2, 8),))
    writer.dump_graph(gm, "a", "export")
    mm = next(n for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
    with gm.graph.inserting_after(mm):
        relu = gm.graph.call_function(torch.ops.aten.relu.default, (mm.args[0],))
    mm.replace_all_uses_with(relu)
    gm.graph.erase_node(mm)
    gm.recompile()
    writer.dump_graph(gm, "b", "post_export")
    row = json.loads((tmp_path / "d" / "index.json").read_text())[-1]
    assert row["added"] == {"aten.relu.default": 1} and row["removed"] == {"aten.mm.default": 1}
    dump = (tmp_path / "d" / "002_post_export_b.txt").read_text()
    assert f"%{relu.name} = aten.relu.default(%x : 2x8 : torch.float32) : ?" in dump


def test_every_graphmodule_gets_a_section(mm_gm, tmp_path, monkeypatch):
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(tmp_path / "d"))
    holder = nn.Module()
    holder.first = mm_gm
    holder.second = _export(MatMul(), (torch.randn(3, 8),))
    path = GraphWriter().dump_graph(holder, "t", "sharding")
    text = path.read_text()
    assert "# GraphModules found: 2\n" in text
    assert "## GraphModule: first (" in text and "## GraphModule: second (" in text
    assert "%x : 3x8 : torch.float32" in text


@pytest.mark.parametrize("rank_env", ["1", "3"])
def test_rank_other_than_zero_writes_nothing(mm_gm, tmp_path, monkeypatch, rank_env):
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("RANK", rank_env)
    writer = GraphWriter()
    assert writer.dump_graph(mm_gm, "t", "export") is None
    writer.record_disabled("u", "export")
    assert not (tmp_path / "d").exists()


def test_foreign_directory_is_refused_and_kept(mm_gm, tmp_path, monkeypatch):
    out = tmp_path / "d"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    with pytest.raises(GraphDumpError, match="not written by autodeploy") as excinfo:
        GraphWriter().dump_graph(mm_gm, "t", "export")
    assert isinstance(excinfo.value, AutoDeployError)
    assert "notes.txt" in str(excinfo.value)
    assert (out / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_file_instead_of_directory_is_refused(mm_gm, tmp_path, monkeypatch):
    target = tmp_path / "f"
    target.write_text("x")
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(target))
    with pytest.raises(GraphDumpError, match="not a directory"):
        GraphWriter().dump_graph(mm_gm, "t", "export")
    assert target.read_text() == "x"


def test_previous_dump_directory_is_cleared(mm_gm, tmp_path, monkeypatch):
    out = tmp_path / "d"
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    GraphWriter().dump_graph(mm_gm, "old", "export")
    (out / "stale.txt").write_text("from the earlier run")
    writer = GraphWriter()  # a new process
    path = writer.dump_graph(mm_gm, "new", "export")
    assert path.name == "001_export_new.txt"
    expected = sorted([MARKER_FILE, "001_export_new.txt", "index.html", "index.json", "index.md"])
    assert sorted(p.name for p in out.iterdir()) == expected


def test_empty_existing_directory_is_used(mm_gm, tmp_path, monkeypatch):
    out = tmp_path / "d"
    out.mkdir()
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    assert GraphWriter().dump_graph(mm_gm, "t", "export").name == "001_export_t.txt"


def test_changing_directory_starts_a_new_session(mm_gm, tmp_path, monkeypatch):
    writer = GraphWriter()
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(tmp_path / "a"))
    writer.dump_graph(mm_gm, "t", "export")
    writer.dump_graph(mm_gm, "u", "export")
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(tmp_path / "b"))
    assert writer.dump_graph(mm_gm, "v", "export").name == "001_export_v.txt"
    assert len(json.loads((tmp_path / "b" / "index.json").read_text())) == 1
