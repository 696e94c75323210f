"""The playground page at GET /: served from the package, self-contained, and working in a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tessera.config import ASSETS_DIR, ServerArgs
from tessera.entrypoints.http_server import create_app
from tessera.entrypoints.playground import STATIC_DIR

EXPECTED_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
SVG_NAMESPACE = 'xmlns="http://www.w3.org/2000/svg"'  # a name, never fetched


@pytest.fixture(scope="module")
def client():
    # No `with`: the lifespan (which loads the model) does not run; the page needs no model.
    return TestClient(create_app(ServerArgs(model_path="demo-vl", api_key="sesame")))


def test_page_and_assets_are_served_with_their_types_and_without_the_key(client) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert {"/playground/playground.js", "/playground/playground.css", "/playground/icon.svg"} <= set(refs)
    for ref in refs:
        r = client.get(ref)
        assert r.status_code == 200, ref
        assert r.headers["content-type"].split(";")[0] == EXPECTED_TYPES[Path(ref).suffix], ref
        assert r.content == (STATIC_DIR / Path(ref).name).read_bytes()
    assert client.get("/playground/config.json").json() == {"api_key_required": True}
    # The API itself still wants the key.
    assert client.get("/model_info").status_code == 401
    assert client.get("/model_info", headers={"Authorization": "Bearer sesame"}).status_code == 503  # not loaded


def test_only_the_shipped_files_are_served(client) -> None:
    for path in ("/playground/nothing.js", "/playground/__init__.py", "/playground/..%2F__init__.py",
                 "/playground/..%2Fhttp_server.py"):
        assert client.get(path).status_code == 404, path


def test_page_references_nothing_outside_the_server(client) -> None:
    """Works offline: no CDN, no font service, no absolute or protocol-relative URL in any shipped file."""
    files = sorted(STATIC_DIR.iterdir())
    assert {p.suffix for p in files} == set(EXPECTED_TYPES)
    for path in files:
        text = path.read_text().replace(SVG_NAMESPACE, "")
        assert not re.search(r"https?://", text), path.name
        assert not re.search(r"""["'(=]\s*//""", text), path.name  # protocol-relative: //cdn...
        assert "@import" not in text, path.name
    # Every path the script calls is a route of this server.
    js = (STATIC_DIR / "playground.js").read_text()
    called = set(re.findall(r"""(?:fetch|getJSON)\("(/[^"]*)\"""", js))
    assert called == {"/health", "/model_info", "/playground/config.json", "/v1/chat/completions"}
    for path in called:  # (an unknown route is a 404; these answer, or refuse the method or say not ready)
        assert client.get(path).status_code != 404, path


# ---- end to end in headless Chromium ------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
EXAMPLE_IMAGE = ASSETS_DIR / "examples" / "scene.png"


@pytest.fixture
def browser(monkeypatch):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs Chromium and its driver (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install '.[test]')")
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must never download a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1000,760", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.mark.slow
def test_chat_with_an_image_in_headless_chromium(browser, vl_server) -> None:
    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server = vl_server  # the session's demo-vl: caches flushed, so the first answer starts from nothing cached
    assert httpx.post(f"{server.base_url}/flush_cache", timeout=30).status_code == 200
    wait = WebDriverWait(browser, 60)
    browser.get(server.base_url + "/")
    wait.until(lambda d: d.find_element(By.ID, "status").get_attribute("data-state") == "ready")
    assert browser.find_element(By.ID, "model-name").text == "demo-vl"

    browser.find_element(By.ID, "file-input").send_keys(str(EXAMPLE_IMAGE))
    thumb = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#attachments img.thumb"))[0]
    assert thumb.get_attribute("src").startswith("data:image/png;base64,")
    browser.execute_script("const t = document.getElementById('temperature');"
                           "t.value = '0'; t.dispatchEvent(new Event('input'));")
    browser.find_element(By.ID, "prompt").send_keys("Describe the image.")
    browser.find_element(By.ID, "send").click()

    answer = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]"))[0]
    assert answer.find_element(By.CLASS_NAME, "text").text == "a red circle, a blue square and a green triangle"
    assert int(answer.get_attribute("data-deltas")) > 1  # it came in pieces: streamed
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · first token [\d.]+ s · 0 of \d+ prompt tokens cached", stats)
    assert browser.find_elements(By.CSS_SELECTOR, ".message.user img.thumb")
    assert not browser.find_element(By.ID, "error").is_displayed()
    if os.environ.get("TESSERA_PLAYGROUND_SCREENSHOT"):  # how docs/playground.png is made
        browser.save_screenshot(os.environ["TESSERA_PLAYGROUND_SCREENSHOT"])
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == []

    # A schema the server refuses: its message is shown and the question comes back to the composer;
    # with a valid schema the same question gets an answer that parses.
    schema_box = browser.find_element(By.ID, "json-schema")
    schema_box.send_keys('{"type": "nonsense"}')
    browser.find_element(By.ID, "prompt").send_keys("How many shapes are there?\n")
    wait.until(lambda d: d.find_element(By.ID, "error").is_displayed())
    assert browser.find_element(By.ID, "error-text").text == "response_format: Invalid type: nonsense"
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "How many shapes are there?"
    assert len(browser.find_elements(By.CSS_SELECTOR, ".message")) == 2
    schema_box.clear()
    schema_box.send_keys(json.dumps({"type": "object", "properties": {"count": {"type": "integer"}},
                                     "required": ["count"]}))
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".message.assistant[data-done]")) == 2)
    assert not browser.find_element(By.ID, "error").is_displayed()
    second = browser.find_elements(By.CSS_SELECTOR, ".message.assistant")[1]
    assert isinstance(json.loads(second.find_element(By.CLASS_NAME, "text").text)["count"], int)
    # The conversation so far, image included, came from the prefix cache.
    assert re.search(r"· [1-9]\d* of \d+ prompt tokens cached", second.find_element(By.CLASS_NAME, "stats").text)

    browser.find_element(By.ID, "clear").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".message") == []
    assert browser.find_element(By.ID, "empty-hint").is_displayed()
