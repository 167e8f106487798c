"""debug_visualize_dir: DOT per GraphModule, SVG only when `dot` exists, never fatal."""

import os
import stat

import pytest
import torch
from torch import nn

from autodeploy.transform.interface import BaseTransform, PipelineContext, Stages, TransformConfig, TransformInfo
from autodeploy.utils import visualize
from autodeploy.utils.visualize import write_graph_visualization

pytest.importorskip("pydot")


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.lin(x))


@pytest.fixture
def gm():
    return torch.export.export(Small(), (torch.randn(2, 4),)).module()


@pytest.fixture
def no_dot(monkeypatch):
    monkeypatch.setattr(visualize.shutil, "which", lambda name: None)


def _fake_dot(tmp_path, script):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "dot"
    program.write_text("#!/bin/sh\n" + script)
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return str(program)


def test_dot_file_per_transform(gm, tmp_path, no_dot):
    out = tmp_path / "viz"
    written = write_graph_visualization(gm, out, "fuse_gemms")
    assert written == [out / "fuse_gemms.dot"]
    text = (out / "fuse_gemms.dot").read_text()
    assert text.startswith("digraph fuse_gemms {")
    assert "linear" in text and "relu" in text
    assert not (out / "fuse_gemms.svg").exists()


def test_several_graphmodules_get_suffixed_names(gm, tmp_path, no_dot):
    holder = nn.Module()
    holder.enc = gm
    holder.dec = torch.export.export(Small(), (torch.randn(3, 4),)).module()
    written = write_graph_visualization(holder, tmp_path, "t")
    assert sorted(p.name for p in written) == ["t_dec.dot", "t_enc.dot"]


def test_no_graphmodule_writes_nothing(tmp_path, no_dot):
    assert write_graph_visualization(nn.Linear(2, 2), tmp_path / "v", "t") == []
    assert not (tmp_path / "v").exists()


def test_svg_when_dot_exists(gm, tmp_path, monkeypatch):
    program = _fake_dot(tmp_path, 'while [ "$1" != "-o" ]; do shift; done; echo "<svg/>" > "$2"\n')
    monkeypatch.setattr(visualize.shutil, "which", lambda name: program if name == "dot" else None)
    written = write_graph_visualization(gm, tmp_path / "viz", "t")
    assert [p.name for p in written] == ["t.dot", "t.svg"]
    assert (tmp_path / "viz" / "t.svg").read_text() == "<svg/>\n"


def test_failing_dot_does_not_raise(gm, tmp_path, monkeypatch):
    program = _fake_dot(tmp_path, "echo 'syntax error' >&2; exit 1\n")
    monkeypatch.setattr(visualize.shutil, "which", lambda name: program if name == "dot" else None)
    written = write_graph_visualization(gm, tmp_path / "viz", "t")
    assert [p.name for p in written] == ["t.dot"]


class _Identity(BaseTransform):
    _key = "identity_for_viz"

    def _apply(self, gm, ctx):
        return gm, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)


def test_transform_with_debug_visualize_dir(gm, tmp_path, no_dot):
    out = tmp_path / "viz"
    config = TransformConfig(stage=Stages.POST_EXPORT, debug_visualize_dir=str(out))
    _Identity(config)(gm, PipelineContext())
    assert os.listdir(out) == ["identity_for_viz.dot"]
