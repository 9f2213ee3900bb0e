"""`/doctor`: `tokenfab doctor`'s findings on this server's own metrics (the web page's doctor card).

    GET  /doctor?hardware=NAME                 findings over the last few seconds of metrics
    POST /doctor {"hardware": NAME, "bench": {...a bench serve result...}}

The window runs from the newest earlier snapshot at least MIN_WINDOW_S old (each call leaves one)
to now; on the first call it waits MIN_WINDOW_S for a second scrape. The answer is the same JSON
as `tokenfab doctor --json`.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

from fastapi import FastAPI, Request

from tokenfab.server.errors import APIError, parse_json_object

MIN_WINDOW_S = 3.0
MAX_AGE_S = 120.0


def add_doctor_route(app: FastAPI, st) -> None:
    from tokenfab.doctor.scrape import Scrape
    history: deque[Scrape] = deque(maxlen=256)

    def scrape() -> Scrape:
        return Scrape.parse(st.metrics.render().decode(), time.monotonic())

    async def window():
        from tokenfab.doctor.scrape import Window
        now = scrape()
        while history and now.t - history[0].t > MAX_AGE_S:
            history.popleft()
        old = [s for s in history if now.t - s.t >= MIN_WINDOW_S]
        if old:
            before = old[-1]
        else:
            before = now
            await asyncio.sleep(MIN_WINDOW_S)
            now = scrape()
        history.append(now)
        return Window(before, now)

    def deployment(hardware: str | None):
        if not hardware:
            return None
        from tokenfab.doctor.report import deployment_for
        try:
            return deployment_for(hardware, st.info.model_path, st.metrics.config_labels())
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise APIError(400, str(e).strip("'\""), param="hardware") from None

    def answer(w, bench, dep) -> dict:
        from tokenfab.doctor.report import run
        return run(w, bench, dep)

    @app.get("/doctor")
    async def doctor_get(hardware: str | None = None) -> dict:
        dep = deployment(hardware)
        return answer(await window(), None, dep)

    @app.post("/doctor")
    async def doctor_post(request: Request) -> dict:
        body = parse_json_object(await request.body())
        bench = body.get("bench")
        if bench is not None and (not isinstance(bench, dict) or bench.get("schema") != "tokenfab.bench.serve"):
            raise APIError(400, "bench must be a `tokenfab bench serve --out` result (schema "
                                "tokenfab.bench.serve)", param="bench")
        dep = deployment(body.get("hardware"))
        return answer(await window(), bench, dep)
