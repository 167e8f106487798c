"""The autodeploy logger: transform prefix, level from AUTO_DEPLOY_LOG_LEVEL, rank-0-only INFO."""

import logging

import pytest

from autodeploy.utils.logger import ad_logger, refresh_level, transform_logging


@pytest.fixture(autouse=True)
def _restore_level(monkeypatch):
    yield
    monkeypatch.undo()  # the environment first, then the level it implies
    refresh_level()


def test_lines_inside_a_transform_carry_the_prefix(capfd):
    refresh_level()
    with transform_logging("export", "export_to_gm"):
        ad_logger.info("[SUMMARY] matches=1 | time: 0.1 s")
    ad_logger.info("after")
    err = capfd.readouterr().err.splitlines()
    assert err[0].endswith("INFO [stage=export, transform=export_to_gm] [SUMMARY] matches=1 | time: 0.1 s")
    assert err[1].endswith("INFO after") and "stage=" not in err[1]


def test_level_from_environment(monkeypatch, capfd):
    monkeypatch.setenv("AUTO_DEPLOY_LOG_LEVEL", "warning")
    refresh_level()
    assert ad_logger.level == logging.WARNING
    ad_logger.info("hidden")
    ad_logger.warning("shown")
    err = capfd.readouterr().err
    assert "hidden" not in err and "shown" in err


def test_default_level_is_info(monkeypatch):
    monkeypatch.delenv("AUTO_DEPLOY_LOG_LEVEL", raising=False)
    refresh_level()
    assert ad_logger.level == logging.INFO


def test_only_rank_zero_logs_info(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("AUTO_DEPLOY_LOG_LEVEL", "DEBUG")
    refresh_level()
    assert ad_logger.level == logging.WARNING
