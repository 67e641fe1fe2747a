"""Where this process stands among the ranks of one model copy, and how they meet.

Ranks come in pods (or one host): `tensor_parallel_size` ranks a pod, one GPU each, and
`LWS_GROUP_SIZE` pods a model copy under a LeaderWorkerSet (1 elsewhere). The first process of a
pod starts the pod's other ranks itself; they find their place in `RANK` / `LOCAL_RANK`. They meet
at `MASTER_ADDR:MASTER_PORT` (the chart sets them to the leader's address), or, in one pod, at a
free local port rank 0 picks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RankPlace:
    """One rank's place: global rank, rank within its pod, ranks a pod, ranks in all."""

    rank: int
    local_rank: int
    per_pod: int
    world: int
    master_addr: str
    master_port: int
    starts_pod: bool = False  # this process starts its pod's other ranks (a pod's first process)

    @classmethod
    def from_env(cls, per_pod: int, env: Mapping[str, str] = os.environ) -> RankPlace:
        """This process's place: a pod's first process (no `RANK` set) is its local rank 0."""
        pods = int(env.get("LWS_GROUP_SIZE", "1"))
        pod = int(env.get("LWS_WORKER_INDEX", "0"))
        local = int(env.get("LOCAL_RANK", "0"))
        rank = int(env["RANK"]) if "RANK" in env else pod * per_pod + local
        port = (
            int(env["MASTER_PORT"]) if "MASTER_PORT" in env else (free_port() if rank == 0 else 0)
        )
        return cls(
            rank,
            local,
            per_pod,
            pods * per_pod,
            env.get("MASTER_ADDR", "127.0.0.1"),
            port,
            starts_pod="RANK" not in env,
        )

    def env(self) -> dict[str, str]:
        """The environment that puts a process at this place."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PodRanks:
    """This pod's other ranks, started as processes running `worker_argv` (after the Python
    interpreter) at their places, and watched: `on_exit(why)` is called (on a thread) if one
    exits before `stop`."""

    def __init__(
        self,
        place: RankPlace,
        worker_argv: Sequence[str],
        on_exit: Callable[[str], None],
        interval: float = 0.5,
    ) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        for local in range(1, place.per_pod):
            sibling = replace(place, rank=place.rank + local, local_rank=local, starts_pod=False)
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, *worker_argv], env={**os.environ, **sibling.env()}
                )
            )
        self._stopping = threading.Event()
        self._on_exit, self._interval = on_exit, interval
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopping.wait(self._interval):
            for process in self.processes:
                code = process.poll()
                if code is not None and not self._stopping.is_set():
                    self._on_exit(f"rank process {process.pid} exited with code {code}")
                    return

    def stopping(self) -> None:
        """The ranks are about to be told to stop: their exits are expected from now on."""
        self._stopping.set()

    def wait(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to exit (after they were told to stop); kill those that do not."""
        self.stopping()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()

    def kill(self) -> None:
        self.stopping()
        for process in self.processes:
            process.kill()
