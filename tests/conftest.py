"""Shared fixtures: a real redis-server and a real local Spark session, one each per test run."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from sluice.config import Config, config_from_dict
from sluice.redis.connection import client_for
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.local_cluster import LocalCluster
from sluice.source.kafka_records import forget_consumers
from sluice.testing.kafka import TEST_PRODUCER_OPTIONS, KafkaBroker
from sluice.testing.ports import free_port

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


# End-to-end modules that time nothing (batch commands run to their end): they may run beside
# another end-to-end test, so they leave the lane and go to whichever worker is free.
UNTIMED_E2E = ("test_backfill_cli.py", "test_backfill_seam.py", "test_training_cli.py")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Two lanes under `pytest -n 2` (the test command): the end-to-end tests run in order on
    one worker, while the other runs the unit and integration tests. An end-to-end test mostly
    waits on the processes it starts, so the two lanes share the two cores well, and never do
    two end-to-end tests that time a takeover or a stop (each starting JVMs of its own) run at
    once. The untimed ones (UNTIMED_E2E) go, a module at a time, to whichever worker is free,
    so that the lanes end together."""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if not nodeid.startswith("tests/e2e/"):
                return nodeid
            module = nodeid.split("::", 1)[0]
            return module if module.endswith(UNTIMED_E2E) else "e2e"

    return Lanes(config, log)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test leaves the process environment and the root logger's level as it found them.
    A command run in-process (`CliRunner`) exports its settings for the processes it starts
    (`--log-level` as SLUICE_LOG_LEVEL) and sets the level: left behind, they would reach every
    later test's subprocesses and in-process logs."""
    saved = dict(os.environ)
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server (the embedded binary) on a loopback port, for the whole run."""
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A client on an emptied database."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A real Redis Cluster: 3 masters (redis-server processes on loopback ports), slots split
    in three equal ranges, for the whole run. Started only by the tests that ask for it."""
    with LocalCluster(tmp_path_factory.mktemp("cluster"), masters=3) as cluster:
        yield cluster


@pytest.fixture
def rc(redis_cluster: LocalCluster) -> Iterator[Any]:
    """A cluster client (`redis.cluster.RedisCluster`) on an emptied cluster."""
    redis_cluster.flushall()
    client = client_for(redis_cluster.url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    """A real Kafka-compatible broker (`tansu`, memory storage) on a loopback port, for the
    whole run, or the broker at $SLUICE_TEST_KAFKA. Started only by the tests that ask for it;
    see `sluice.testing.kafka` for the broker's defects that tests work around."""
    log = tmp_path_factory.mktemp("kafka") / "broker.log"
    with KafkaBroker(log, external=os.environ.get("SLUICE_TEST_KAFKA") or None) as broker:
        yield broker
        forget_consumers()  # before the broker goes, or they keep trying to reach it


@pytest.fixture
def kafka_topic(kafka_broker: KafkaBroker, request: pytest.FixtureRequest) -> str:
    """A fresh 2-partition topic named after the test."""
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name)[:120]
    name += f"-{time.monotonic_ns() % 1_000_000}"
    kafka_broker.create_topic(name, partitions=2)
    return name


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A real local Spark session with the Redis Streams source registered."""
    from sluice.pipeline.spark import build_spark

    cfg = config_from_dict({"metrics": [{"name": "n", "key": ["key"], "agg": "count"}]})
    session = build_spark(cfg, app_name="sluice-tests")
    yield session
    session.stop()


def make_config(redis_url: str, state_dir: Path, **overrides: Any) -> Config:
    """The test config: DESIGN §3's example, plus an integer field for exact sums."""
    return config_from_dict(config_data(redis_url, state_dir, **overrides))


def config_data(redis_url: str, state_dir: Path, **overrides: Any) -> dict[str, Any]:
    """`make_config`'s config as the plain data a sluice.yaml holds."""
    data: dict[str, Any] = {
        "redis": redis_url,
        "state_dir": str(state_dir),
        "source": {
            "stream": "events",
            "shards": 2,
            "format": "jsonl",
            "schema": {
                "ts": "long",
                "card": "string",
                "merchant": "string",
                "amount": "double",
                "qty": "long",
            },
            "time_field": "ts",
        },
        "metrics": [
            {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
             "retention": "1d"},
            {"name": "amount_sum", "key": ["merchant"], "agg": "sum", "value": "amount",
             "filter": "amount > 0", "slice": "1m", "retention": "1d"},
            {"name": "qty_sum", "key": ["merchant"], "agg": "sum", "value": "qty",
             "slice": "1m", "retention": "1d"},
            {"name": "merchant_txn", "key": ["merchant"], "agg": "count", "slice": "1m",
             "retention": "1d"},
            {"name": "card_min", "key": ["card"], "agg": "min", "value": "amount",
             "slice": "10s", "retention": "1d"},
            {"name": "card_max", "key": ["card"], "agg": "max", "value": "qty",
             "slice": "10s", "retention": "1d"},
            {"name": "avg_amount", "key": ["merchant"], "agg": "avg", "value": "amount",
             "slice": "1m", "retention": "1d"},
            {"name": "pair_count", "key": ["card", "merchant"], "agg": "count",
             "slice": "1h", "retention": "1d"},
            {"name": "card_merchants", "key": ["card"], "agg": "distinct", "value": "merchant",
             "slice": "1m", "retention": "1d"},
            {"name": "amount_q", "key": ["merchant"], "agg": "quantile", "value": "amount",
             "q": [0.5, 0.99], "slice": "1m", "retention": "1d"},
            {"name": "card_last", "key": ["card"], "agg": "last", "value": "amount",
             "slice": "10s", "retention": "1d"},
            {"name": "card_first", "key": ["card"], "agg": "first", "value": "amount",
             "slice": "10s", "retention": "1d"},
            {"name": "amount_std", "key": ["merchant"], "agg": "stddev", "value": "amount",
             "slice": "1m", "retention": "1d"},
            {"name": "qty_var", "key": ["merchant"], "agg": "variance", "value": "qty",
             "slice": "1m", "retention": "1d"},
            {"name": "txn_res", "key": ["card"], "agg": "count",
             "resolutions": ["10s", "1m", "10m"], "retention": "1d"},
            {"name": "amount_res", "key": ["merchant"], "agg": "max", "value": "amount",
             "resolutions": ["10s", "1m", "10m"], "retention": "1d"},
        ],
        "derived": [{"name": "avg_ticket", "expr": "amount_sum / merchant_txn"}],
        "spark": {"master": "local[2]", "trigger": "200ms"},
    }  # fmt: skip
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(data.get(k), dict):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return data


def kafka_config(
    redis_url: str,
    state_dir: Path,
    broker: KafkaBroker,
    topic: str,
    fmt: str = "jsonl",
    **overrides: Any,
) -> Config:
    """`make_config` reading Kafka topic `topic` instead of Redis Streams. Its producers send
    one record per request (see `sluice.testing.kafka`)."""
    data = config_data(redis_url, state_dir, **overrides)
    source = {k: v for k, v in data["source"].items() if k != "shards"}
    kafka = {"bootstrap": broker.bootstrap, "topic": topic, "group_id": f"sluice-{topic}",
             "producer_options": dict(TEST_PRODUCER_OPTIONS)}  # fmt: skip
    data["source"] = {**source, "format": fmt, "kafka": {**kafka, **source.get("kafka", {})}}
    return config_from_dict(data)


def wait_until(predicate: Any, timeout_s: float, what: str, every_s: float = 0.05) -> None:
    """Poll `predicate` until it is true; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


class ServerThread:
    """A real uvicorn server for an ASGI app, on a free loopback port, in a thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
