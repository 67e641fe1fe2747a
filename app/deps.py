"""What a route takes from the app, as FastAPI dependencies: `settings: SettingsDep` in a
route's signature instead of reading `request.app.state` by hand.

The app (app/main.py) sets these on `app.state`; the runtime appears there once the model
has loaded, so `RuntimeDep` answers 503 until then. The readers are coroutines so that FastAPI
calls them on the event loop, not on a worker thread each.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.auth import ConcurrencyLimit
from app.errors import ApiError
from app.metrics import Metrics
from app.settings import Settings
from service.runtime import Runtime


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _runtime(request: Request) -> Runtime:
    runtime: Runtime | None = request.app.state.runtime
    if runtime is None:
        raise ApiError(
            503, "the model is still loading; retry when /ready answers 200", "service_unavailable"
        )
    return runtime


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


async def _concurrency(request: Request) -> ConcurrencyLimit:
    return request.app.state.concurrency


SettingsDep = Annotated[Settings, Depends(_settings)]
RuntimeDep = Annotated[Runtime, Depends(_runtime)]  # 503 while the model loads
MetricsDep = Annotated[Metrics, Depends(_metrics)]
# requests in flight per API key
ConcurrencyDep = Annotated[ConcurrencyLimit, Depends(_concurrency)]
