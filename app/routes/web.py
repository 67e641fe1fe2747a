"""The web page: `GET /` (a chat with the served model and its speculation view) and its static
assets under `/web/`, plain HTML, CSS and JavaScript shipped inside the package (app/web/), so
the page works offline and without a build step. Public: the data it shows comes from the
routes that ask for an API key (the page sends the one its user enters). `--no-web-ui` leaves
both out (404)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB_DIR = Path(__file__).resolve().parent.parent / "web"

router = APIRouter(include_in_schema=False)


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def install_web_ui(app: FastAPI) -> None:
    """Serve the page at / and its assets at /web/."""
    app.include_router(router)
    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")
