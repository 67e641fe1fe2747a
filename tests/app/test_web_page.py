"""The web page's routes: the page is public while its data routes ask for a key, and
`--no-web-ui` turns it off."""

from __future__ import annotations

import httpx

from app.background import serving
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import QUIET

KEY = "page-key"


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
