"""The supervisor through a Redis outage, with real processes: the pipeline's Redis is killed
(SIGKILL) under load and restarted from its AOF on the same port; the pipeline pauses, reports
it, resumes by itself, and every acknowledged event is counted exactly once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import redis

from sluice.pipeline.fold import FoldQuery
from sluice.redis.connection import RedisHandle
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import STATS_KEY
from sluice.status.snapshot import pipeline_health
from tests.conftest import make_config


def _send(client: redis.Redis, n_entries: int, start: int) -> int:
    """XADD jsonl entries one at a time; returns how many events were acknowledged."""
    acked = 0
    now = time.time_ns() // 1_000_000
    for i in range(start, start + n_entries):
        lines = [
            orjson.dumps(
                {"ts": now, "card": f"c{j % 11}", "merchant": "m", "amount": 1.0, "qty": 1}
            )
            for j in range(20)
        ]
        try:
            client.xadd(f"events:{i % 2}", {"d": b"\n".join(lines), "n": 20})
        except redis.RedisError:
            return acked
        acked += 20
    return acked


def test_pipeline_pauses_through_a_redis_outage_and_resumes(spark: Any, tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    port = server.port
    cfg = make_config(
        server.url,
        tmp_path / "state",
        metrics=[{"name": "txn_count", "key": ["card"], "agg": "count", "slice": "1m",
                  "retention": "1d"}],
        derived=[],
    )  # fmt: skip
    handle = RedisHandle(server.url)
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    p = FoldQuery(cfg, handle, spark)
    runner = threading.Thread(target=p.run_forever, kwargs={"max_backoff_s": 2.0}, daemon=True)
    runner.start()
    states: list[str] = []
    try:
        acked = _send(client, 50, 0)
        deadline = time.monotonic() + 120
        while int(client.hget(STATS_KEY, "events_in") or 0) < acked:
            assert time.monotonic() < deadline, "no batch before the outage"
            time.sleep(0.2)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        server.proc.wait()  # type: ignore[union-attr]
        time.sleep(3.0)  # the outage: the query fails, the supervisor waits for Redis
        server = EmbeddedRedis(tmp_path / "redis", port=port, appendfsync="always").start()
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        deadline = time.monotonic() + 60
        while True:
            st = pipeline_health(client, int(time.time() * 1000))
            states.append(st["state"])
            if st["state"] in ("restarting", "failing", "waiting_for_redis", "running") and (
                st["restarts"] >= 1
            ):
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.2)
        # Back to `running` once the queries run again, with no input since the outage (it
        # used to say `failing` until an event came).
        deadline = time.monotonic() + 60
        while pipeline_health(client, int(time.time() * 1000))["state"] != "running":
            assert time.monotonic() < deadline, pipeline_health(client, int(time.time() * 1000))
            time.sleep(0.2)
        assert "failing" not in states  # an outage is waited for, not counted as failures
        acked += _send(client, 50, 50)
        deadline = time.monotonic() + 180
        while int(client.hget(STATS_KEY, "events_in") or 0) < acked:
            assert time.monotonic() < deadline, (client.hget(STATS_KEY, "events_in"), acked)
            time.sleep(0.2)
        health = pipeline_health(client, int(time.time() * 1000))
        assert health["restarts"] >= 1
        deadline = time.monotonic() + 30
        while pipeline_health(client, int(time.time() * 1000))["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert p.wait_idle(60)
        stats = {k.decode(): v.decode() for k, v in client.hgetall(STATS_KEY).items()}
        # Exactly once: every acknowledged event, no more, and every batch balanced.
        assert int(stats["events_in"]) == acked
        assert int(stats["audit_ok"]) == int(stats["batches"])
        stored = 0
        for key in client.scan_iter(match="sluice:s:{txn_count|*"):
            stored += sum(
                int(v.split(b":")[1]) for f, v in client.hgetall(key).items() if f != b"_m"
            )
        assert stored == acked
    finally:
        p.request_stop()
        runner.join(60)
        server.stop()
