"""The noisy-neighbour benchmark against a real server: the busy processes really take the
cores, the server's CPU time is read, and both phases report auto and off."""

from __future__ import annotations

import os
import time

import pytest

from app.background import serving
from app.main import create_app
from app.settings import Settings
from service.bench import neighbour
from service.controller.machine_load import MachineLoad
from tests.helpers.http import wait_ready


def test_neighbours_keep_the_cores_busy_and_stop() -> None:
    load = MachineLoad()
    with neighbour.neighbours(1, seconds=30):
        time.sleep(1.2)
        assert not load.steady()  # the load just changed
        assert load.others_cores is not None and load.others_cores > 0.5


def test_the_benchmark_reports_both_phases_and_the_servers_cpu_time(tiny_served) -> None:
    settings = Settings(model_tables=False, cost_profile=False, default_temperature=0.0)
    with serving(create_app(settings, loader=lambda _: tiny_served)) as base:
        wait_ready(base)
        figures = neighbour.run(
            base, os.getpid(), count=1, seconds=1.0, max_tokens=8, log=lambda line: None
        )
    for phase in ("before", "after"):
        assert figures[phase]["off"] > 0 and figures[phase]["ratio"] == pytest.approx(
            figures[phase]["auto"] / figures[phase]["off"]
        )
    assert figures["server_cpu_seconds_idle_beside_neighbours"] >= 0
    assert figures["health"]["status"] == "ok" and "cost_profile_state" not in figures["health"]
