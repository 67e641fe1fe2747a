"""Test helpers around an app served by `app.background.serving`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI



@contextmanager
def slowed(app: FastAPI, seconds: float) -> Iterator[None]:
    """Make every forward pass of the app's engine take `seconds` longer.

    Tests of timeouts, queueing and disconnects need a request that is still running when
    they look; slowing the pass makes that hold on a machine of any speed.
    """
    runner = app.state.runtime.engine.runner
    original = runner.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    runner.forward = slow_forward
    try:
        yield
    finally:
        runner.forward = original
