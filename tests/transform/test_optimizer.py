"""InferenceOptimizer: stable sort by stage, per-transform config validation, ``until``, logging.
Tiny transforms are registered here under ``test_opt_*`` keys."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import Field

from autodeploy.config import load_config
from autodeploy.config.loader import AutoDeployConfig
from autodeploy.errors import AutoDeployError, ConfigError
from autodeploy.transform import (
    BaseTransform,
    InferenceOptimizer,
    Stages,
    TransformConfig,
    TransformInfo,
    TransformRegistry,
    transform_history,
)
from autodeploy.transform.library.export_to_gm import ExportToGMConfig
from autodeploy.utils.logger import ad_logger

CALLS: list[str] = []


class _Recorder(BaseTransform):
    def _apply(self, gm, ctx):
        CALLS.append(self.get_transform_key())
        return gm, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=True)


for _name in ("a", "b", "c", "d", "e"):
    TransformRegistry.register(f"test_opt_{_name}")(type(f"Rec_{_name}", (_Recorder,), {}))


class ScaleConfig(TransformConfig):
    factor: int = Field(default=2, description="A knob with a type.")


@TransformRegistry.register("test_opt_scale")
class Scale(_Recorder):
    @classmethod
    def get_config_class(cls):
        return ScaleConfig


@pytest.fixture(autouse=True)
def _clear_calls():
    CALLS.clear()


@pytest.fixture
def ad_log():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    ad_logger.addHandler(handler)
    try:
        yield records
    finally:
        ad_logger.removeHandler(handler)


def _config(transforms: dict) -> AutoDeployConfig:
    return AutoDeployConfig.model_validate({"transforms": transforms})


def _gm():
    return torch.fx.symbolic_trace(lambda x: x + 1)


PIPELINE = {  # config order deliberately not stage order
    "test_opt_c": {"stage": "post_export"},
    "test_opt_a": {"stage": "export"},
    "test_opt_e": {"stage": "compile"},
    "test_opt_b": {"stage": "post_export"},
    "test_opt_d": {"stage": "export"},
}


def test_sorted_stably_by_stage():
    optimizer = InferenceOptimizer(_config(PIPELINE))
    keys = [t.get_transform_key() for t in optimizer.transforms]
    assert keys == ["test_opt_a", "test_opt_d", "test_opt_c", "test_opt_b", "test_opt_e"]
    gm = optimizer(_gm())
    assert CALLS == keys
    assert list(transform_history(gm)) == keys


@pytest.mark.parametrize("until, expected", [
    ("export", ["test_opt_a", "test_opt_d"]),
    (Stages.POST_EXPORT, ["test_opt_a", "test_opt_d", "test_opt_c", "test_opt_b"]),
    ("weight_load", ["test_opt_a", "test_opt_d", "test_opt_c", "test_opt_b"]),
    ("factory", []),
    (None, ["test_opt_a", "test_opt_d", "test_opt_c", "test_opt_b", "test_opt_e"]),
])
def test_until_stops_after_the_stage(until, expected):
    InferenceOptimizer(_config(PIPELINE))(_gm(), until=until)
    assert CALLS == expected


def test_until_unknown_stage_is_a_config_error():
    optimizer = InferenceOptimizer(_config(PIPELINE))
    with pytest.raises(ConfigError, match=r"until: unknown stage 'exprt'; expected one of: factory, export"):
        optimizer(_gm(), until="exprt")
    assert CALLS == []


def test_each_entry_validated_with_its_own_config_class():
    optimizer = InferenceOptimizer(_config({
        "test_opt_scale": {"stage": "post_export", "factor": "7"},
        "test_opt_a": {"stage": "export", "factor": 5},  # extra field on a plain TransformConfig
    }))
    a, scale = optimizer.transforms
    assert type(scale.config) is ScaleConfig and scale.config.factor == 7
    assert type(a.config) is TransformConfig and a.config.model_extra == {"factor": 5}
    assert scale.config.stage is Stages.POST_EXPORT


def test_wrong_field_type_names_key_and_field():
    with pytest.raises(ConfigError, match=r"transforms\.test_opt_scale\.factor: .*valid integer.*'many'"):
        InferenceOptimizer(_config({"test_opt_scale": {"stage": "export", "factor": "many"}}))


def test_unknown_transform_key_suggests_close_match():
    with pytest.raises(ConfigError, match=r"unknown transform key 'test_opt_scal'.*did you mean 'test_opt_scale'"):
        InferenceOptimizer(_config({"test_opt_scal": {"stage": "export"}}))


def test_unknown_stage_lists_the_stages():
    with pytest.raises(ConfigError, match=r"transforms\.test_opt_a\.stage .*unknown stage 'exprt'; expected one of: "
                                          r"factory, export, post_export"):
        InferenceOptimizer(_config({"test_opt_a": {"stage": "exprt"}}))


def test_missing_stage_is_an_error():
    with pytest.raises(ConfigError, match=r"transforms\.test_opt_a.*missing required field 'stage'"):
        InferenceOptimizer(_config({"test_opt_a": {"enabled": True}}))


def test_misspelled_field_warns_with_suggestion(ad_log):
    InferenceOptimizer(_config({"test_opt_scale": {"stage": "export", "factr": 3}}))
    warnings = [r.getMessage() for r in ad_log if r.levelno == logging.WARNING]
    assert any("transforms.test_opt_scale.factr" in m and "did you mean 'factor'" in m for m in warnings)


def test_disabled_transform_is_recorded_not_run():
    gm = InferenceOptimizer(_config({**PIPELINE, "test_opt_b": {"stage": "post_export", "enabled": False}}))(_gm())
    assert "test_opt_b" not in CALLS
    assert transform_history(gm)["test_opt_b"].disabled


def test_logs_total_time(ad_log):
    InferenceOptimizer(_config(PIPELINE))(_gm())
    messages = [r.getMessage() for r in ad_log]
    assert messages[-1].startswith("pipeline finished in ") and messages[-1].endswith(" s")
    assert sum("[SUMMARY]" in m for m in messages) == len(PIPELINE)


def test_default_pipeline_builds_in_stage_order():
    optimizer = InferenceOptimizer(load_config())
    stages = [t.config.stage for t in optimizer.transforms]
    assert stages == sorted(stages)
    keys = [t.get_transform_key() for t in optimizer.transforms]
    assert keys[:2] == ["build_model", "export_to_gm"] and keys[-1] == "compile_model"
    assert keys.index("load_weights") < keys.index("fuse_gemms") < keys.index("resize_kv_cache")
    assert keys.index("match_moe_pattern") < keys.index("match_rmsnorm_pattern") < keys.index("load_weights")
    export = optimizer.transforms[1]
    assert type(export.config) is ExportToGMConfig and export.config.run_per_gm is False


def test_default_pipeline_without_a_model_names_the_problem():
    with pytest.raises(AutoDeployError, match="build_model needs a model"):
        InferenceOptimizer(load_config())(until="factory")


def test_context_takes_pipeline_settings():
    config = load_config(overrides={"max_batch_size": 3, "max_seq_len": 64})
    optimizer = InferenceOptimizer(config, factory="the-factory")
    assert (optimizer.ctx.max_batch_size, optimizer.ctx.max_seq_len, optimizer.ctx.factory) == (3, 64, "the-factory")
