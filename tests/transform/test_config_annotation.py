"""A transform's config class is the one its ``config:`` annotation names (inherited when it has none)."""

import pytest

from autodeploy.transform import BaseTransform, TransformConfig
from autodeploy.transform.interface import GraphRewriteConfig


class _Mine(TransformConfig):
    level: int = 3


class Annotated(BaseTransform):
    config: _Mine


class Inherits(Annotated):
    pass


class Plain(BaseTransform):
    pass


class Wrong(BaseTransform):
    config: int


def test_config_class_from_the_annotation():
    assert Annotated.get_config_class() is _Mine
    assert Inherits.get_config_class() is _Mine
    assert Plain.get_config_class() is TransformConfig
    with pytest.raises(TypeError, match="Wrong.config must be annotated with a TransformConfig subclass"):
        Wrong.get_config_class()


def test_graph_rewrite_config_keeps_shapes_current():
    config = GraphRewriteConfig(stage="pattern_matcher")
    assert config.requires_shape_prop and config.run_shape_prop and config.requires_clean_graph
    base = TransformConfig(stage="pattern_matcher")
    assert not base.requires_shape_prop and not base.run_shape_prop  # the seed's defaults stay as they are
