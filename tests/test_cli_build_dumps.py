"""End to end: `autodeploy build` with AD_DUMP_GRAPHS_DIR on the tiny llama, then `graph diff`."""

import json
import re

import pytest

from autodeploy.cli import main
from autodeploy.utils.graph_writer import MARKER_FILE, graph_writer
from autodeploy.utils.logger import refresh_level

PATTERN_MATCHERS = [
    "match_moe_pattern", "match_repeat_kv", "match_eager_attention", "match_attention_chain",
    "match_sdpa_to_torch_attention", "match_grouped_attention", "match_rope_pattern", "match_rope_layout",
    "match_attention_layout",
    "eliminate_redundant_transposes", "match_rmsnorm_pattern", "match_layernorm_pattern", "match_causal_conv1d",
]
EXPECTED_FILES = [
    "001_export_export_to_gm.txt",
    "002_post_export_cleanup_noop_slice.txt",
    # cleanup_noop_add is disabled below: an index row, no file, no number
    "003_post_export_cleanup_noop_to.txt",
    "004_post_export_cleanup_input_constraints.txt",
    "005_post_export_cleanup_slice_writes.txt",
    *(
        f"{n:03d}_pattern_matcher_{key}.txt"
        for n, key in enumerate(PATTERN_MATCHERS, start=6)
    ),
    f"{6 + len(PATTERN_MATCHERS):03d}_sharding_detect_sharding.txt",  # skipped with one rank: still dumped
    f"{7 + len(PATTERN_MATCHERS):03d}_sharding_sharding_transform_executor.txt",
    f"{8 + len(PATTERN_MATCHERS):03d}_weight_load_load_weights.txt",
]
#: the pattern matchers disabled by default (an index row after the one named, no file, no number)
DISABLED_MATCHERS = {"eliminate_redundant_transposes": "match_mla_attention"}


def _matcher_rows():
    for n, key in enumerate(PATTERN_MATCHERS, start=6):
        yield f"{n:03d}", "pattern_matcher", key
        if key in DISABLED_MATCHERS:
            yield "-", "pattern_matcher", DISABLED_MATCHERS[key]

PLACEHOLDER = re.compile(r"^%input_ids : batchxseq : torch\.int64$", re.M)
EMBEDDING = re.compile(
    r"^%embedding = aten\.embedding\.default\(%model_embed_tokens_weight : 128x64 : torch\.float32, "
    r"%input_ids : batchxseq : torch\.int64\) : batchxseqx64 : torch\.float32$",
    re.M,
)
LINEAR = re.compile(
    r"^%linear_\d+ = aten\.linear\.default\(%\w+ : batchxseqx64 : torch\.float32, "
    r"%lm_head_weight : 128x64 : torch\.float32\) : batchxseqx128 : torch\.float32$",
    re.M,
)


@pytest.fixture
def info_logging(monkeypatch):
    """INFO level on rank 0, whatever an earlier test left (the level is only applied on refresh)."""
    monkeypatch.delenv("AUTO_DEPLOY_LOG_LEVEL", raising=False)
    refresh_level()
    yield
    refresh_level()


def _build(model, *extra):
    return main(["build", "--model", str(model), *extra])


def test_build_writes_dumps_index_and_summary(tiny_checkpoint, tmp_path, monkeypatch, capfd, info_logging):
    out = tmp_path / "dumps"
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    assert _build(tiny_checkpoint("llama"), "--until", "weight_load",
                  "--set", "transforms.cleanup_noop_add.enabled=false") == 0
    err = capfd.readouterr().err

    assert sorted(p.name for p in out.glob("*.txt")) == EXPECTED_FILES
    assert (out / MARKER_FILE).is_file()
    for name in EXPECTED_FILES:
        text = (out / name).read_text()
        number, rest = name[:-4].split("_", 1)
        stage = next(s for s in ("post_export", "export", "pattern_matcher", "sharding", "weight_load")
                     if rest.startswith(s + "_"))
        key = rest[len(stage) + 1:]
        header = f"# Transform: {key}\n# Stage: {stage}\n# GraphModules found: 1\n\n## GraphModule: <root> ("
        assert text.startswith(header)
        assert PLACEHOLDER.search(text), name
        assert EMBEDDING.search(text), name
        assert LINEAR.search(text), name
        assert re.search(r"^output %linear_\d+$", text, re.M), name
        assert text.endswith("\n")

    # log lines with their transform prefix, one [SUMMARY] per transform
    assert "[stage=factory, transform=build_model] [SUMMARY] matches=1 | time: " in err
    assert "[stage=export, transform=export_to_gm] [SUMMARY] matches=1 | time: " in err
    assert re.search(r"\[stage=post_export, transform=cleanup_noop_slice\] \[SUMMARY\] (matches=\d+|skipped) "
                     r"\| time: ", err)
    assert "[stage=post_export, transform=cleanup_noop_add] [SUMMARY] disabled" in err
    assert re.search(r"\[stage=post_export, transform=cleanup_input_constraints\] \[SUMMARY\] matches=\d+ "
                     r"\| time: ", err)
    assert re.search(r"\[stage=weight_load, transform=load_weights\] \[SUMMARY\] matches=\d+ \| time: ", err)

    rows = json.loads((out / "index.json").read_text())
    assert [(r["number"], r["stage"], r["transform"]) for r in rows] == [
        ("-", "factory", "build_model"),
        ("001", "export", "export_to_gm"),
        ("002", "post_export", "cleanup_noop_slice"),
        ("-", "post_export", "cleanup_noop_add"),
        ("003", "post_export", "cleanup_noop_to"),
        ("004", "post_export", "cleanup_input_constraints"),
        ("005", "post_export", "cleanup_slice_writes"),
        *_matcher_rows(),
        (f"{6 + len(PATTERN_MATCHERS):03d}", "sharding", "detect_sharding"),
        (f"{7 + len(PATTERN_MATCHERS):03d}", "sharding", "sharding_transform_executor"),
        (f"{8 + len(PATTERN_MATCHERS):03d}", "weight_load", "load_weights"),
    ]
    disabled = rows[3]
    assert disabled["result"] == "disabled" and disabled["file"] is None
    export_row, constraints_row = rows[1], rows[5]
    assert export_row["added"]["aten.linear.default"] == 15 and export_row["nodes"] > 100
    assert constraints_row["removed"].get("aten._assert_tensor_metadata.default", 0) > 0
    assert constraints_row["nodes"] < export_row["nodes"]
    md = (out / "index.md").read_text()
    assert "| - | post_export | cleanup_noop_add | disabled |" in md

    # graph diff between two of these dumps shows what cleanup_input_constraints removed
    assert main(["graph", "diff", str(out), "3", "cleanup_input_constraints"]) == 0
    report = capfd.readouterr().out
    lines = report.splitlines()
    assert lines[0] == f"graph diff: {EXPECTED_FILES[2]} -> {EXPECTED_FILES[3]}"
    n_removed = constraints_row["removed"]["aten._assert_tensor_metadata.default"]
    assert f"  - aten._assert_tensor_metadata.default x{n_removed}" in lines
    assert lines[lines.index("ops added:") + 1] == "  (none)"
    assert any(line.startswith("-%_assert_tensor_metadata_default = aten._assert_tensor_metadata.default(")
               for line in lines)
    assert not any(line.startswith("+%") for line in lines)


def test_rank_other_than_zero_writes_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "dumps"
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    monkeypatch.setenv("RANK", "1")
    assert _build(tiny_checkpoint("llama"), "--until", "export") == 0
    assert not out.exists()


def test_foreign_directory_is_refused(tiny_checkpoint, tmp_path, monkeypatch, capfd, info_logging):
    out = tmp_path / "dumps"
    out.mkdir()
    (out / "thesis.tex").write_text("keep me")
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    assert _build(tiny_checkpoint("llama"), "--until", "export") != 0
    err = capfd.readouterr().err
    assert f"autodeploy: error: AD_DUMP_GRAPHS_DIR={out} is not empty" in err
    assert "refusing to clear it" in err
    assert (out / "thesis.tex").read_text() == "keep me"
    assert [p.name for p in out.iterdir()] == ["thesis.tex"]


def test_directory_of_an_earlier_run_is_cleared_and_reused(tiny_checkpoint, tmp_path, monkeypatch):
    out = tmp_path / "dumps"
    out.mkdir()
    (out / MARKER_FILE).write_text("")
    (out / "007_post_load_fusion_fuse_gemms.txt").write_text("# stale")
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(out))
    assert _build(tiny_checkpoint("llama"), "--until", "export") == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MARKER_FILE, "001_export_export_to_gm.txt", "index.html", "index.json", "index.md"]
    )

    graph_writer.reset()  # a second process on the same directory starts over at 001
    assert _build(tiny_checkpoint("llama"), "--until", "export") == 0
    assert sorted(p.name for p in out.glob("*.txt")) == ["001_export_export_to_gm.txt"]
    assert len(json.loads((out / "index.json").read_text())) == 2  # build_model + export_to_gm


def test_no_env_writes_nothing(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _build(tiny_checkpoint("llama"), "--until", "export") == 0
    assert list(tmp_path.iterdir()) == []
