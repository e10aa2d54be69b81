"""Producing into a Redis Cluster with one master down: the shards of the masters that answer
are written and let go of, the down master's are kept, and a retry of the flush (what the
README asks of a caller) writes those alone. Every event once, none lost. A real local cluster
of three masters, one stopped and started again; the ingest route's retry of a request's rest
(`routes.flush_rest`) on the same."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sluice.errors import PartlyWritten, RedisUnavailable
from sluice.redis.connection import check_reachable, client_for
from sluice.redis.local_cluster import LocalCluster
from sluice.server.routes import PARTIAL_RETRIES, WAITING_AT_ONCE, flush_rest
from sluice.source.producer import Producer
from tests.conftest import make_config

N = 300


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    # A master down is not marked failed while a test runs (the others would then refuse
    # writes too, cluster_state:fail): what is tested is the flush's, not the cluster's, part.
    with LocalCluster(tmp_path / "cluster", masters=3, node_timeout_ms=60_000) as c:
        yield c


def _producer(cluster: LocalCluster, tmp_path: Path) -> tuple[Any, Producer, list[str], list[int]]:
    # One shard per master, in order (hash tags): the last shard is the last master's.
    cfg = make_config(cluster.url, tmp_path / "state")
    cfg = cfg.model_copy(
        update={"source": cfg.source.model_copy(update={"shards": 3, "hash_tags": True})}
    )
    client = client_for(cluster.url, timeout_s=2, connect_timeout_s=1)
    producer = Producer.from_config(cfg, client, flow=False)
    events = [
        {"ts": 1, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": 1} for i in range(N)
    ]
    shards = producer.buffer_all(events)  # as POST /v1/events buffers a request
    return client, producer, cfg.source.shard_keys(), shards


def _events(client: Any, keys: list[str]) -> int:
    return sum(int(f[b"n"]) for k in keys for _, f in client.xrange(k))


def test_a_retried_flush_writes_only_the_down_master_s_shards(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    client, producer, keys, shards = _producer(cluster, tmp_path)
    cluster.stop_node(0)  # the first shard's: the masters after it are written all the same
    with pytest.raises(RedisUnavailable, match=r"a master of the redis cluster at .* does not"):
        check_reachable(cluster.url)  # what the commands say, not "omit `redis:`"
    with pytest.raises(Exception):  # noqa: B017 - a connection error, as redis-py names it
        producer.flush()
    held = producer.pending()
    assert held == shards.count(0) and producer.pending_shards() == {0}
    for _ in range(3):  # the caller retries while the master is down: nothing repeats
        with pytest.raises(Exception):  # noqa: B017
            producer.flush()
        assert producer.pending() == held
    cluster.start_node(0)
    assert producer.flush() == held and producer.pending() == 0
    assert _events(client, keys) == N


def test_the_ingest_route_writes_a_request_s_rest_once_the_master_is_back(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    client, producer, keys, shards = _producer(cluster, tmp_path)
    cluster.stop_node(2)
    with pytest.raises(Exception):  # noqa: B017
        producer.flush()
    assert 0 < producer.pending() < N
    # Not back within the wait: the events not written are named, by their index
    with pytest.raises(PartlyWritten) as e:
        flush_rest(producer, shards, wait_s=0.5)
    assert e.value.unwritten == [i for i, shard in enumerate(shards) if shard == 2]
    assert e.value.details() == {"unwritten": e.value.unwritten}
    # Other requests wait out the master already: this one answers at once, not after 60 s
    held = [PARTIAL_RETRIES.acquire(blocking=False) for _ in range(WAITING_AT_ONCE)]
    try:
        assert all(held)
        t0 = time.monotonic()
        with pytest.raises(PartlyWritten):
            flush_rest(producer, shards, wait_s=60)
        assert time.monotonic() - t0 < 5
    finally:
        for _ in held:
            PARTIAL_RETRIES.release()
    back = threading.Timer(1.5, cluster.start_node, args=(2,))
    back.start()
    flush_rest(producer, shards, wait_s=60)  # what POST /v1/events does before it answers
    back.join()
    assert producer.pending() == 0 and _events(client, keys) == N
