"""The web page in a real browser: Debian's Chromium, driven by Playwright, against a served
embedded model that asks for an API key. The page must take the key once (kept for the tab's
session), render the very text the API answers, mark drafted tokens with their strategy, plot
one point per round and log no console error. Also: the page is public while its data routes
ask for a key, and `--no-web-ui` turns it off."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.background import serving
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import QUIET, post, serving_ready, speculating

KEY = "page-key"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
TEXT = "The ferry to the island ran twice a day, at nine and at three."
PROMPT = f"Repeat this sentence word for word:\n\n{TEXT}"
MAX_TOKENS = 32


def chromium() -> str:
    """Debian's Chromium: the test fails (not skips) without it, naming the target that
    installs it (Playwright's own browsers come from a CDN, which the tests never use)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Chromium is not installed: run `make test-tools` (apt-get install chromium)")
    return path


@pytest.fixture(scope="module")
def page_server(embedded) -> Iterator[str]:
    app = create_app(Settings(spec_k=8, spec_w=6, api_keys=KEY, **QUIET), loader=lambda _: embedded)
    with serving_ready(app) as base:
        speculating(app)  # a cost profile under which auto mode drafts, on any machine
        yield base


@pytest.mark.slow
def test_the_page_shows_where_each_token_came_from(page_server: str, tmp_path: Path) -> None:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: run `make setup` (the test extras)")
    executable = chromium()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 390, "height": 844})  # a phone's
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(page_server + "/")
        page.wait_for_selector("#server-state:has-text('API key')")  # the data routes ask
        page.fill("#set-key", KEY)
        page.press("#set-key", "Tab")  # entered once: kept for the tab's session
        # before the key, the browser itself logs the status route's 401 (how the page learns
        # that the server asks for one): that, and nothing else, until the key is in
        assert errors and all("status of 401" in error for error in errors)
        errors.clear()
        page.reload()
        assert page.input_value("#set-key") == KEY
        # the status route answered: the strategies are in the settings
        page.wait_for_selector("#set-strategy option[value=context]", state="attached")
        page.select_option("#set-mode", "auto")
        page.select_option("#set-strategy", "context")
        page.fill("#set-temperature", "0")
        page.fill("#set-max-tokens", str(MAX_TOKENS))
        page.fill("#chat-input", PROMPT)
        page.press("#chat-input", "Enter")  # Enter sends
        page.wait_for_selector(".msg.assistant[data-done=true]", timeout=120_000)
        answer = page.locator(".msg.assistant .tokens")
        rendered = answer.text_content()
        sources = answer.locator(".tok").evaluate_all("spans => spans.map(s => s.dataset.source)")
        rounds = answer.locator(".tok").evaluate_all("spans => spans.map(s => s.dataset.round)")
        assert "context" in sources and "model" in sources
        assert answer.locator(".tok.drafted.src-context").count() == sources.count("context")
        points = page.locator(".msg.assistant svg.strip circle.pt-tpp").count()
        assert points == len(set(rounds)) == int(rounds[-1]) + 1
        answer.locator(".tok.drafted").first.focus()  # keyboard: a token's round
        assert "drafted by context" in page.text_content("#round-info")
        assert page.locator("#heatmap rect.heat").count() == 16 * 8
        page.locator(".msg.assistant").screenshot(path=str(tmp_path / "answer.png"))
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(tmp_path / "answer.png", ARTIFACTS / "web-page-answer.png")
        page.screenshot(path=str(ARTIFACTS / "web-page.png"), full_page=True)
        browser.close()
    assert errors == []
    # the API's greedy text for the same request (asked after the page's: the page's request is
    # the fresh server's first, whose first round the controller certainly drafts from context)
    reference = post(
        page_server,
        "chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "speculation": {"mode": "auto", "strategy": "context"},
        },
        headers={"Authorization": f"Bearer {KEY}"},
    ).json()["choices"][0]["message"]["content"]
    assert rendered == reference


def test_the_page_is_public_and_can_be_turned_off(tiny_served) -> None:
    app = create_app(Settings(api_keys=KEY, **QUIET), loader=lambda _: tiny_served)
    with serving(app) as base:
        page = httpx.get(f"{base}/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/web/app.js" in page.text
        for asset in ("app.js", "style.css"):
            assert httpx.get(f"{base}/web/{asset}").status_code == 200
        assert "/" not in httpx.get(f"{base}/openapi.json").json()["paths"]
    off = create_app(Settings(web_ui=False, **QUIET), loader=lambda _: tiny_served)
    with serving(off) as base:
        assert httpx.get(f"{base}/").status_code == 404
        assert httpx.get(f"{base}/web/app.js").status_code == 404
