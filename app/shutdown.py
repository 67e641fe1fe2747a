"""Graceful shutdown: on SIGTERM stop admitting, let running requests finish, then exit.

uvicorn's own handling closes the listener and waits for connections, with no bound unless
one is set, and then cuts them without a word. A rolling restart needs better: the first
SIGTERM (or Ctrl-C) makes `/ready` answer 503 and new requests 503 at once, lets the accepted
ones finish for up to `drain_timeout` seconds, ends those still running with an explicit
error (an error event in a stream, a 503 otherwise), and only then lets uvicorn exit (code 0).
A second signal exits at once.
"""

from __future__ import annotations

import logging
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose exit signal drains the engine first."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.fastapi_app = app
        self.drain_timeout = drain_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining:  # a second signal: no more waiting
            super().handle_exit(sig, frame)
            return
        self._draining = True
        threading.Thread(target=self._drain_then_exit, name="ngrammys-drain", daemon=True).start()

    def _drain_then_exit(self) -> None:
        state = self.fastapi_app.state
        state.draining = True
        if state.runtime is not None:
            log.info("draining: finishing running requests for up to %.0f s", self.drain_timeout)
            state.runtime.async_engine.drain(self.drain_timeout)
        # exit as uvicorn would, but without re-raising the signal afterwards: a drained
        # shutdown is a clean one (exit code 0, not 128 + SIGTERM)
        self.should_exit = True
