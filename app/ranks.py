"""Serving one model copy over several ranks (`--tensor-parallel-size`, LeaderWorkerSet groups).

`ngrammys serve` is rank 0: the HTTP server and the whole engine. It starts its pod's other ranks
(`ngrammys worker` processes at their places) and they meet; under a LeaderWorkerSet each worker
pod's `ngrammys worker` starts its own pod's ranks likewise. A rank lost ends rank 0 at once, with
a log line saying which: the model copy is gone, so readiness fails with the process and the
orchestrator restarts the group. The other ranks ignore SIGTERM and SIGINT: they stop when rank 0,
having drained its requests, tells them to (or when it is gone).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta

from app.settings import Settings
from service.engine.outputs import StepStats
from service.model.runner import ModelRunner
from service.parallel.launch import RankShard, load_shard
from service.parallel.ranks import PodRanks, RankPlace
from service.parallel.runner import serve_rank
from service.runtime import Runtime

log = logging.getLogger(__name__)
EXIT_RANK_LOST = 70  # the process's exit code when a rank of its model copy was lost


def world_size(settings: Settings) -> int:
    """Ranks of one model copy: a pod's, times the pods of a LeaderWorkerSet group."""
    return settings.tensor_parallel_size * int(os.environ.get("LWS_GROUP_SIZE", "1"))


def worker_argv(settings: Settings) -> list[str]:
    """A pod's other ranks' command (after the interpreter): what they need to load the model
    as this process does (the rest of the environment they inherit)."""
    flags = {
        "model": settings.model,
        "device": settings.device,
        "dtype": settings.dtype,
        "quantization": settings.quantization,
        "cache_dir": settings.cache_dir,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "tensor_parallel_timeout": settings.tensor_parallel_timeout,
        "log_level": settings.log_level,
    }
    argv = ["-m", "app.cli", "worker"]
    for name, value in flags.items():
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def start_rank_zero(
    settings: Settings, on_step: Callable[[StepStats], None] | None = None
) -> Runtime:
    """This process as rank 0: start the pod's other ranks, load this rank's shard, serve."""
    place = RankPlace.from_env(settings.tensor_parallel_size)
    if place.rank != 0:
        raise ValueError(
            f"ngrammys serve runs rank 0 (this process is rank {place.rank}): the other pods of a "
            "group run ngrammys worker"
        )
    pod = (
        PodRanks(place, worker_argv(settings), lambda why: _lost(why, pod))
        if place.starts_pod
        else None
    )
    try:
        shard = _load_shard(place, settings)

        def lost(error: BaseException) -> None:
            _lost(f"a collective with the other ranks failed ({error})", pod)

        return Runtime.start_parallel(shard, settings.engine_config(), lost, on_step, pod)
    except BaseException:
        if pod is not None:
            pod.kill()
        raise


def run_worker(settings: Settings) -> None:
    """This process as one of ranks 1..N-1: load its shard and run what rank 0 sends, until it
    says stop (exit 0) or is lost (exit `EXIT_RANK_LOST`)."""
    place = RankPlace.from_env(settings.tensor_parallel_size)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then stops us
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pod = (
        PodRanks(place, worker_argv(settings), lambda why: _lost(why, pod))
        if place.starts_pod
        else None
    )
    try:
        shard = _load_shard(place, settings)
        serve_rank(ModelRunner(shard.loaded.model, static_passes=False), shard.control_group)
    except Exception as error:  # noqa: BLE001 — rank 0 gone, or this rank failed: either way the copy is lost
        _lost(f"rank {place.rank}: {type(error).__name__}: {error}", pod)
    if pod is not None:
        pod.wait()


def _load_shard(place: RankPlace, settings: Settings) -> RankShard:
    return load_shard(
        place,
        settings.model,
        settings.device,
        settings.dtype,
        settings.cache_dir,
        settings.quantization,
        timedelta(seconds=settings.tensor_parallel_timeout),
    )


def _lost(why: str, pod: PodRanks | None) -> None:
    """A rank of this model copy is lost: say which, end this pod's ranks and this process."""
    log.error("tensor parallelism: %s; the model copy is lost, exiting", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    if pod is not None:
        pod.kill()
    sys.stderr.flush()
    os._exit(EXIT_RANK_LOST)
