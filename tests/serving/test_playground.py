"""The browser playground at ``/``: its page and files load without the API key (and nothing else
does), and in a real browser (headless Chromium, ``scripts/tools/playground_browser.py``) it asks
for the key, decodes a prompt with two settings side by side through ``/v1/chat/completions`` and
replays each answer's trace: the canvas ends on ``generate``'s text, after as many steps as the
answer's model calls."""

from __future__ import annotations

import os

import httpx
import pytest
from paths import DEFAULT_MODEL
from served import running

from psd_jax import load_model
from psd_jax.model_dir import model_settings
from psd_jax.recommended import NAME, named_settings
from psd_jax.serve import build_app
from scripts.tools.playground_browser import browser_paths, drive, open_browser

KEY = "sk-playground-0123456789"
PROMPT = "Tom has 3 bags of 4 apples. He eats 2. How many are left?"
# CI installs Chromium (.ci/run) and sets this: there the browser test runs, never skips.
REQUIRED = bool(os.environ.get("PSD_JAX_BROWSER_TESTS"))


@pytest.fixture(scope="module")
def lm():
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def defaults():
    return model_settings(DEFAULT_MODEL, {"policy": "threshold"})


def test_the_page_loads_without_the_key_and_the_api_does_not(lm, defaults):
    """With ``--api-key`` the page, its two files and its config (which says a key is needed) are
    open; ``/v1/*`` is not; an unknown file is 404; ``--no-playground`` serves no page."""
    with running(build_app(lm, defaults, name="default", batch_sizes=(1,), api_key=KEY)) as url:
        page = httpx.get(url)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "psd-jax" in page.text
        for name, kind in (("playground.js", "javascript"), ("playground.css", "text/css")):
            got = httpx.get(f"{url}/playground/{name}")
            assert got.status_code == 200 and kind in got.headers["content-type"]
        config = httpx.get(f"{url}/playground/config").json()
        assert config["key_required"] is True and config["model"] == "default"
        recommended = lm.settings(defaults, named_settings(NAME, lm.path))
        assert config["defaults"]["policy"] == "threshold" and config["recommended"]["cache"] == recommended.cache
        assert httpx.get(f"{url}/playground/index.py").status_code == 404
        assert httpx.get(f"{url}/v1/models").status_code == 401
    with running(build_app(lm, defaults, name="default", batch_sizes=(1,), playground=False)) as url:
        assert httpx.get(url).status_code == 404 and httpx.get(f"{url}/playground/config").status_code == 404


@pytest.mark.skipif(browser_paths() is None and not REQUIRED, reason="no chromium and chromedriver on this machine")
def test_the_playground_replays_generates_decodes_in_a_browser(lm, defaults, tmp_path):
    """The page asks for the key and sends it; the two panes (the server's settings, and the
    recommended setting) each end on ``generate``'s text for the chat prompt, no mask left, after
    as many replayed steps as ``generate``'s model calls; a screenshot is taken."""
    app = build_app(lm, defaults, name="default", batch_sizes=(1, 2), api_key=KEY)
    with running(app) as url:
        browser = open_browser()
        try:
            result = drive(browser, url, PROMPT, key=KEY)
            shot = tmp_path / "playground.png"
            browser.save_screenshot(str(shot))
        finally:
            browser.quit()
    assert result["asked_for_key"]
    recommended = lm.settings(defaults, named_settings(NAME, lm.path))
    for pane, settings in zip(result["panes"], (defaults, recommended), strict=True):
        (want,) = lm.generate([PROMPT], settings, chat=True)
        assert pane["done"] == "true", pane
        assert pane["text"] == want.text and pane["answer"] == want.text.strip()
        assert pane["steps"] == pane["step"] == want.nfe and f"NFE {want.nfe}" in pane["stats"]
        assert pane["masks"] == 0
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
