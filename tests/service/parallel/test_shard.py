"""What can be split over ranks, and where each rank stands."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from service.parallel.launch import in_turn
from service.parallel.ranks import RankPlace, free_port
from service.parallel.shard import NotShardable, check_shardable
from tests.helpers.models import make_tiny_model


def test_heads_kv_heads_and_mlp_columns_must_divide_over_the_ranks() -> None:
    model = make_tiny_model()  # 4 heads, 2 KV heads, 128 MLP columns
    check_shardable(model, 2)
    with pytest.raises(
        NotShardable, match=r"num_attention_heads \(4\) does not divide over 3 ranks"
    ):
        check_shardable(model, 3)
    with pytest.raises(
        NotShardable, match=r"num_key_value_heads \(2\) does not divide over 4 ranks"
    ):
        check_shardable(model, 4)


def test_models_without_a_tensor_parallel_layout_are_refused_by_name(tiny_packed) -> None:
    model = make_tiny_model()
    model.config.model_type = "gemma"
    with pytest.raises(NotShardable, match="not 'gemma'"):
        check_shardable(model, 2)
    with pytest.raises(NotShardable, match="packed GGUF linears"):
        check_shardable(tiny_packed[1], 2)


def test_a_pods_first_process_is_local_rank_zero_and_starts_the_others() -> None:
    alone = RankPlace.from_env(2, {})
    assert (alone.rank, alone.local_rank, alone.world, alone.starts_pod) == (0, 0, 2, True)
    assert alone.master_addr == "127.0.0.1" and alone.master_port > 0  # a free port rank 0 picked
    started = RankPlace.from_env(2, alone.env() | {"RANK": "1", "LOCAL_RANK": "1"})
    assert (started.rank, started.local_rank, started.starts_pod, started.master_port) == (
        1,
        1,
        False,
        alone.master_port,
    )


def test_a_leaderworkerset_pod_holds_the_ranks_after_the_pods_before_it() -> None:
    lws = {
        "LWS_GROUP_SIZE": "3",
        "LWS_WORKER_INDEX": "2",
        "MASTER_ADDR": "leader.ns",
        "MASTER_PORT": "29500",
    }
    place = RankPlace.from_env(4, lws)
    assert (place.rank, place.local_rank, place.world, place.starts_pod) == (8, 0, 12, True)
    assert (place.master_addr, place.master_port) == ("leader.ns", 29500)


def test_a_pods_ranks_load_one_after_another_and_other_pods_at_once() -> None:
    """`in_turn` over a real store: local rank 1 waits for local rank 0's turn to end; the
    first rank of the next pod does not."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    order: list[str] = []
    places = [RankPlace(rank, rank % 2, 2, 4, "127.0.0.1", port) for rank in range(4)]

    def load(place: RankPlace, seconds: float) -> None:
        # a process's own
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        with in_turn(store, place):
            order.append(f"start {place.rank}")
            time.sleep(seconds)
            order.append(f"end {place.rank}")

    threads = [threading.Thread(target=load, args=(place, 0.3)) for place in reversed(places)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert order.index("start 1") > order.index("end 0") and order.index("start 3") > order.index(
        "end 2"
    )
    assert order.index("start 2") < order.index("end 0")  # another pod (host): at once
    del server
