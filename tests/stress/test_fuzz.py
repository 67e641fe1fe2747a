"""Schemathesis against the app's own OpenAPI schema, over real HTTP, on the tiny model.

Every operation the schema lists gets generated requests, valid and invalid (its examples,
its boundary values, then Hypothesis fuzzing); each response must be no 5xx, a status the
schema documents, the documented content type, and a body that validates against the
documented schema. API keys are on, so the authentication path is fuzzed too.

Size: about 150 requests by default; `NGRAMMYS_STRESS_FULL=1` (or `pytest --full`) runs at
least 2,000. The tally is printed at the end of the module.
"""

from __future__ import annotations

import os
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks

from app.main import create_app
from app.settings import Settings
from app.background import serving
from tests.helpers.http import QUIET, wait_ready

KEY = "fuzz-key"
FULL = os.environ.get("NGRAMMYS_STRESS_FULL") == "1"
# Examples per operation in the fuzzing phase: two operations take a body, three take nothing.
# The full size adds the coverage phase (every field's boundary and invalid values, other
# HTTP methods): some 700 requests more.
EXAMPLES = 1000 if FULL else 50
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
    checks.negative_data_rejection,
]
TALLY: Counter[str] = Counter()


# max_tokens is capped low so thousands of generations take seconds.
FUZZ_SETTINGS = Settings(max_tokens=8, max_tokens_cap=16, api_keys=KEY, request_timeout=30, **QUIET)
OPENAPI = create_app(FUZZ_SETTINGS).openapi()  # the schema comes from the routes, not the model
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.phases.coverage.enabled = FULL


@pytest.fixture(scope="module")
def fuzz_server(tiny_served, request):
    with serving(create_app(FUZZ_SETTINGS, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        assert httpx.get(f"{base}/openapi.json").json() == OPENAPI
        yield base
        health = httpx.get(f"{base}/health").json()
    summary = ", ".join(f"{status}: {n}" for status, n in sorted(TALLY.items()) if status != "requests")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        print(f"\nschemathesis: {TALLY['requests']} requests ({summary}); server afterwards: {health}")
    assert TALLY["5xx"] == 0


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not FULL,
          suppress_health_check=list(HealthCheck))
def test_schema_holds_for_generated_requests(case, fuzz_server) -> None:
    response = case.call(base_url=fuzz_server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    TALLY["requests"] += 1
    TALLY[f"{case.operation.label}"] += 1
    TALLY[f"{response.status_code // 100}xx"] += 1
    case.validate_response(response, checks=CHECKS)
