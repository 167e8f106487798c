"""python -m autodeploy.coverage: the architecture list, the table, and a representative subset end to end."""

import json
import subprocess
import sys

import pytest

from autodeploy import coverage
from autodeploy.coverage import Result, decoder_only_architectures, markdown
from autodeploy.models.registry import list_models


def test_decoder_only_architectures():
    archs = decoder_only_architectures()
    assert {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "gpt2", "mamba"} <= set(archs)
    assert not {"bert", "roberta", "bart", "whisper", "gemma3", "llama4", "mllama"} & set(archs)  # enc / multimodal
    assert len(archs) >= 100


def test_registry_architectures_are_in_the_coverage_table():
    archs = set(decoder_only_architectures())
    assert {m.architecture for m in list_models()} <= archs


def test_markdown_totals():
    results = [Result("llama", True, True, True, True),
               Result("mamba", False, reason="export: ExportError: x|y"),
               Result("bloom", True, False, False, reason="logits: RuntimeError: z")]
    text = markdown(results)
    assert "export 2/3, canonical 1/3, logits 1/3, generate 1/3" in text
    assert "| llama | yes | yes | yes | yes |  |" in text
    assert "| mamba | **no** | - | - | - | export: ExportError: x\\|y |" in text


def test_only_rejects_unknown(capsys):
    assert coverage.main(["--only", "bert"]) == 2
    assert "bert" in capsys.readouterr().err


@pytest.mark.slow
def test_subset_end_to_end(tmp_path):
    """llama passes every column; rwkv (a recurrent model without canonical ops yet) fails at export with a stated
    reason."""
    out = tmp_path / "models.md"
    proc = subprocess.run([sys.executable, "-m", "autodeploy.coverage", "--only", "llama,rwkv", "--timeout", "120",
                           "--write", str(out), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["arch"]: r for r in json.loads(proc.stdout)}
    assert [rows["llama"][s] for s in coverage.STEPS] == [True, True, True, True]
    assert rows["rwkv"]["export"] is False and rows["rwkv"]["reason"].startswith("export: ")
    assert "export 1/2" in out.read_text()


def test_overrides_fit_the_config():
    from transformers import CONFIG_MAPPING

    assert "head_dim" not in coverage.tiny_config_kwargs("falcon")  # a property without a setter there
    for arch in coverage.OVERRIDES:
        CONFIG_MAPPING[arch](**coverage.tiny_config_kwargs(arch))
