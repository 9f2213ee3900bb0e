"""The web page at `/`: chat, completions with logprobs, a live dashboard, a bench viewer, the doctor.

Plain HTML and JavaScript in tokenfab/server/static/, with uPlot (MIT, static/vendor/uplot/) for the
charts: nothing to build, nothing fetched from the network. The page and its assets need no key;
every API call the page makes sends the key the user typed (the page holds none itself).
`tokenfab serve --no-ui` leaves these routes out.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
PUBLIC_PREFIX = "/ui/"


def add_ui_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        # no-cache: after an upgrade the browser must not keep the old page against the new API.
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount(PUBLIC_PREFIX.rstrip("/"), StaticFiles(directory=STATIC), name="ui")
