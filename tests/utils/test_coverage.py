"""The coverage line: canonical ops against the model's layers, and what is left unmatched."""

import autodeploy
from autodeploy.utils.coverage import measure_coverage


def test_fully_matched_moe_model(tiny_checkpoint):
    gm = autodeploy.optimize(tiny_checkpoint("mixtral"), until="pattern_matcher")
    coverage = measure_coverage(gm, num_layers=2)
    assert coverage.line() == "coverage: attention 2/2 | rope 2/2 | rmsnorm 5 | moe 2/2"
    assert coverage.complete


def test_unmatched_blocks_are_reported(tiny_checkpoint):
    overrides = {
        "transforms.match_rmsnorm_pattern.enabled": False,
        "transforms.match_moe_pattern.enabled": False,
        "transforms.match_rope_pattern.enabled": False,
    }
    gm = autodeploy.optimize(tiny_checkpoint("mixtral"), until="pattern_matcher", overrides=overrides)
    coverage = measure_coverage(gm, num_layers=2)
    assert coverage.line() == "coverage: attention 2/2 | rope 0/2 | rmsnorm 0 (5 unmatched) | moe 0/2"
    assert not coverage.complete


def test_coverage_is_logged_after_the_stage(tiny_checkpoint, capfd):
    from autodeploy.utils.logger import refresh_level

    refresh_level()
    autodeploy.optimize(tiny_checkpoint("llama"), until="pattern_matcher",
                        overrides={"transforms.match_rope_pattern.enabled": False})
    err = capfd.readouterr().err
    assert "WARNING coverage: attention 2/2 | rope 0/2 | rmsnorm 5 | moe 0/0  <- partly matched" in err


def test_layernorms_are_counted_and_unmatched_ones_reported():
    """A LayerNorm model's line says how many LayerNorms are canonical; aten.layer_norm left over is unmatched."""
    import torch

    from helpers import export_gm, run_transform

    class TwoNorms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16, bias=False)

        def forward(self, x):
            return (self.b(self.a(x)),)

    gm = export_gm(TwoNorms(), torch.randn(2, 16))
    before = measure_coverage(gm, num_layers=None)
    assert before.line() == "coverage: attention 0 | rope n/a | rmsnorm 0 | layernorm 0 (2 unmatched) | moe 0/0"
    assert not before.complete
    gm = run_transform("match_layernorm_pattern", gm, "pattern_matcher")
    after = measure_coverage(gm, num_layers=None)
    assert after.line() == "coverage: attention 0 | rope n/a | rmsnorm 0 | layernorm 2 | moe 0/0" and after.complete


def test_complex_frequency_rope_counts_as_rope():
    """A graph whose rotary embedding is complex (``torch.polar``, no sin/cos: DeepSeek-V2, Llama 4) uses rope."""
    import torch

    from helpers import export_gm

    class ComplexFreqs(torch.nn.Module):
        def forward(self, x, angles):
            pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
            return (torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2),)

    gm = export_gm(ComplexFreqs(), torch.randn(3, 8), torch.randn(3, 4))
    coverage = measure_coverage(gm, num_layers=1)
    assert coverage.line() == "coverage: attention 0/1 | rope 0/1 | rmsnorm 0 | moe 0/0"


def test_state_space_scans_count_as_the_sequence_mixer_of_their_layers():
    """A hybrid's layers mix with attention or a state-space scan; RoPE is counted against the attention layers."""
    from autodeploy.utils.coverage import Coverage

    hybrid = dict(layers=2, attention=1, attention_unmatched=0, rope=1, uses_rope=True, rmsnorm=6, norm_unmatched=0,
                  moe=0, moe_blocks=0)
    coverage = Coverage(**hybrid, ssm=1)
    assert coverage.line() == "coverage: attention 1/2 | ssm 1/2 | rope 1/1 | rmsnorm 6 | moe 0/0"
    assert coverage.complete
    assert not Coverage(**hybrid).complete  # without the scan, one layer has no canonical mixer
    assert not Coverage(**{**hybrid, "rope": 0}, ssm=1).complete


def test_short_convolutions_count_as_mixers_once_per_layer():
    """LFM2's conv layers mix with a causal conv; a Mamba layer's conv before its scan is not a second mixer."""
    from autodeploy.utils.coverage import Coverage

    base = dict(layers=2, attention=1, attention_unmatched=0, rope=1, uses_rope=True, rmsnorm=6, norm_unmatched=0,
                moe=0, moe_blocks=0)
    lfm2 = Coverage(**base, conv=1)
    assert lfm2.line() == "coverage: attention 1/2 | conv 1/2 | rope 1/1 | rmsnorm 6 | moe 0/0" and lfm2.complete
    mamba = Coverage(**{**base, "attention": 0, "rope": 0, "uses_rope": False}, ssm=2, conv=2)
    assert mamba.line() == "coverage: attention 0/2 | ssm 2/2 | rope n/a | rmsnorm 6 | moe 0/0" and mamba.complete
    assert not Coverage(**{**base, "attention": 0, "rope": 0, "uses_rope": False}, ssm=1, conv=1).complete


def test_nope_layers_are_not_expected_to_have_rope(tmp_path):
    """Beam's full-attention layers are NoPE (rope_parameters None for that layer type): one rope of two
    layers is complete; without the config's count the same graph is incomplete."""
    from types import SimpleNamespace

    import transformers

    from autodeploy.coverage import make_checkpoint
    from autodeploy.utils.coverage import rope_layer_count

    path = make_checkpoint("beam", tmp_path / "beam")
    text_config = transformers.AutoConfig.from_pretrained(path).get_text_config()
    assert rope_layer_count(text_config) == 1
    gm = autodeploy.optimize(path, until="pattern_matcher")
    with_nope = measure_coverage(gm, num_layers=2, rope_layers=1)
    assert "rope 1/1" in with_nope.line() and with_nope.complete
    assert not measure_coverage(gm, num_layers=2).complete
    llama4_like = SimpleNamespace(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    assert rope_layer_count(llama4_like) == 3
    assert rope_layer_count(SimpleNamespace(num_hidden_layers=2)) is None
