"""Drive the server's browser playground in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, through Selenium): open the page, give the API key if asked, write a prompt,
decode with both panes and read back what each canvas shows. The test of the playground
(tests/serving/test_playground.py) and the screenshots in docs/ use it.

    python -m scripts.tools.playground_browser [--prompt TEXT] [--out docs/playground.png]

starts a server on the shipped model (default settings: the threshold rule; the second pane: the
recommended setting), drives the page and saves a screenshot of the finished replay.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"
WAIT_S = 120


def browser_paths() -> tuple[str, str] | None:
    """(the Chromium binary, its driver), or None where either is missing."""
    binary = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    driver = shutil.which(DRIVER)
    return (binary, driver) if binary and driver else None


def open_browser(width: int = 1400, height: int = 900):
    """Headless Chromium under Selenium, with the driver and binary on this machine (Selenium's own
    download of a driver is never asked for: nothing outside the machine may be reachable)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    paths = browser_paths()
    if paths is None:
        raise RuntimeError(f"no Chromium ({', '.join(CHROMIUM)}) and {DRIVER} on PATH")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    return webdriver.Chrome(service=Service(executable_path=paths[1]), options=options)


def drive(browser, url: str, prompt: str, key: str | None = None, compare: bool = True) -> dict:
    """Open the playground at ``url`` (replays without pauses), decode ``prompt`` and return, per
    pane shown: its canvas's final text, the replay's step count, the frame it ended on, the stats
    line and the answer; and whether the page asked for a key."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{url}/?fast")
    wait = WebDriverWait(browser, WAIT_S)
    wait.until(lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    asked = browser.find_element(By.ID, "keybox").is_displayed()
    if key is not None:
        browser.find_element(By.ID, "key").send_keys(key)
    box = browser.find_element(By.ID, "compare")
    if box.is_selected() != compare:
        box.click()
    browser.find_element(By.ID, "prompt").send_keys(prompt)
    browser.find_element(By.ID, "run").click()
    panes = [p for p in browser.find_elements(By.CLASS_NAME, "pane") if p.is_displayed()]
    done = lambda b: all(
        p.find_element(By.CLASS_NAME, "canvas").get_attribute("data-done") in ("true", "error") for p in panes
    )  # noqa: E731
    wait.until(done)
    out = {"asked_for_key": asked, "panes": []}
    for pane in panes:
        canvas = pane.find_element(By.CLASS_NAME, "canvas")
        out["panes"].append(
            {
                "done": canvas.get_attribute("data-done"),
                "text": canvas.get_attribute("data-text"),
                "steps": int(canvas.get_attribute("data-steps") or 0),
                "step": int(canvas.get_attribute("data-step") or 0),
                "stats": pane.find_element(By.CLASS_NAME, "stats").text,
                "answer": pane.find_element(By.CLASS_NAME, "answer").text,
                "masks": canvas.text.count("\u2591"),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", default="Tom has 3 bags of 4 apples. He eats 2. How many are left?")
    p.add_argument("--out", type=Path, default=Path("docs/playground.png"))
    args = p.parse_args(argv)

    from psd_jax import load_model
    from psd_jax.model_dir import model_settings
    from psd_jax.serve import build_app
    from psd_jax.serve.server import serving_in_thread

    lm = load_model()
    app = build_app(lm, model_settings(lm.path, {"policy": "threshold"}), name="default", batch_sizes=(1, 2))
    with serving_in_thread(app) as url:
        browser = open_browser()
        try:
            result = drive(browser, url, args.prompt)
            browser.save_screenshot(str(args.out))
        finally:
            browser.quit()
    for pane in result["panes"]:
        print(pane["stats"], "|", pane["text"].replace("\n", " / "))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
