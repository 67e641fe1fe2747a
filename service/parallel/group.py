"""The ranks' two channels: a data group for the passes' all-reduces (NCCL on GPUs, gloo on
CPUs) and a gloo control group on which rank 0 tells the others what to run.

Rank 0 sends each message (the cache ops logged since the last one, and a pass's rows) by one
broadcast; the others wait for it. While rank 0 sends nothing it pings, and a ping is answered
by an all-reduce, so a rank that died or hangs is found within the timeout even when no request
comes: every collective gives up after that long, and a lost rank ends the server (`RankLost`),
since the model copy is gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from service.parallel.mirror import Op
from service.parallel.ranks import RankPlace

MEET_TIMEOUT = timedelta(minutes=30)  # ranks meeting at start: each loads the model first
PINGS_PER_TIMEOUT = 4  # an idle rank 0 pings this often within the timeout (at most every 5 s)


class RankLost(RuntimeError):
    """A collective failed: a rank died, hangs, or cannot be reached."""


def join_ranks(
    place: RankPlace, device: torch.device, timeout: timedelta
) -> tuple[dist.Store, dist.ProcessGroup, dist.ProcessGroup]:
    """Meet the other ranks; returns the store they met at (its waits are the meeting's), and
    the data and control groups, whose collectives give up after `timeout`."""
    store = dist.TCPStore(
        place.master_addr,
        place.master_port,
        place.world,
        is_master=place.rank == 0,
        timeout=MEET_TIMEOUT,
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=place.rank,
        world_size=place.world,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    control = (
        dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    )
    return store, dist.group.WORLD, control


class Control:
    """Rank 0's end of the control channel: ops logged between messages, messages sent in
    turn, pings while idle (`timeout`: the group's). `on_lost` is called (once) with the
    failure if a rank is lost."""

    def __init__(
        self, group: dist.ProcessGroup, on_lost: Callable[[BaseException], None], timeout: timedelta
    ) -> None:
        self.group, self.on_lost = group, on_lost
        self._ping_seconds = min(5.0, timeout.total_seconds() / PINGS_PER_TIMEOUT)
        self._turn = threading.RLock()  # a message and the pass it starts, whole
        self._ops_lock = threading.Lock()
        self._ops: list[Op] = []
        self._last_sent = time.monotonic()
        self._closed = threading.Event()
        self._pinger = threading.Thread(target=self._ping_while_idle, name="rank-ping", daemon=True)
        self._pinger.start()

    def log(self, op: Op) -> None:
        with self._ops_lock:
            self._ops.append(op)

    @contextmanager
    def turn(self, *message: Any) -> Iterator[None]:
        """Send `message` (with the ops logged so far) to the other ranks, then run the body
        (the pass they run with it) before any other message. Any failure in a turn loses the
        model copy: the ranks may have parted inside a collective that never completes."""
        with self._turn:
            try:
                with self._ops_lock:
                    ops, self._ops = self._ops, []
                dist.broadcast_object_list([(ops, message)], src=0, group=self.group)
                self._last_sent = time.monotonic()
                yield
            except (RuntimeError, dist.DistError) as error:
                self.on_lost(error)
                raise RankLost(str(error)) from error

    def close(self) -> None:
        """Tell the other ranks to stop (they exit), and stop pinging."""
        with self._turn:  # no ping after the stop
            self._closed.set()
            try:
                with self.turn("stop"):
                    pass
            except RankLost:
                pass

    def _ping_while_idle(self) -> None:
        while not self._closed.wait(self._ping_seconds / 2):
            with self._turn:
                if self._closed.is_set() or time.monotonic() - self._last_sent < self._ping_seconds:
                    continue
                try:
                    with self.turn("ping"):
                        dist.all_reduce(torch.zeros(1), group=self.group)
                except RankLost:
                    return


def receive(group: dist.ProcessGroup) -> tuple[list[Op], tuple[Any, ...]]:
    """The other ranks' end: the next message from rank 0 (ops, message)."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
