"""Every bad input through the CLI: a non-zero exit, one clear message naming the problem (key, field,
file, tensor), no traceback, and nothing deleted.

Config errors fail before any work; the checkpoint-tensor errors need ``--until weight_load``."""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy.cli import main


@contextlib.contextmanager
def _library_logs_to_current_stderr():
    """Logging handlers bind sys.stderr when created; under pytest that can be a capture stream of an
    earlier phase or test, already closed, whose '--- Logging error ---' would look like a traceback.
    Point them at the current stderr, so what a user would see (e.g. transformers' load report) is
    captured and checked too."""
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")  # creates transformers' handler now if it does not exist yet
    saved = []
    for name in ("transformers", "autodeploy"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler:  # not pytest's own capture handlers
                saved.append((handler, dict(vars(handler))))
                handler.stream = sys.stderr
                if "flush" in vars(handler):  # transformers binds flush to the stream it was created with
                    handler.flush = sys.stderr.flush
    try:
        yield
    finally:
        for handler, attrs in saved:
            handler.stream = attrs["stream"]
            if "flush" in attrs:
                handler.flush = attrs["flush"]


def _files(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _build(capsys, *args) -> str:
    """Run ``autodeploy build ARGS``; assert it failed cleanly and return the error line(s)."""
    with _library_logs_to_current_stderr():
        code = main(["build", *args])
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("autodeploy: error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path):
    """A private copy of the tiny llama checkpoint (safe to edit)."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), path)
    return path


def _edit_weights(folder, edit) -> None:
    file = folder / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})


def _yaml(tmp_path, text, name="extra.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# -- configuration ---------------------------------------------------------------------------------
def test_unknown_transform_key(capsys, ckpt, tmp_path):
    extra = _yaml(tmp_path, "transforms:\n  export_to_gmm:\n    stage: export\n")
    before = extra.read_text()
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--yaml-extra", str(extra))
    assert "unknown transform key 'export_to_gmm'" in msg and str(extra) in msg
    assert "did you mean 'export_to_gm'" in msg
    assert extra.read_text() == before


def test_unknown_transform_key_from_set(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt), "--until", "export",
                 "--set", "transforms.cleanup_noop_ad.stage=post_export")
    assert "unknown transform key 'cleanup_noop_ad'" in msg and "did you mean 'cleanup_noop_add'" in msg
    assert "--set transforms.cleanup_noop_ad.stage" in msg


def test_unknown_stage(capsys, ckpt, tmp_path):
    extra = _yaml(tmp_path, "transforms:\n  export_to_gm:\n    stage: exprt\n")
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--yaml-extra", str(extra))
    assert "transforms.export_to_gm.stage" in msg and "unknown stage 'exprt'" in msg and str(extra) in msg
    assert "post_export" in msg  # lists the valid stages


def test_unknown_until_stage(capsys, ckpt):
    with pytest.raises(SystemExit) as exc:  # argparse: usage + error, exit 2
        main(["build", "--model", str(ckpt), "--until", "exprt"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert "--until: invalid choice: 'exprt'" in err


def test_wrong_field_type_from_set(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--set", "transforms.export_to_gm.strict=maybe")
    assert "transforms.export_to_gm.strict" in msg and "boolean" in msg and "'maybe'" in msg
    assert "--set transforms.export_to_gm.strict" in msg


def test_wrong_field_type_from_file(capsys, ckpt, tmp_path):
    extra = _yaml(tmp_path, "transforms:\n  export_to_gm:\n    num_moe_experts_for_export: two\n")
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--yaml-extra", str(extra))
    assert "transforms.export_to_gm.num_moe_experts_for_export" in msg and "integer" in msg and str(extra) in msg


def test_wrong_top_level_type(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--set", "max_batch_size=lots")
    assert "max_batch_size" in msg and "'lots'" in msg and "--set max_batch_size" in msg


def test_malformed_yaml(capsys, ckpt, tmp_path):
    extra = _yaml(tmp_path, "transforms:\n  export_to_gm:\n    strict: [true\n", name="broken.yaml")
    before = extra.read_text()
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--yaml-extra", str(extra))
    assert f"malformed YAML in {extra}" in msg and "line" in msg
    assert extra.read_text() == before


def test_missing_yaml_file(capsys, ckpt, tmp_path):
    missing = tmp_path / "nope.yaml"
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--yaml-extra", str(missing))
    assert f"config file not found: {missing}" in msg


def test_second_yaml_file_missing_names_that_file(capsys, ckpt, tmp_path):
    good = _yaml(tmp_path, "transforms:\n  export_to_gm:\n    strict: false\n")
    missing = tmp_path / "second.yaml"
    msg = _build(capsys, "--model", str(ckpt), "--until", "export",
                 "--yaml-extra", str(good), "--yaml-extra", str(missing))
    assert str(missing) in msg and good.is_file()


# -- model folder ----------------------------------------------------------------------------------
def test_no_model(capsys):
    msg = _build(capsys, "--until", "export")
    assert "no model given" in msg and "--model" in msg


def test_missing_model_folder(capsys, tmp_path):
    missing = tmp_path / "no_such_model"
    msg = _build(capsys, "--model", str(missing), "--until", "export")
    assert f"model folder not found: {missing}" in msg


def test_model_path_is_a_file(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt / "config.json"), "--until", "export")
    assert str(ckpt / "config.json") in msg and "folder" in msg


def test_folder_without_config_json(capsys, ckpt):
    (ckpt / "config.json").unlink()
    before = _files(ckpt)
    msg = _build(capsys, "--model", str(ckpt), "--until", "export")
    assert str(ckpt) in msg and "config.json" in msg
    assert _files(ckpt) == before


def test_folder_without_safetensors(capsys, ckpt):
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    before = _files(ckpt)
    msg = _build(capsys, "--model", str(ckpt), "--until", "weight_load")
    assert str(ckpt) in msg and "*.safetensors" in msg
    assert _files(ckpt) == before


def test_unknown_export_patch(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt), "--until", "export",
                 "--set", "transforms.export_to_gm.patch_list=[autocast_nop]")
    assert "transforms.export_to_gm.patch_list" in msg and "unknown export patch 'autocast_nop'" in msg
    assert "did you mean 'autocast_noop'" in msg


def test_unknown_model_kwargs_key(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--set", "model_kwargs.num_hiden_layers=1")
    assert "model_kwargs.num_hiden_layers" in msg and "LlamaConfig" in msg and "config.json" in msg


# -- checkpoint tensors (--until weight_load) ------------------------------------------------------
MISSING = "model.layers.1.mlp.down_proj.weight"
EXTRA = "model.layers.0.mlp.extra_proj.weight"
RESHAPED = "model.layers.0.self_attn.q_proj.weight"


def _drop(state):
    del state[MISSING]


def _add(state):
    state[EXTRA] = torch.zeros(3, 3)


def _reshape(state):
    state[RESHAPED] = state[RESHAPED][: state[RESHAPED].shape[0] // 2].contiguous()


@pytest.mark.parametrize("edit, tensor, words", [
    (_drop, MISSING, "missing tensor"),
    (_add, EXTRA, "unexpected tensor"),
    (_reshape, RESHAPED, "wrongly shaped tensor"),
], ids=["missing", "unexpected", "wrong_shape"])
def test_checkpoint_tensor_mismatch(capsys, ckpt, edit, tensor, words):
    _edit_weights(ckpt, edit)
    before = _files(ckpt)
    msg = _build(capsys, "--model", str(ckpt), "--until", "weight_load")
    assert str(ckpt) in msg and words in msg and tensor in msg
    if edit is _reshape:
        assert "(32, 64)" in msg and "(64, 64)" in msg  # checkpoint vs model shape
    assert _files(ckpt) == before


# -- graph dumps -------------------------------------------------------------------------------------
def test_dump_dir_with_foreign_files_is_not_cleared(capsys, ckpt, tmp_path, monkeypatch):
    foreign = tmp_path / "my_notes"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("do not delete")
    (foreign / "sub").mkdir()
    (foreign / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = _files(foreign)
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(foreign))
    msg = _build(capsys, "--model", str(ckpt), "--until", "export")
    assert "AD_DUMP_GRAPHS_DIR" in msg and str(foreign) in msg and "refusing to clear" in msg
    assert _files(foreign) == before


def test_yaml_file_that_is_not_text(capsys, ckpt, tmp_path):
    binary = tmp_path / "extra.yaml"
    binary.write_bytes(b"transforms:\n\xff\xfe\x00")
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--yaml-extra", str(binary))
    assert f"cannot read config file {binary}" in msg
    assert binary.is_file()


def test_malformed_config_json(capsys, ckpt):
    (ckpt / "config.json").write_text('{"model_type": "llama", ')
    msg = _build(capsys, "--model", str(ckpt), "--until", "export")
    assert str(ckpt) in msg and "config.json" in msg and "not a valid JSON" in msg


def test_model_kwargs_value_of_wrong_type(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt), "--until", "export", "--set", "model_kwargs.num_hidden_layers=abc")
    assert "model_kwargs.num_hidden_layers='abc'" in msg and "LlamaConfig" in msg and "int" in msg


def test_unknown_device(capsys, ckpt):
    msg = _build(capsys, "--model", str(ckpt), "--until", "weight_load", "--set", "device=foo")
    assert "device" in msg and "'foo'" in msg and "--set device" in msg
