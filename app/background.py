"""Serve the app on a loopback port, from a thread (HTTP tests) or a child process (load tests).

A load test measures the server as its users meet it: in a process of its own. Served from a
thread of the client's process, the server's engine, its event loop and the clients' event
loop all take turns on one interpreter lock, and the figures measure that contention.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 and yield its base URL; shut it down afterwards."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def serving_process(
    serve_flags: list[str], start_timeout: float = 600, started: Callable[[int], None] | None = None
) -> Iterator[str]:
    """Run `ngrammys serve` with `serve_flags` as a child process on 127.0.0.1 and yield its
    base URL once it answers `/health` (`started` is told its process id); stop it (SIGTERM,
    then kill) afterwards."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *serve_flags,
    ]
    child = subprocess.Popen(command)
    if started is not None:
        started(child.pid)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if child.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {child.returncode} while starting"
                )
            try:
                httpx.get(f"{base}/health", timeout=5)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.2)
        yield base
    finally:
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
