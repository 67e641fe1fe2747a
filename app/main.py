"""The composition root: build the app, load the model in the background, wire routes."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI

from app.auth import ApiKeys, ConcurrencyLimit
from app.batches.opening import open_store
from app.batches.runner import BatchRunner
from app.batches.store import StoreError
from app.errors import install_error_handlers
from app.limits import BodySizeLimit
from app.metrics import Metrics, RouteCounter
from app.metrics import router as metrics_router
from app.openapi import finish_openapi
from app.ranks import start_rank_zero, world_size
from app.responses_api.store import ResponseStore
from app.routes import batches, health, messages, openai, responses, status, tokenize
from app.routes.web import install_web_ui
from app.settings import Settings
from service.model.loader import LoadedModel, load_model
from service.runtime import Runtime

log = logging.getLogger(__name__)
STORE_RETRY_SECONDS = 5.0  # how often a batch store that could not be opened is tried again

Loader = Callable[[Settings], LoadedModel]
T = TypeVar("T")


def load_from_settings(settings: Settings) -> LoadedModel:
    return load_model(
        settings.model, settings.device, settings.dtype, settings.cache_dir, settings.quantization
    )


def create_app(
    settings: Settings,
    loader: Loader = load_from_settings,
    on_load_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """An app that answers /health at once and /ready once `loader` has built the model.

    If loading fails, /health and /ready answer 503 and `on_load_failure` is called: the CLI
    passes one that stops the server, so the process exits non-zero and is restarted.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(_load(app, settings, loader, on_load_failure))]
        if settings.batch_store is not None:
            tasks.append(asyncio.create_task(_run_batches(app, settings.batch_store)))
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if app.state.batch_store is not None:
            app.state.batch_store.close()
        if app.state.runtime is not None:
            app.state.runtime.close()

    app = FastAPI(title="ngrammys", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.runtime = None
    app.state.load_error = None
    app.state.draining = False
    app.state.model_name = settings.served_model_name
    app.state.metrics = Metrics()
    app.state.api_keys = ApiKeys.from_settings(settings)
    app.state.concurrency = ConcurrencyLimit(
        settings.max_concurrent_per_key, settings.retry_after_seconds
    )
    app.state.tokenizer_lock = threading.Lock()
    app.state.responses = ResponseStore(
        settings.stored_responses, settings.stored_responses_mb << 20
    )
    app.state.batch_store = app.state.batch_store_error = app.state.batch_runner = None
    app.add_middleware(
        BodySizeLimit,
        limit=settings.max_body_bytes,
        by_path={"/v1/files": settings.batch_file_mb << 20},
    )
    app.add_middleware(RouteCounter, metrics=app.state.metrics)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(tokenize.router)
    app.include_router(batches.router)
    app.include_router(status.router)
    app.include_router(metrics_router)
    if settings.web_ui:
        install_web_ui(app)
    finish_openapi(app)
    return app


async def _run_batches(app: FastAPI, location: str) -> None:
    """Open the batch store and run its batches. A store that cannot be opened (another server
    holds it, as the old pod of a rolling restart does until it exits; a corrupt database; a
    PostgreSQL that does not answer) leaves batch jobs answering 503 with the reason, and the
    rest of the server serving; it is tried again every `STORE_RETRY_SECONDS`."""
    while True:
        try:
            store = await asyncio.to_thread(open_store, location)
            break
        except StoreError as error:
            if app.state.batch_store_error != str(error):
                log.error("batch jobs are unavailable until the store opens: %s", error)
            app.state.batch_store_error = str(error)
            await asyncio.sleep(STORE_RETRY_SECONDS)
    settings: Settings = app.state.settings
    runner = BatchRunner(
        app,
        store,
        settings.batch_concurrency,
        app.state.api_keys.internal_key(),
        settings.batch_lease_seconds,
    )
    app.state.batch_store, app.state.batch_runner = store, runner
    app.state.batch_store_error = None
    app.state.metrics.watch_batches(runner)
    await runner.run()


async def _load(
    app: FastAPI, settings: Settings, loader: Loader, on_failure: Callable[[], None] | None
) -> None:
    """Load and start the engine off the event loop so probes answer meanwhile; a failure
    is recorded for /health and /ready, and `on_failure` is told."""

    def start() -> Runtime:
        if world_size(settings) > 1:
            return start_rank_zero(settings, on_step=app.state.metrics.record_step)
        return Runtime.start(
            loader(settings), settings.engine_config(), on_step=app.state.metrics.record_step
        )

    try:
        runtime = await in_passing_thread(start)
    except Exception as error:
        log.exception("model load failed")
        app.state.load_error = f"{type(error).__name__}: {error}"
        if on_failure is not None:
            on_failure()
        return
    app.state.model_name = settings.served_model_name or runtime.loaded.name
    app.state.metrics.watch_queue(
        lambda: runtime.async_engine.num_waiting, lambda: runtime.async_engine.num_running
    )
    app.state.metrics.watch_profile(lambda: runtime.warm_up_state.profile)
    app.state.metrics.watch_kv_cache(runtime.async_engine.engine.scheduler)
    if runtime.async_engine.engine.mixer.suffix is not None:
        app.state.metrics.watch_suffix_index(runtime.async_engine.engine.mixer.suffix)
    app.state.runtime = runtime
    log.info("ready: %s (loaded in %.1f s)", app.state.model_name, runtime.loaded.load_seconds)


async def in_passing_thread(work: Callable[[], T]) -> T:
    """`work()` on a thread of its own that ends with it, so that the engine's worker is the
    only thread left that computes.

    Not `asyncio.to_thread`: OpenMP (torch's runtime and numba's) keeps a pool of worker
    threads for every thread that ran a parallel region, for as long as that thread lives, and
    the default executor's threads live on. With a loader's pool beside the engine's, the
    pools hold more threads than a small CPU has cores, and libgomp then stops spinning
    between regions, so every region waits for a sleeping worker to wake, and one-row passes
    slow down by half (docs/benchmarks.md, figures behind design choices).
    """
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ngrammys-load")
    try:
        return await loop.run_in_executor(executor, work)
    finally:
        executor.shutdown(wait=False)  # its thread ends once `work` returns
