"""`GET /v1/speculation/status`: what the web page's live panel shows of the server, as JSON.

Requests running and waiting, tokens per second, acceptance by strategy (app/live.py), the
cost profile's state, and the regime heatmap: the slowdown of a pass over 1 + k·w tokens
against one token, for every k and w up to the server's limits, from the cost profile auto
mode prices passes with (`slowdown_grid`; the numbers only, the page draws them).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from app.auth import client_identity
from app.deps import MetricsDep, RuntimeDep, SettingsDep
from app.schemas import error_responses
from app.settings import SpeculationMode
from service.controller.cost_profile import CostProfile, slowdown_grid
from service.controller.profile_keeper import ProfileState

HEATMAP_CONTEXT = 512  # the context length the heatmap prices passes at (the model's if shorter)
HEATMAP_K_MAX = 16  # the grid's extent, whatever the server's `--spec-k` / `--spec-w`
HEATMAP_W_MAX = 8

router = APIRouter(dependencies=[Depends(client_identity)], responses=error_responses(401))


class StrategyAcceptance(BaseModel):
    strategy: str
    drafted: int = Field(description="tree nodes it drafted since the server started")
    accepted: int = Field(description="of them, tokens the model agreed with")
    rate: float = Field(description="accepted / drafted")


class Heatmap(BaseModel):
    context_length: int
    k: list[int]
    w: list[int]
    slowdown: list[list[float]] = Field(
        description="[w][k]: the cost of a pass over 1 + k·w tokens, in passes over one token"
    )


class CostProfileStatus(BaseModel):
    in_use: bool = Field(description="auto mode prices passes with a profile")
    source: Literal["measured", "default"] | None
    state: ProfileState | None = Field(description="the keeper's account, if the server measures")


class SpeculationDefaults(BaseModel):
    mode: SpeculationMode
    k: int
    w: int
    strategy: str
    strategies: list[str] = Field(description="the strategies a request may name")


class SpeculationStatus(BaseModel):
    model: str
    requests_running: int
    requests_waiting: int
    tokens_per_second: float = Field(description="committed, over the last 10 seconds")
    acceptance: list[StrategyAcceptance]
    cost_profile: CostProfileStatus
    heatmap: Heatmap | None = Field(description="null without a cost profile")
    defaults: SpeculationDefaults


@router.get(
    "/v1/speculation/status",
    response_model=SpeculationStatus,
    responses=error_responses(503),
)
async def speculation_status(
    request: Request, runtime: RuntimeDep, settings: SettingsDep, metrics: MetricsDep
) -> SpeculationStatus:
    """The server's load and speculation at a glance (the web page polls it)."""
    engine, warm = runtime.async_engine, runtime.warm_up_state
    profile = runtime.engine.scheduler.profile
    return SpeculationStatus(
        model=request.app.state.model_name,
        requests_running=engine.num_running,
        requests_waiting=engine.num_waiting,
        tokens_per_second=metrics.live.tokens_per_second(),
        acceptance=[StrategyAcceptance(**row) for row in metrics.live.acceptance()],
        cost_profile=CostProfileStatus(
            in_use=warm.cost_profile,
            source=warm.cost_profile_source,
            state=warm.profile,
        ),
        heatmap=None if profile is None else _heatmap(profile, runtime.max_context),
        defaults=SpeculationDefaults(
            mode=settings.spec_mode,
            k=settings.spec_k,
            w=settings.spec_w,
            strategy=settings.spec_strategy,
            strategies=list(runtime.enabled_strategies),
        ),
    )


def _heatmap(profile: CostProfile, max_context: int) -> Heatmap:
    context = min(HEATMAP_CONTEXT, max_context)
    grid = slowdown_grid(profile, context, HEATMAP_K_MAX, HEATMAP_W_MAX)
    return Heatmap(
        context_length=context,
        k=list(range(1, HEATMAP_K_MAX + 1)),
        w=list(range(1, HEATMAP_W_MAX + 1)),
        slowdown=[[round(value, 3) for value in row] for row in grid],
    )
