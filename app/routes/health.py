"""Kubernetes probes: /health says the process is alive, /ready that it can serve."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Alive; with the engine's load once it runs (a freed slot shows here at once). 503 once
    the engine's worker has died, so an orchestrator restarts the process."""
    runtime = request.app.state.runtime
    if runtime is None:
        return JSONResponse({"status": "ok"})
    engine = runtime.async_engine
    body = {"status": "ok" if engine.alive else "engine stopped",
            "requests_running": engine.num_running, "requests_waiting": engine.num_waiting,
            "cost_profile": runtime.engine.profile is not None,
            "model_tables": runtime.engine.mixer.tables.tables is not None}
    return JSONResponse(body, status_code=200 if engine.alive else 503)


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    state = request.app.state
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.runtime is None:
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)
    return JSONResponse({"status": "ready", "model": state.model_name})
