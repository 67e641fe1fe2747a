"""The composition root: build the app, load the model in the background, wire routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.errors import install_error_handlers
from app.metrics import Metrics
from app.metrics import router as metrics_router
from app.routes import health, openai
from app.settings import Settings
from service.model_loader import LoadedModel, load_model
from service.runtime import Runtime

log = logging.getLogger(__name__)

Loader = Callable[[Settings], LoadedModel]


def load_from_settings(settings: Settings) -> LoadedModel:
    return load_model(settings.model, settings.device, settings.dtype, settings.cache_dir, settings.quantization)


def create_app(settings: Settings, loader: Loader = load_from_settings) -> FastAPI:
    """An app that answers /health at once and /ready once `loader` has built the model."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_load(app, settings, loader))
        yield
        task.cancel()
        if app.state.runtime is not None:
            app.state.runtime.close()

    app = FastAPI(title="ngrammys", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.runtime = None
    app.state.load_error = None
    app.state.model_name = settings.served_model_name
    app.state.metrics = Metrics()
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(metrics_router)
    return app


async def _load(app: FastAPI, settings: Settings, loader: Loader) -> None:
    """Load off the event loop so probes answer meanwhile; record a failure for /ready."""
    try:
        loaded = await asyncio.to_thread(loader, settings)
    except Exception as error:  # surfaced through /ready instead of killing the process
        log.exception("model load failed")
        app.state.load_error = f"{type(error).__name__}: {error}"
        return
    app.state.model_name = settings.served_model_name or loaded.name
    runtime = Runtime.start(
        loaded, settings.cache_dir, settings.model_tables, settings.cost_profile,
        settings.max_waiting, settings.request_timeout,
    )
    app.state.metrics.watch_queue(lambda: runtime.async_engine.num_waiting, lambda: runtime.async_engine.num_running)
    app.state.runtime = runtime
    log.info("ready: %s (loaded in %.1f s)", app.state.model_name, loaded.load_seconds)
