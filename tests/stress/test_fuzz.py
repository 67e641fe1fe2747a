"""Schemathesis against the schema the running server publishes, over real HTTP, on the tiny
model, as a user runs it: `schemathesis run URL --checks all`.

Every operation gets generated requests, valid and invalid: its examples, the coverage phase
(every field's boundary and invalid values, other HTTP methods), Hypothesis fuzzing and the
stateful phase. Every check schemathesis has runs on each response: no 5xx, a status, content
type, headers and body the schema documents, invalid data refused, schema-valid data accepted
(so the schema must state what the server enforces; `fuzz_hooks.py` applies the few rules no
JSON schema can state to the requests generated as valid), a missing or wrong key refused. API keys
are on, so the authentication path is fuzzed too. The schema is read from the server once its
model has loaded (the model's vocabulary bounds a prompt's token ids).

Each run draws a fresh seed (printed; `NGRAMMYS_FUZZ_SEED=N` replays it), so CI covers new cases
every time; a failing run leaves a pytest file reproducing its failures in `.fuzz-failures/`.
Size: 500+ requests by default; `NGRAMMYS_STRESS_FULL=1` (or `pytest --full`) 2,000+.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from app.background import serving
from app.main import create_app
from app.settings import Settings
from service.model.loader import LoadedModel
from tests.helpers.http import QUIET, wait_ready
from tests.helpers.models import make_tiny_model
from tests.stress.fuzz_hooks import SERVED_MODEL

KEY = "fuzz-key"
FULL = os.environ.get("NGRAMMYS_STRESS_FULL") == "1"
SEED = int(os.environ.get("NGRAMMYS_FUZZ_SEED") or random.randrange(2**32))
FAILURES = Path(".fuzz-failures")
ROOT = Path(__file__).resolve().parents[2]
# per operation in the fuzzing phase, beside the coverage phase's ~450 requests
EXAMPLES = 1000 if FULL else 60
# max_tokens is capped low so thousands of generations take seconds.
FUZZ_SETTINGS = Settings(max_tokens=8, max_tokens_cap=16, api_keys=KEY, request_timeout=30, **QUIET)


@pytest.fixture(scope="module")
def long_context_served(embedded) -> LoadedModel:
    """The tiny model behind the embedded tokenizer with a context no generated body reaches:
    a schema cannot count tokens, so a prompt beyond the context is the one 400 it cannot
    state (every other limit is in the published schema)."""
    model = make_tiny_model(vocab_size=embedded.model.config.vocab_size, context=1 << 16)
    return LoadedModel(model, embedded.tokenizer, SERVED_MODEL, 0.0, False)


def test_the_published_schema_holds_for_generated_requests(long_context_served, tmp_path) -> None:
    reports = tmp_path / "reports"
    with serving(create_app(FUZZ_SETTINGS, loader=lambda _: long_context_served)) as base:
        wait_ready(base)
        command = [
            str(Path(sys.executable).parent / "schemathesis"),
            "run",
            f"{base}/openapi.json",
            "--checks",
            "all",
            "--seed",
            str(SEED),
            "--max-examples",
            str(EXAMPLES),
            "--header",
            f"Authorization: Bearer {KEY}",
            "--request-timeout",
            "60",
            "--continue-on-failure",
            "--output-sanitize",
            "false",
            "--report",
            "pytest",
            "--report-dir",
            str(reports),
        ]
        # the rules no schema states
        hooks = {"SCHEMATHESIS_HOOKS": "tests.stress.fuzz_hooks", "PYTHONPATH": str(ROOT)}
        run = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=tmp_path,  # its caches there
            env={**os.environ, **hooks},
        )
        health = httpx.get(f"{base}/health").json()
    output = run.stdout + run.stderr
    summary = output[output.rfind("SUMMARY") :] if "SUMMARY" in output else output[-3000:]
    print(
        f"\nschemathesis, seed {SEED} (NGRAMMYS_FUZZ_SEED={SEED} replays it); server afterwards: "
        f"{health}\n{summary}"
    )
    if run.returncode != 0:
        FAILURES.mkdir(exist_ok=True)
        for report in reports.glob("*.py"):
            (FAILURES / f"seed-{SEED}-{report.name}").write_text(report.read_text())
    assert health["requests_running"] == 0 and health["requests_waiting"] == 0
    assert run.returncode == 0, output[-6000:]
