"""--verify: every transform's graph against HF transformers; transforms registered here perturb one weight
by 1.001 (in the graph before weight_load, in the loaded tensor after it) and must be named."""

import pytest
import torch
import yaml

import autodeploy
from autodeploy.api import build_optimizer, verify_options
from autodeploy.cli import EXIT_VERIFY_FAILED, main
from autodeploy.config import load_config
from autodeploy.errors import ConfigError
from autodeploy.transform import BaseTransform, TransformInfo, TransformRegistry
from autodeploy.verify.tolerance import Tolerance, compare, default_tolerance
from tiny_models import ARCHS

SMALL = {"max_seq_len": 64, "max_batch_size": 4}
WEIGHT = "lm_head.weight"


@TransformRegistry.register("test_scale_weight_in_graph")
class ScaleWeightInGraph(BaseTransform):
    """The graph multiplies ``lm_head.weight`` by 1.001 where it reads it (its tensor may still be meta)."""

    def _apply(self, gm, ctx):
        (node,) = [n for n in gm.graph.find_nodes(op="get_attr") if n.target == WEIGHT]
        with gm.graph.inserting_after(node):
            scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.001))
        node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        return gm, TransformInfo.changed(1)


@TransformRegistry.register("test_scale_loaded_weight")
class ScaleLoadedWeight(BaseTransform):
    """``lm_head.weight`` itself scaled by 1.001 (after weight_load; in the panels pack_f32_weights made of it, where
    that ran)."""

    def _apply(self, gm, ctx):
        names = dict(gm.named_parameters())
        names.get(WEIGHT, names.get(WEIGHT.replace(".", "_") + "_panels")).data.mul_(1.001)
        return gm, TransformInfo.changed(1)


def _optimizer(path, tmp_path, extra: dict | None = None, **overrides):
    yaml_extra = []
    if extra:
        yaml_extra = [tmp_path / "extra.yaml"]
        yaml_extra[0].write_text(yaml.safe_dump({"transforms": extra}))
    config = load_config(yaml_extra, {**SMALL, **overrides}, base={"model": str(path)})
    return build_optimizer(config, verify=verify_options(True, None, None))[0]


def test_clean_pipeline_passes_every_transform(tiny_checkpoint, tmp_path):
    optimizer = _optimizer(tiny_checkpoint("llama"), tmp_path)
    optimizer()
    rows = optimizer.verifier.rows
    stages = {r.stage for r in rows}
    assert {"export", "pattern_matcher", "weight_load", "post_load_fusion", "cache_init"} <= stages
    assert all(r.passed and r.max_abs_error < 1e-4 and r.against == "hf" for r in rows)
    assert len(rows) == len([t for t in optimizer.transforms if t.config.enabled and t.config.stage.value != "factory"])
    table = optimizer.verifier.table()
    assert "insert_cached_attention" in table and table.splitlines()[-1].startswith("verify: all ")


@pytest.mark.parametrize("key, stage", [
    ("test_scale_weight_in_graph", "pattern_matcher"),   # weights still on the meta device
    ("test_scale_loaded_weight", "post_load_fusion"),    # the uncached graph with its own weights
    pytest.param("test_scale_loaded_weight", "cache_init",  # the cached graph: prefill + decode steps
                 marks=pytest.mark.slow),
])
def test_a_perturbing_transform_is_named(tiny_checkpoint, tmp_path, key, stage):
    with pytest.raises(autodeploy.VerificationError) as caught:
        autodeploy.optimize(tiny_checkpoint("llama"), verify=True, yaml_extra=_yaml(tmp_path, key, stage),
                            overrides=SMALL)
    err = caught.value
    assert isinstance(err, autodeploy.AutoDeployError)
    assert (err.transform, err.stage) == (key, stage)
    assert 1e-4 < err.max_abs_error < 1e-2
    assert f"transform {key!r} (stage {stage})" in str(err) and "exceeds the tolerance (atol 0.0001" in str(err)
    last_row = err.table.splitlines()[-2]
    assert key in last_row and "FAIL" in last_row


def _yaml(tmp_path, key, stage):
    path = tmp_path / f"{key}.yaml"
    path.write_text(yaml.safe_dump({"transforms": {key: {"stage": stage}}}))
    return path


def test_cli_exit_code_names_transform_and_dumps(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    dumps = tmp_path / "dumps"
    monkeypatch.setenv("AD_DUMP_GRAPHS_DIR", str(dumps))
    args = ["build", "--model", str(tiny_checkpoint("llama")), "--verify", "--set", "max_seq_len=64",
            "--yaml-extra", str(_yaml(tmp_path, "test_scale_weight_in_graph", "post_export"))]
    assert main(args) == EXIT_VERIFY_FAILED
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if ln.startswith("autodeploy: verification failed")][0]
    assert "'test_scale_weight_in_graph' (stage post_export)" in line
    before, after = sorted(dumps.glob("00*_post_export_*.txt"))[-2:]
    assert after.name.endswith("_test_scale_weight_in_graph.txt")
    assert f"before it: {before}" in line and f"after it: {after}" in line
    assert f"autodeploy graph diff {dumps} {before.name[:3]} {after.name[:3]}" in line
    # a looser tolerance lets the same pipeline through
    monkeypatch.delenv("AD_DUMP_GRAPHS_DIR")
    assert main(args + ["--verify-atol", "0.1", "--until", "post_export"]) == 0


@pytest.mark.slow
def test_int8_weights_are_checked_against_the_graph_before_them(tiny_checkpoint, tmp_path):
    optimizer = _optimizer(tiny_checkpoint("llama"), tmp_path, **{"transforms.quantize_weights.enabled": True})
    optimizer()
    rows = {r.key: r for r in optimizer.verifier.rows}
    quant = rows["quantize_weights"]
    assert quant.against == "load_weights" and quant.passed and quant.max_abs_error > 1e-4
    assert quant.tolerance.std_fraction > 0
    later = [r for r in optimizer.verifier.rows if r.number > quant.number]
    assert later and all(r.against == "quantize_weights" and r.passed for r in later)
    assert optimizer.verifier.tolerance.atol == pytest.approx(1e-4 + 0.1 * quant.max_abs_error)


def test_tolerances_and_options():
    assert default_tolerance(torch.float32) == Tolerance(atol=1e-4)
    assert default_tolerance(torch.bfloat16).rtol > 0
    assert default_tolerance(torch.float32, atol=1e-3, rtol=1e-2) == Tolerance(atol=1e-3, rtol=1e-2)
    ref = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    ok = compare(ref + 5e-5, ref, Tolerance(atol=1e-4))
    assert ok.passed and abs(ok.max_abs_error - 5e-5) < 1e-9 and abs(ok.max_rel_error - 5e-5 / 4) < 1e-9
    assert not compare(ref * 1.001, ref, Tolerance(atol=1e-4)).passed
    assert compare(ref * 1.001, ref, Tolerance(atol=0, rtol=2e-3)).passed
    assert not compare(ref * float("nan"), ref, Tolerance(atol=1.0)).passed
    with pytest.raises(ConfigError, match="verify_atol must be a number >= 0"):
        verify_options(True, -1.0, None)
    assert verify_options(False, None, None) is None


def test_verify_needs_a_checkpoint():
    with pytest.raises(ConfigError, match="--verify needs a checkpoint"):
        build_optimizer(load_config(), verify=verify_options(True, None, None))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_clean_pipeline_passes_on_every_architecture(tiny_checkpoint, tmp_path, arch):
    optimizer = _optimizer(tiny_checkpoint(arch), tmp_path)
    optimizer()
    failed = [(r.key, r.max_abs_error, r.note) for r in optimizer.verifier.rows if not r.passed]
    assert not failed and optimizer.verifier.rows
