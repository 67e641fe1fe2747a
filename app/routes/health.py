"""Kubernetes probes: /health says the process is alive, /ready that it can serve."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict[str, object]:
    """Alive; with the engine's load once it runs (a freed slot shows here at once)."""
    runtime = request.app.state.runtime
    if runtime is None:
        return {"status": "ok"}
    engine = runtime.async_engine
    return {"status": "ok", "requests_running": engine.num_running, "requests_waiting": engine.num_waiting}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    state = request.app.state
    if state.runtime is None:
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)
    return JSONResponse({"status": "ready", "model": state.model_name})
