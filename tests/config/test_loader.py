"""Config loading: the packaged default pipeline, --yaml-extra deep merges, --set overrides, the
Python API's dict form, and error messages that name the key, the field and the file."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

import autodeploy
from autodeploy.config import load_config
from autodeploy.config.loader import default_yaml_text, parse_override
from autodeploy.errors import ConfigError
from autodeploy.transform import InferenceOptimizer, Stages, TransformRegistry


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the default pipeline ------------------------------------------------------------------------
def test_default_yaml_ships_inside_the_package():
    assert resources.files("autodeploy.config").joinpath("default.yaml").is_file()
    data = yaml.safe_load(default_yaml_text())
    assert isinstance(data["transforms"], dict) and data["transforms"]


def test_default_pipeline_is_valid():
    config = load_config()
    assert list(config.transforms)[:2] == ["build_model", "export_to_gm"]
    assert "load_weights" in config.transforms
    for key, entry in config.transforms.items():
        assert TransformRegistry.has(key), key
        Stages(entry["stage"])
    assert (config.model, config.dtype, config.device, config.max_batch_size, config.max_seq_len) == (
        None, "auto", "cpu", 8, 512)
    assert config.transforms["load_weights"]["expect_mem_change"] is True
    InferenceOptimizer(config)  # every entry validates against its own config class


# -- --yaml-extra ----------------------------------------------------------------------------------
def test_yaml_extra_files_deep_merge_in_order(tmp_path):
    first = _write(tmp_path, "first.yaml", """
max_seq_len: 128
transforms:
  export_to_gm:
    strict: true
    patch_list: [autocast_noop]
  cleanup_noop_add:
    enabled: false
""")
    second = _write(tmp_path, "second.yaml", """
transforms:
  export_to_gm:
    strict: false
""")
    config = load_config([first, second])
    export = config.transforms["export_to_gm"]
    assert export["strict"] is False  # the later file wins
    assert export["patch_list"] == ["autocast_noop"]  # the earlier file's other fields stay
    assert export["stage"] == "export" and export["run_per_gm"] is False  # defaults stay
    assert config.transforms["cleanup_noop_add"] == {"stage": "post_export", "enabled": False}
    assert config.max_seq_len == 128
    assert "build_model" in config.transforms and "load_weights" in config.transforms
    assert config.source_of("transforms.export_to_gm.strict") == str(second)
    assert config.source_of("transforms.export_to_gm.patch_list") == str(first)
    assert config.source_of("transforms.build_model.stage") == "default.yaml"


def test_yaml_extra_can_add_a_transform_and_empty_file_is_fine(tmp_path):
    extra = _write(tmp_path, "extra.yaml", "transforms:\n  cleanup_noop_slice:\n    stage: post_export\n")
    empty = _write(tmp_path, "empty.yaml", "")
    config = load_config([str(extra), empty])
    assert config.transforms["cleanup_noop_slice"] == {"stage": "post_export"}


# -- --set / overrides ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("a.b=true", (["a", "b"], True)),
    ("a=3", (["a"], 3)),
    ("a=[x, y]", (["a"], ["x", "y"])),
    ("a=null", (["a"], None)),
    ("a=", (["a"], None)),
    ("a=maybe", (["a"], "maybe")),
    ("a=b=c", (["a"], "b=c")),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


def test_set_overrides_apply_last(tmp_path):
    extra = _write(tmp_path, "extra.yaml", "transforms:\n  export_to_gm:\n    strict: false\n")
    config = load_config([extra], ["transforms.export_to_gm.strict=true", "max_batch_size=2",
                                   "model_kwargs.num_hidden_layers=1", "max_batch_size=4"])
    assert config.transforms["export_to_gm"]["strict"] is True
    assert config.max_batch_size == 4  # repeated: the last one wins
    assert config.model_kwargs == {"num_hidden_layers": 1}
    assert config.source_of("transforms.export_to_gm.strict") == "--set transforms.export_to_gm.strict"


def test_python_overrides_dict_is_the_same_as_set(tmp_path):
    from_cli = load_config(None, ["transforms.export_to_gm.patch_list=[autocast_noop]", "dtype=float32"])
    from_api = load_config(overrides={"transforms.export_to_gm.patch_list": ["autocast_noop"], "dtype": "float32"})
    assert from_cli.model_dump() == from_api.model_dump()
    assert from_api.source_of("dtype") == "overrides['dtype']"


def test_override_with_a_mapping_merges_into_the_entry():
    config = load_config(overrides={"transforms": {"export_to_gm": {"strict": True}}})
    assert config.transforms["export_to_gm"]["strict"] is True
    assert config.transforms["export_to_gm"]["stage"] == "export"
    assert "build_model" in config.transforms  # the rest of the pipeline is kept


def test_set_can_add_a_transform_entry():
    config = load_config(None, ["transforms.cleanup_noop_slice.stage=post_export"])
    assert config.transforms["cleanup_noop_slice"]["stage"] == "post_export"


# -- errors ------------------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file not found: {missing}"):
        load_config([missing])


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = _write(tmp_path, "bad.yaml", "transforms:\n  export_to_gm:\n    strict: [true\n")
    with pytest.raises(ConfigError, match=rf"malformed YAML in {bad} \(line \d+, column \d+\)"):
        load_config([bad])


def test_top_level_must_be_a_mapping(tmp_path):
    bad = _write(tmp_path, "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match=rf"{bad}: the top level must be a mapping"):
        load_config([bad])


def test_transform_entry_must_be_a_mapping(tmp_path):
    bad = _write(tmp_path, "entry.yaml", "transforms:\n  export_to_gm: 3\n")
    with pytest.raises(ConfigError, match=rf"transforms\.export_to_gm must be a mapping.*{bad}"):
        load_config([bad])
    with pytest.raises(ConfigError, match="'transforms' must be a mapping"):
        load_config(None, ["transforms=3"])


def test_unknown_top_level_key_suggests_close_match(tmp_path):
    bad = _write(tmp_path, "typo.yaml", "max_seq_lenn: 64\n")
    with pytest.raises(ConfigError, match=rf"unknown config key 'max_seq_lenn' \(did you mean 'max_seq_len'\?\) "
                                          rf"\(from {bad}\)"):
        load_config([bad])


def test_wrong_top_level_type_names_field_and_source(tmp_path):
    bad = _write(tmp_path, "type.yaml", "max_batch_size: lots\n")
    with pytest.raises(ConfigError, match=rf"max_batch_size: .*valid integer.*'lots' \(from {bad}\)"):
        load_config([bad])
    with pytest.raises(ConfigError, match=r"dtype: .*must be one of auto, float32.*\(from --set dtype\)"):
        load_config(None, ["dtype=float64"])


def test_wrong_transform_field_type_names_key_field_and_file(tmp_path):
    bad = _write(tmp_path, "strict.yaml", "transforms:\n  export_to_gm:\n    strict: maybe\n")
    match = rf"transforms\.export_to_gm\.strict: .*valid boolean.*'maybe' \(from {bad}\)"
    with pytest.raises(ConfigError, match=match):
        InferenceOptimizer(load_config([bad]))


def test_unknown_transform_key_names_the_file(tmp_path):
    bad = _write(tmp_path, "key.yaml", "transforms:\n  export_to_gmm:\n    stage: export\n")
    with pytest.raises(ConfigError, match=rf"unknown transform key 'export_to_gmm' in {bad}; "
                                          r"did you mean 'export_to_gm'\?"):
        InferenceOptimizer(load_config([bad]))


def test_unknown_transform_key_from_set_names_the_set():
    with pytest.raises(ConfigError, match=r"unknown transform key 'load_weigths' in --set transforms\.load_weigths"
                                          r"\.stage; did you mean 'load_weights'\?"):
        InferenceOptimizer(load_config(None, ["transforms.load_weigths.stage=weight_load"]))


def test_unknown_stage_names_the_file(tmp_path):
    bad = _write(tmp_path, "stage.yaml", "transforms:\n  export_to_gm:\n    stage: exprt\n")
    with pytest.raises(ConfigError, match=rf"transforms\.export_to_gm\.stage \(from {bad}\): unknown stage 'exprt'"):
        InferenceOptimizer(load_config([bad]))


@pytest.mark.parametrize("text, match", [
    ("no_equals_sign", "expected dotted.key=value"),
    ("a..b=1", "empty key segment"),
    ("max_batch_size.x=1", "max_batch_size is not a mapping"),
])
def test_bad_set_syntax(text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [text])


# -- the Python API takes the same ---------------------------------------------------------------------
def test_optimize_signature():
    import inspect

    params = inspect.signature(autodeploy.optimize).parameters
    assert list(params) == ["model", "until", "yaml_extra", "overrides", "verify", "verify_atol", "verify_rtol"]
    assert all(params[name].default is None for name in ("until", "yaml_extra", "overrides", "verify_atol",
                                                          "verify_rtol"))
    assert params["verify"].default is False


def test_optimize_takes_yaml_extra_and_overrides(tmp_path, tiny_checkpoint):
    extra = _write(tmp_path, "extra.yaml", "model_kwargs:\n  num_hidden_layers: 3\n")
    model = autodeploy.optimize(tiny_checkpoint("llama"), until="factory", yaml_extra=str(extra),
                                overrides={"model_kwargs.num_hidden_layers": 1})
    assert len(model.model.layers) == 1  # overrides win over the file
    assert next(model.parameters()).is_meta
    model = autodeploy.optimize(tiny_checkpoint("llama"), until=Stages.FACTORY, yaml_extra=[extra])
    assert len(model.model.layers) == 3


def test_optimize_reports_config_errors(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"transforms\.export_to_gm\.strict: .*\(from overrides\["):
        autodeploy.optimize(tiny_checkpoint("llama"), until="export",
                            overrides={"transforms.export_to_gm.strict": "maybe"})
    with pytest.raises(ConfigError, match="until: unknown stage 'exprt'"):
        autodeploy.optimize(tiny_checkpoint("llama"), until="exprt")


def test_unreadable_or_directory_yaml_extra(tmp_path):
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(b"transforms:\n\xff\xfe\x00")
    with pytest.raises(ConfigError, match=rf"cannot read config file {binary}: .*utf-8"):
        load_config([binary])
    with pytest.raises(ConfigError, match=rf"config file {tmp_path} is a directory"):
        load_config([tmp_path])


@pytest.mark.parametrize("device, match", [
    ("foo", "not a torch device"),
    pytest.param("cuda", "cuda is not available", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="a GPU is present")),
])
def test_bad_device(device, match):
    with pytest.raises(ConfigError, match=rf"device: .*{match}.*'{device}' \(from --set device\)"):
        load_config(None, [f"device={device}"])
    assert load_config(None, ["device=cpu:0"]).device == "cpu:0"
