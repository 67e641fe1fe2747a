"""Kubernetes probes: /health says the process is alive, /ready that it can serve.

A model that failed to load fails both (503): the process can never serve, so an
orchestrator should restart it (the CLI also exits non-zero then).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from service.controller.profile_keeper import ProfileState

router = APIRouter()


class Health(BaseModel):
    status: Literal["ok", "failed", "engine stopped"]
    requests_running: int | None = None
    requests_waiting: int | None = None
    cost_profile: bool | None = None  # a valid one measured or loaded
    # what auto mode prices passes with until (and once) this machine's is measured
    cost_profile_source: Literal["measured", "default"] | None = None
    # validity, staleness and measurements (if the server measures one)
    cost_profile_state: ProfileState | None = None
    model_tables: bool | None = None  # computed (all of them) or loaded
    # the tokens whose rows the table strategies draft from: the first ids' while the tables
    # are computed (their ids run from the commonest tokens), the vocabulary once they are
    model_table_rows: int | None = None
    # only when the CPU kernels failed to load: why (their torch fallback runs)
    kernels_fallback: str | None = None
    error: str | None = None


class Ready(BaseModel):
    status: Literal["ready", "loading", "failed", "draining"]
    model: str | None = None
    error: str | None = None


def _probe_responses(model: type) -> dict[int | str, dict[str, Any]]:
    return {503: {"model": model, "description": "Not serving (see `status`)"}}


@router.get("/health", response_model=Health, responses=_probe_responses(Health))
async def health(request: Request) -> JSONResponse:
    """Alive; with the engine's load once it runs (a freed slot shows here at once). 503 when
    the model failed to load or the engine's worker died, so an orchestrator restarts it."""
    state = request.app.state
    if state.load_error:
        return JSONResponse({"status": "failed", "error": state.load_error}, status_code=503)
    if state.runtime is None:
        return JSONResponse({"status": "ok"})
    engine, warm = state.runtime.async_engine, state.runtime.warm_up_state
    body = {
        "status": "ok" if engine.alive else "engine stopped",
        "requests_running": engine.num_running,
        "requests_waiting": engine.num_waiting,
        "cost_profile": warm.cost_profile,
        "cost_profile_source": warm.cost_profile_source,
        "model_tables": warm.model_tables,
        "model_table_rows": warm.model_table_rows,
    }
    if warm.profile is not None:
        body["cost_profile_state"] = asdict(warm.profile)
    if state.runtime.kernels_fallback is not None:
        body["kernels_fallback"] = state.runtime.kernels_fallback
    return JSONResponse(body, status_code=200 if engine.alive else 503)


@router.get("/ready", response_model=Ready, responses=_probe_responses(Ready))
async def ready(request: Request) -> JSONResponse:
    state = request.app.state
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.runtime is None:
        status = "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)
    return JSONResponse({"status": "ready", "model": state.model_name})
