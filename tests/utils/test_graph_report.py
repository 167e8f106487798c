"""The HTML report beside the graph dumps, opened in a real headless browser (Debian's chromium, driven by
Playwright); skipped where none is installed."""

import json
import shutil
from pathlib import Path

import pytest

from autodeploy.cli import main
from autodeploy.utils.graph_diff import diff_html

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# root needs --no-sandbox; nothing may reach the network or start background services
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]


@pytest.fixture(scope="module")
def report(tiny_checkpoint, tmp_path_factory):
    """A ``build --verify --report DIR`` of the tiny llama: (DIR, the transform keys that ran)."""
    out = tmp_path_factory.mktemp("report")
    assert main(["build", "--model", str(tiny_checkpoint("llama")), "--verify", "--set", "max_seq_len=64",
                 "--report", str(out)]) == 0
    return out


def test_report_files(report):
    index = (report / "index.html").read_text()
    dumps = sorted(p.name for p in report.glob("[0-9][0-9][0-9]_*.txt"))
    assert dumps and all(f'href="{name}"' in index for name in dumps)
    diffs = sorted(p.name for p in report.glob("diff_*.html"))
    assert len(diffs) == len(dumps) - 1 and all(f'href="{name}"' in index for name in diffs)
    assert "coverage: attention 2/2" in index and "transforms:" in index  # the coverage line, the config
    assert "<script" not in index and "http" not in index.replace("http-equiv", "")  # nothing fetched


def test_diff_page_shows_the_change(report):
    before, after = sorted(report.glob("[0-9][0-9][0-9]_*match_rmsnorm_pattern.txt"))[0], None
    dumps = sorted(report.glob("[0-9][0-9][0-9]_*.txt"))
    after = dumps[dumps.index(before)]
    html = diff_html(dumps[dumps.index(before) - 1], after)
    assert "torch_rmsnorm" in html and 'class="diff"' in html and "<script" not in html


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no chromium browser at {CHROMIUM} (Debian: apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield context
        context.close()


def test_report_in_a_browser(report, browser):
    page = browser.new_page()
    errors = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("requestfailed", lambda req: errors.append(f"failed request {req.url}"))
    index = (report / "index.html").as_uri()
    page.goto(index)
    listed = page.locator("#transforms tbody tr td:nth-child(3)").all_inner_texts()
    rows = json.loads((report / "index.json").read_text())
    assert listed == [r["transform"] for r in rows]  # every transform, the disabled ones too
    dumped = [p.name.split("_", 1)[1].removesuffix(".txt") for p in sorted(report.glob("[0-9][0-9][0-9]_*.txt"))]
    assert [f"{r['stage']}_{r['transform']}" for r in rows if r["file"]] == dumped
    assert "disabled" in page.locator("#tquantize_weights").inner_text()
    assert page.locator("#transforms .fail").count() == 0 and page.locator("#transforms .pass").count() == len(dumped)

    page.click("#tmatch_rope_pattern a:text('dump')")
    assert page.url.endswith("_pattern_matcher_match_rope_pattern.txt")
    assert "# Transform: match_rope_pattern" in page.locator("body").inner_text()
    page.goto(index)
    page.click("#tmatch_rope_pattern a:text('diff')")
    assert page.url.endswith(".html") and "match_rope_pattern" in page.title()
    assert page.locator("table.diff").count() == 1 and "torch_rope_with_explicit_cos_sin" in page.content()
    page.click("text=back to the report")
    assert page.url == index
    assert not errors
