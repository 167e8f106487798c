"""The transform interface: Stages, TransformConfig (against the seed's schema), TransformRegistry and
the BaseTransform driver (pre/post clean-up, per-GraphModule application, skip_on_error, history,
timings, memory check). Tiny transforms are registered here under ``test_iface_*`` keys."""

from __future__ import annotations

import logging

import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.fx import GraphModule

import autodeploy.transform.interface as interface
from autodeploy.errors import AutoDeployError, ConfigError
from autodeploy.transform import (
    BaseTransform,
    Stages,
    TransformConfig,
    TransformInfo,
    TransformRegistry,
    transform_history,
)
from autodeploy.transform.library.export_to_gm import ExportToGM, ExportToGMConfig
from autodeploy.utils.logger import ad_logger
from helpers import run_transform

aten = torch.ops.aten
SEED_STAGES = [
    "factory", "export", "post_export", "pattern_matcher", "sharding",
    "weight_load", "post_load_fusion", "cache_init", "visualize", "compile",
]


# -- helpers -------------------------------------------------------------------------------------
class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        record.formatted = self.format(record)  # now: the transform prefix is only set while it runs
        self.records.append(record)


@pytest.fixture
def ad_log():
    """The autodeploy log records emitted during the test (the logger does not propagate to caplog)."""
    handler = _ListHandler()
    ad_logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        ad_logger.removeHandler(handler)


def _messages(records, level=None) -> list[str]:
    return [r.getMessage() for r in records if level is None or r.levelno == level]


def _traced_with_dead_code() -> GraphModule:
    """``x + 1`` with a dead ``x * 2`` node that canonicalization removes."""

    def f(x):
        y = x * 2  # noqa: F841 - dead on purpose
        return x + 1

    return torch.fx.symbolic_trace(f)


def _count(gm: GraphModule, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "") == name)


class _SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return (self.lin(x).relu(),)


def _exported() -> GraphModule:
    """A GraphModule from torch.export: every node carries node.meta['val']."""
    return torch.export.export(_SmallNet(), (torch.randn(2, 4),)).module()


# -- tiny transforms -----------------------------------------------------------------------------
@TransformRegistry.register("test_iface_count_mul")
class CountMul(BaseTransform):
    """Counts ``mul`` nodes (reports them as matches) and records what it saw."""

    seen: list = []

    def _apply(self, gm, ctx):
        n = _count(gm, "mul")
        type(self).seen.append((gm, n))
        return gm, TransformInfo(skipped=False, num_matches=n, is_clean=True, has_valid_shapes=True)


@TransformRegistry.register("test_iface_add_dead_node")
class AddDeadNode(BaseTransform):
    """Adds an unused ``x * 3`` node and reports the graph as not clean."""

    def _apply(self, gm, ctx):
        x = next(iter(gm.graph.find_nodes(op="placeholder")))
        with gm.graph.inserting_after(x):
            gm.graph.call_function(torch.mul, (x, 3))
        gm.recompile()
        return gm, TransformInfo(skipped=False, num_matches=1, is_clean=False, has_valid_shapes=False)


@TransformRegistry.register("test_iface_insert_neg")
class InsertNeg(BaseTransform):
    """Negates the first output (a new node without node.meta['val']); shapes are not current after it."""

    def _apply(self, gm, ctx):
        out = next(iter(gm.graph.find_nodes(op="output")))
        first = out.args[0][0]
        with gm.graph.inserting_before(out):
            neg = gm.graph.call_function(aten.neg.default, (first,))
        out.args = ((neg, *out.args[0][1:]),)
        gm.recompile()
        return gm, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=False)


@TransformRegistry.register("test_iface_needs_shapes")
class NeedsShapes(BaseTransform):
    """Records whether every computing node has node.meta['val'] when it runs."""

    saw_all_vals: list = []

    def _apply(self, gm, ctx):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        type(self).saw_all_vals.append(all(isinstance(n.meta.get("val"), torch.Tensor) for n in nodes))
        return gm, TransformInfo(skipped=False, num_matches=0, is_clean=True, has_valid_shapes=True)


@TransformRegistry.register("test_iface_raise")
class Raise(BaseTransform):
    """Mutates nothing and fails (RuntimeError, or AutoDeployError with config extra user_error=true)."""

    def _apply(self, gm, ctx):
        if (self.config.model_extra or {}).get("user_error"):
            raise AutoDeployError("bad user input")
        raise RuntimeError("pattern exploded")


@TransformRegistry.register("test_iface_half_done")
class HalfDone(AddDeadNode):
    """Changes the graph (a dead node), then fails."""

    def _apply(self, gm, ctx):
        super()._apply(gm, ctx)
        raise RuntimeError("failed half way")


@TransformRegistry.register("test_iface_replace_gm")
class ReplaceGM(BaseTransform):
    """Returns a new GraphModule (x - 1) instead of mutating the given one."""

    def _apply(self, gm, ctx):
        new = torch.fx.symbolic_trace(lambda x: x - 1)
        return new, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=True)


@TransformRegistry.register("test_iface_alloc")
class Alloc(BaseTransform):
    """Attaches a 128 MiB buffer to the module (a real memory change)."""

    def _apply_to_full_model(self, mod, ctx):
        mod.register_buffer("_test_big", torch.ones(32 * 1024**2))  # 128 MiB of float32, pages touched
        return mod, TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=True)


@TransformRegistry.register("test_iface_noop")
class Noop(BaseTransform):
    calls = 0

    def _apply(self, gm, ctx):
        type(self).calls += 1
        return gm, TransformInfo(skipped=True, num_matches=0, is_clean=True, has_valid_shapes=True)


@pytest.fixture(autouse=True)
def _reset_recorders():
    CountMul.seen = []
    NeedsShapes.saw_all_vals = []
    Noop.calls = 0


# -- Stages --------------------------------------------------------------------------------------
def test_stages_are_the_seed_values_in_order():
    assert [s.value for s in Stages] == SEED_STAGES
    assert [s.name for s in Stages] == [v.upper() for v in SEED_STAGES]


def test_stages_are_ordered():
    assert Stages.EXPORT < Stages.COMPILE
    assert Stages.FACTORY < Stages.EXPORT < Stages.POST_EXPORT < Stages.WEIGHT_LOAD
    assert Stages.COMPILE > Stages.CACHE_INIT
    assert Stages.EXPORT <= Stages.EXPORT and Stages.EXPORT >= Stages.EXPORT
    assert not Stages.COMPILE < Stages.FACTORY
    assert sorted(reversed(list(Stages))) == list(Stages)
    assert max(Stages) is Stages.COMPILE and min(Stages) is Stages.FACTORY
    assert Stages("weight_load") is Stages.WEIGHT_LOAD
    with pytest.raises(TypeError):
        Stages.EXPORT < "compile"  # noqa: B015 - comparing with a string is an error, not silently False


# -- TransformConfig / ExportToGMConfig against the seed's JSON schema -------------------------------
BASE_FIELDS = {  # name -> (default, JSON-schema type spec) as in the seed
    "run_per_gm": (True, {"type": "boolean"}),
    "enabled": (True, {"type": "boolean"}),
    "skip_on_error": (False, {"type": "boolean"}),
    "run_graph_cleanup": (True, {"type": "boolean"}),
    "run_shape_prop": (False, {"type": "boolean"}),
    "requires_clean_graph": (True, {"type": "boolean"}),
    "requires_shape_prop": (False, {"type": "boolean"}),
    "debug_visualize_dir": (None, {"anyOf": [{"type": "string"}, {"type": "null"}]}),
    "expect_mem_change": (False, {"type": "boolean"}),
}
EXPORT_FIELDS = {
    "strict": (False, {"type": "boolean"}),
    "clone_state_dict": (False, {"type": "boolean"}),
    "patch_list": (None, {"anyOf": [{"items": {"type": "string"}, "type": "array"}, {"type": "null"}]}),
    "num_moe_experts_for_export": (None, {"anyOf": [{"type": "integer"}, {"type": "null"}]}),
}


def _type_spec(prop: dict) -> dict:
    return {k: v for k, v in prop.items() if k in ("type", "anyOf", "items", "$ref")}


@pytest.mark.parametrize("config_cls, own", [(TransformConfig, {}), (ExportToGMConfig, EXPORT_FIELDS)])
def test_config_schema_matches_seed(config_cls, own):
    schema = config_cls.model_json_schema()
    expected = {**BASE_FIELDS, **own}
    props = schema["properties"]
    assert list(props) == ["stage", *expected]  # same names, same order as the seed
    assert schema["required"] == ["stage"]
    assert schema["additionalProperties"] is True
    assert props["stage"]["$ref"] == "#/$defs/Stages" and "default" not in props["stage"]
    assert schema["$defs"]["Stages"]["enum"] == SEED_STAGES
    assert schema["$defs"]["Stages"]["type"] == "string"
    for name, (default, type_spec) in expected.items():
        assert props[name]["default"] == default, name
        assert _type_spec(props[name]) == type_spec, name
        assert props[name]["description"], name
    if config_cls is ExportToGMConfig:
        assert schema["title"] == "ExportToGMConfig"
        assert schema["description"] == "Configuration for the export to graph module transform."


def test_export_config_adds_exactly_the_seed_fields():
    assert set(ExportToGMConfig.model_fields) - set(TransformConfig.model_fields) == set(EXPORT_FIELDS)
    assert issubclass(ExportToGMConfig, TransformConfig)
    assert ExportToGM.get_config_class() is ExportToGMConfig


def test_transform_config_defaults_and_extra_fields():
    cfg = TransformConfig(stage="export", my_knob=3)
    assert cfg.stage is Stages.EXPORT
    for name, (default, _) in BASE_FIELDS.items():
        assert getattr(cfg, name) == default, name
    assert cfg.model_extra == {"my_knob": 3}
    cfg2 = ExportToGMConfig(stage=Stages.EXPORT, patch_list=["autocast_noop"], num_moe_experts_for_export=2)
    assert (cfg2.strict, cfg2.clone_state_dict, cfg2.patch_list, cfg2.num_moe_experts_for_export) == (
        False, False, ["autocast_noop"], 2)


def test_transform_config_requires_stage_and_checks_types():
    with pytest.raises(ValidationError, match="stage"):
        TransformConfig()
    with pytest.raises(ValidationError, match="stage"):
        TransformConfig(stage="exprt")
    with pytest.raises(ValidationError, match="strict"):
        ExportToGMConfig(stage="export", strict="maybe")
    with pytest.raises(ValidationError, match="num_moe_experts_for_export"):
        ExportToGMConfig(stage="export", num_moe_experts_for_export="two")


# -- TransformRegistry ---------------------------------------------------------------------------
def test_registry_register_and_get():
    assert TransformRegistry.get("test_iface_count_mul") is CountMul
    assert CountMul.get_transform_key() == "test_iface_count_mul"
    assert TransformRegistry.has("test_iface_count_mul")
    assert "test_iface_count_mul" in TransformRegistry.keys()
    assert TransformRegistry.get("export_to_gm") is ExportToGM  # the library registers on import

    # the decorator returns the class; registering the same class again is harmless
    assert TransformRegistry.register("test_iface_count_mul")(CountMul) is CountMul


def test_registry_rejects_a_second_class_under_one_key():
    class Other(BaseTransform):
        pass

    with pytest.raises(ValueError, match="test_iface_count_mul.*already registered"):
        TransformRegistry.register("test_iface_count_mul")(Other)
    assert TransformRegistry.get("test_iface_count_mul") is CountMul


def test_registry_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError, match=r"unknown transform key 'export_to_gmm'.*did you mean 'export_to_gm'"):
        TransformRegistry.get("export_to_gmm")
    with pytest.raises(ConfigError, match="unknown transform key 'zzzz'") as exc:
        TransformRegistry.get("zzzz")
    assert "did you mean" not in str(exc.value)


# -- BaseTransform.__call__: clean-up ------------------------------------------------------------
def test_pre_cleanup_canonicalizes_when_required():
    gm = _traced_with_dead_code()
    assert _count(gm, "mul") == 1
    run_transform(CountMul, gm, "post_export")  # requires_clean_graph defaults to True and there is no history yet
    assert CountMul.seen == [(gm, 0)]
    assert _count(gm, "mul") == 0


def test_pre_cleanup_skipped_when_not_required_or_graph_already_clean():
    gm = _traced_with_dead_code()
    run_transform(CountMul, gm, "post_export", requires_clean_graph=False)
    assert CountMul.seen[-1][1] == 1  # the transform saw the dead node

    # the previous transform reported a clean graph: no canonicalization, the history is trusted
    gm = _traced_with_dead_code()
    run_transform(Noop, gm, "post_export", requires_clean_graph=False, run_graph_cleanup=False)  # reports is_clean=True
    assert transform_history(gm)["test_iface_noop"].info.is_clean
    run_transform(CountMul, gm, "post_export")
    assert CountMul.seen[-1][1] == 1


def test_post_cleanup_runs_graph_cleanup_unless_disabled():
    gm = _traced_with_dead_code()
    run_transform(AddDeadNode, gm, "post_export", requires_clean_graph=False)  # run_graph_cleanup defaults to True
    info = transform_history(gm)["test_iface_add_dead_node"].info
    assert info.is_clean and info.num_matches == 1
    assert _count(gm, "mul") == 0

    gm = _traced_with_dead_code()
    run_transform(AddDeadNode, gm, "post_export", requires_clean_graph=False, run_graph_cleanup=False)
    assert not transform_history(gm)["test_iface_add_dead_node"].info.is_clean
    assert _count(gm, "mul") == 2  # the traced dead node and the added one
    # the next transform that requires a clean graph gets one
    run_transform(CountMul, gm, "post_export")
    assert CountMul.seen[-1][1] == 0


def test_post_shape_prop_fills_node_meta_val():
    gm = _exported()
    run_transform(InsertNeg, gm, "post_export", run_shape_prop=True)
    neg = next(iter(gm.graph.find_nodes(op="call_function", target=aten.neg.default)))
    assert isinstance(neg.meta.get("val"), torch.Tensor)
    assert tuple(neg.meta["val"].shape) == (2, 4) and neg.meta["val"].dtype == torch.float32
    assert transform_history(gm)["test_iface_insert_neg"].info.has_valid_shapes


def test_pre_shape_prop_when_required():
    gm = _exported()
    run_transform(InsertNeg, gm, "post_export")  # run_shape_prop defaults to False: the new node has no val
    neg = next(iter(gm.graph.find_nodes(op="call_function", target=aten.neg.default)))
    assert "val" not in neg.meta
    assert not transform_history(gm)["test_iface_insert_neg"].info.has_valid_shapes

    run_transform(NeedsShapes, gm, "post_export")  # does not require shapes: sees the stale graph
    assert NeedsShapes.saw_all_vals == [False]

    NeedsShapes.saw_all_vals.clear()
    gm = _exported()
    run_transform(InsertNeg, gm, "post_export")
    run_transform(NeedsShapes, gm, "post_export", requires_shape_prop=True)
    assert NeedsShapes.saw_all_vals == [True]
    neg = next(iter(gm.graph.find_nodes(op="call_function", target=aten.neg.default)))
    assert tuple(neg.meta["val"].shape) == (2, 4)
    assert (gm(torch.ones(2, 4))[0] <= 0).all()  # still runs: -relu(...)


# -- per GraphModule or whole model ----------------------------------------------------------------
class _TwoGraphs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.fx.symbolic_trace(lambda x: x * 2)
        self.b = torch.fx.symbolic_trace(lambda x: (x * 3) * 4)

    def forward(self, x):
        return self.b(self.a(x))


def test_run_per_gm_applies_to_every_graphmodule_and_combines_infos():
    mod = _TwoGraphs()
    run_transform(CountMul, mod, "post_export")
    assert [gm for gm, _ in CountMul.seen] == [mod.a, mod.b]
    info = transform_history(mod)["test_iface_count_mul"].info
    assert info.num_matches == 3 and not info.skipped


def test_run_per_gm_false_applies_once_to_the_root_graphmodule():
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    run_transform(CountMul, gm, "post_export", run_per_gm=False)
    assert CountMul.seen == [(gm, 1)]

    with pytest.raises(AutoDeployError, match="test_iface_count_mul.*needs an exported graph"):
        run_transform(CountMul, _TwoGraphs(), "post_export", run_per_gm=False)


def test_a_returned_graphmodule_replaces_the_submodule():
    mod = _TwoGraphs()
    old_a = mod.a
    out = run_transform(ReplaceGM, mod, "post_export")
    assert out is mod and mod.a is not old_a
    torch.testing.assert_close(mod(torch.ones(1)), torch.tensor([-1.0]))  # both graphs are now x - 1
    # root GraphModule replaced: the transform's result is the new module
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    new = run_transform(ReplaceGM, gm, "post_export")
    assert new is not gm and "test_iface_replace_gm" in transform_history(new)


def test_module_without_graphmodule_gets_a_skipped_info():
    mod = nn.Linear(2, 2)
    run_transform(Noop, mod, "post_export")
    record = transform_history(mod)["test_iface_noop"]
    assert Noop.calls == 0 and record.info.skipped


# -- skip_on_error ---------------------------------------------------------------------------------
def test_error_propagates_without_skip_on_error():
    from autodeploy.errors import TransformError

    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with pytest.raises(TransformError, match="transform 'test_iface_raise' .*RuntimeError: pattern exploded") as err:
        run_transform(Raise, gm, "post_export")
    assert isinstance(err.value.__cause__, RuntimeError)  # the original error stays attached
    assert "test_iface_raise" not in transform_history(gm)


def test_skip_on_error_logs_and_records_a_skip(ad_log):
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    out = run_transform(Raise, gm, "post_export", skip_on_error=True)
    assert out is gm
    record = transform_history(gm)["test_iface_raise"]
    assert record.info.skipped and record.info.num_matches == 0
    warnings = _messages(ad_log, logging.WARNING)
    assert any("RuntimeError" in m and "pattern exploded" in m and "skip_on_error" in m for m in warnings)
    torch.testing.assert_close(gm(torch.ones(2)), torch.full((2,), 2.0))  # graph untouched


def test_skip_on_error_after_partial_change_restores_invariants():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    run_transform(Noop, gm, "post_export")  # history: clean graph, valid shapes
    run_transform(HalfDone, gm, "post_export", skip_on_error=True)
    info = transform_history(gm)["test_iface_half_done"].info
    assert info.skipped
    assert _count(gm, "mul") == 0 and info.is_clean  # post-cleanup removed what the failed transform left
    assert not info.has_valid_shapes  # not claimed: the next transform that needs shapes re-propagates

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    run_transform(HalfDone, gm, "post_export", skip_on_error=True, run_graph_cleanup=False)
    assert not transform_history(gm)["test_iface_half_done"].info.is_clean
    run_transform(CountMul, gm, "post_export")  # requires a clean graph: gets one
    assert CountMul.seen[-1][1] == 0


def test_skip_on_error_does_not_hide_user_errors():
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    with pytest.raises(AutoDeployError, match="bad user input"):
        run_transform(Raise, gm, "post_export", skip_on_error=True, user_error=True)


# -- history, disabled, timings ----------------------------------------------------------------------
def test_history_records_every_transform_in_order(ad_log):
    gm = _traced_with_dead_code()
    run_transform(AddDeadNode, gm, "export", requires_clean_graph=False)
    run_transform(CountMul, gm, "post_export")
    run_transform(Noop, gm, "pattern_matcher", enabled=False)
    history = transform_history(gm)
    assert list(history) == ["test_iface_add_dead_node", "test_iface_count_mul", "test_iface_noop"]
    add, count, noop = history.values()
    assert (add.key, add.stage, add.disabled) == ("test_iface_add_dead_node", Stages.EXPORT, False)
    assert add.info == TransformInfo(skipped=False, num_matches=1, is_clean=True, has_valid_shapes=False)
    assert count.stage is Stages.POST_EXPORT and count.info.num_matches == 0
    assert add.time_s > 0 and count.time_s > 0
    assert noop.disabled and noop.info.skipped and Noop.calls == 0
    # the history is not part of the module's state
    assert not any("history" in k for k in gm.state_dict())
    assert transform_history(nn.Linear(1, 1)) == {}

    infos = _messages(ad_log, logging.INFO)
    assert any(m.startswith("[SUMMARY] matches=1 | time: ") and m.endswith(" s") for m in infos)
    assert "[SUMMARY] disabled" in infos


def test_log_lines_carry_the_transform_prefix():
    # the formatter puts "[stage=..., transform=...]" before every line emitted inside a transform
    handler = _ListHandler()
    handler.setFormatter(ad_logger.handlers[0].formatter)
    ad_logger.addHandler(handler)
    try:
        run_transform(Noop, torch.fx.symbolic_trace(lambda x: x + 1), "post_export")
    finally:
        ad_logger.removeHandler(handler)
    lines = [r.formatted for r in handler.records]
    assert any("[stage=post_export, transform=test_iface_noop] [SUMMARY] skipped | time:" in line for line in lines)


def test_transform_info_combines():
    a = TransformInfo(skipped=False, num_matches=2, is_clean=True, has_valid_shapes=True)
    b = TransformInfo(skipped=True, num_matches=0, is_clean=False, has_valid_shapes=True)
    assert a | b == TransformInfo(skipped=False, num_matches=2, is_clean=False, has_valid_shapes=True)
    assert TransformInfo().skipped  # the default record is a skip


# -- expect_mem_change -----------------------------------------------------------------------------
def _fake_memory(monkeypatch, *readings):
    it = iter(readings)
    monkeypatch.setattr(interface, "current_memory_bytes", lambda: next(it))


def test_unexpected_memory_change_warns(monkeypatch, ad_log):
    _fake_memory(monkeypatch, 0, 200 * 1024**2)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    run_transform(Noop, gm, "post_export")
    warnings = _messages(ad_log, logging.WARNING)
    assert len(warnings) == 1 and "200.0 MiB" in warnings[0] and "expect_mem_change=false" in warnings[0]
    assert transform_history(gm)["test_iface_noop"].mem_delta_bytes == 200 * 1024**2


def test_expected_memory_change_does_not_warn(monkeypatch, ad_log):
    _fake_memory(monkeypatch, 0, 200 * 1024**2)
    run_transform(Noop, torch.fx.symbolic_trace(lambda x: x + 1), "post_export", expect_mem_change=True)
    assert _messages(ad_log, logging.WARNING) == []
    assert any("memory change: 200.0 MiB" in m for m in _messages(ad_log, logging.INFO))


def test_small_memory_noise_does_not_warn(monkeypatch, ad_log):
    _fake_memory(monkeypatch, 0, 1024**2)
    run_transform(Noop, torch.fx.symbolic_trace(lambda x: x + 1), "post_export")
    assert _messages(ad_log, logging.WARNING) == []


def test_real_allocation_is_measured(ad_log):
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    run_transform(Alloc, gm, "post_export")
    record = transform_history(gm)["test_iface_alloc"]
    assert record.mem_delta_bytes > 100 * 1024**2
    assert any("expect_mem_change=false" in m for m in _messages(ad_log, logging.WARNING))
    del gm._test_big
