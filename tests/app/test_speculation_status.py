"""`GET /v1/speculation/status`: the server's load and speculation at a glance, behind the
API keys as the other data routes."""

from __future__ import annotations

import httpx

from app.background import serving
from app.main import create_app
from app.settings import Settings
from tests.helpers.http import MESSAGES, QUIET, post, runtime_of, speculating, wait_ready

KEY = "status-key"


def test_status_shows_load_acceptance_and_heatmap(tiny_served) -> None:
    app = create_app(
        Settings(api_keys=KEY, spec_k=6, spec_w=4, **QUIET), loader=lambda _: tiny_served
    )
    with serving(app) as base:
        wait_ready(base)
        speculating(app)  # a cost profile, so there is a heatmap
        auth = {"authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{base}/v1/speculation/status").status_code == 401
        body = {"messages": MESSAGES, "max_tokens": 16, "speculation": {"mode": "fixed"}}
        assert post(base, "chat/completions", body, headers=auth).status_code == 200
        status = httpx.get(f"{base}/v1/speculation/status", headers=auth).json()
    assert status["requests_running"] == 0 and status["requests_waiting"] == 0
    assert status["tokens_per_second"] > 0
    assert status["defaults"] == {
        "mode": "auto",
        "k": 6,
        "w": 4,
        "strategy": "mixed",
        "strategies": list(runtime_of(app).enabled_strategies),
    }
    for row in status["acceptance"]:
        assert 0 <= row["accepted"] <= row["drafted"]
    heatmap = status["heatmap"]
    assert len(heatmap["slowdown"]) == len(heatmap["w"]) and heatmap["k"][0] == 1
    assert all(len(row) == len(heatmap["k"]) for row in heatmap["slowdown"])
    assert heatmap["slowdown"][0][0] >= 1.0  # a pass over 2 tokens costs at least one over 1
    assert status["cost_profile"]["in_use"]
