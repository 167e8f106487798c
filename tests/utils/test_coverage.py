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
