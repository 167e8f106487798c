"""The model registry (`autodeploy models`) and `--use-registry` on build/run/bench/serve."""

import json

import pytest

from autodeploy import cli
from autodeploy.config import load_config
from autodeploy.errors import ConfigError
from autodeploy.models import registry
from autodeploy.models.registry import ModelEntry, parse_registry
from tiny_models import ARCH_CONFIGS

EXPERTS = "transforms.export_to_gm.num_moe_experts_for_export"


def test_models_json_lists_at_least_25(capsys):
    assert cli.main(["models", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)
    assert len(models) >= 25
    for m in models:
        assert set(m) >= {"id", "architecture", "extras", "verified"}
    assert any(m["extras"].get(EXPERTS) for m in models)  # the MoE models' export setting


def test_models_table(capsys):
    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert "meta-llama/Llama-3.1-8B-Instruct" in out and "models," in out


def test_verified_is_what_the_suite_checks_end_to_end():
    """Verified is computed from the architectures the suite checks against HF, nothing else: the tiny
    checkpoints of tests/tiny_models.py and the families test_families.py runs through every coverage column."""
    from test_families import ALL, FAMILIES

    assert registry.SUITE_ARCHITECTURES == set(ARCH_CONFIGS)
    assert registry.FAMILY_ARCHITECTURES == {arch for arch, columns in FAMILIES.items() if columns == ALL}
    checked = set(ARCH_CONFIGS) | registry.FAMILY_ARCHITECTURES
    for entry in registry.list_models():
        assert entry.verified == (entry.architecture in checked), entry.id
    assert not ModelEntry("x/y", "gemma2").verified
    with pytest.raises(ConfigError, match="verified"):  # the data file cannot claim it
        parse_registry("models:\n  - {id: x/y, architecture: gemma2, verified: true}\n")


def test_every_extra_is_a_config_key():
    for entry in registry.list_models():
        load_config(overrides=dict(entry.extras))  # raises on an unknown key


def _registered(monkeypatch, *entries):
    monkeypatch.setattr(registry, "_packaged", lambda: tuple(entries))


@pytest.mark.parametrize("command", ["build", "run", "bench", "serve"])
def test_use_registry_applies_extras_before_the_users(monkeypatch, tmp_path, command):
    _registered(monkeypatch, ModelEntry("acme/tiny-moe", "mixtral", {EXPERTS: 2, "max_seq_len": 77}))
    user_yaml = tmp_path / "user.yaml"
    user_yaml.write_text("max_seq_len: 99\n")
    args = cli._build_parser().parse_args([command, "--model", "acme/tiny-moe", "--use-registry",
                                           "--yaml-extra", str(user_yaml), "--set", f"{EXPERTS}=3"])
    cli.apply_registry(args)
    assert args.yaml_extra[-1] == str(user_yaml)
    assert load_config(args.yaml_extra).transforms["export_to_gm"][EXPERTS.rsplit(".")[-1]] == 2
    config = load_config(args.yaml_extra, args.overrides)
    assert config.max_seq_len == 99  # the user's YAML over the registry's
    assert config.transforms["export_to_gm"]["num_moe_experts_for_export"] == 3  # --set last


def test_without_use_registry_nothing_applies(monkeypatch):
    _registered(monkeypatch, ModelEntry("acme/tiny-moe", "mixtral", {EXPERTS: 2}))
    args = cli._build_parser().parse_args(["build", "--model", "acme/tiny-moe"])
    cli.apply_registry(args)
    assert args.yaml_extra == []


def test_checkpoint_folder_matches_by_name_or_path(monkeypatch, tmp_path):
    _registered(monkeypatch, ModelEntry("acme/tiny-moe", "mixtral", {EXPERTS: 2}))
    (tmp_path / "config.json").write_text(json.dumps({"_name_or_path": "acme/tiny-moe", "model_type": "mixtral"}))
    assert registry.find_model(str(tmp_path)).id == "acme/tiny-moe"


def test_unknown_id_is_an_error_with_close_matches(capsys):
    rc = cli.main(["build", "--model", "Qwen/Qwen3-30b", "--use-registry"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "not in the model registry" in err and "Qwen/Qwen3-30B-A3B" in err
