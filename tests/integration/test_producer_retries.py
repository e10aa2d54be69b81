"""A flush whose reply never came, retried: each event is in the log once. A real embedded
Redis, paused (SIGSTOP) past the client's timeout while the flush is in flight, so that it runs
the write after the client gave up on it, then the retry's too."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from sluice.redis.embedded import EmbeddedRedis
from sluice.source.producer import Producer


def _events(n: int, start: int = 0) -> list[dict[str, object]]:
    return [{"ts": 1, "card": f"c{i}", "amount": 1.0} for i in range(start, start + n)]


@pytest.mark.parametrize("format", ["jsonl", "fields"])
def test_a_flush_retried_after_a_timeout_writes_each_event_once(
    tmp_path: Path, format: str
) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    assert server.pid is not None
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    producer = Producer(client, "events", shards=2, format=format, shard_by="card",
                        batch_events=50)  # fmt: skip
    keys = producer.keys
    try:
        producer.buffer_all(_events(300))
        producer.flush()  # connected, and the script loaded (the first try found none)
        assert client.hget("sluice:{stats}", "events_produced") == b"300"  # counted once
        producer.buffer_all(_events(300, start=1000))
        os.kill(server.pid, signal.SIGSTOP)
        try:
            for _ in range(2):  # sent, unanswered; sent again, unanswered: both run later
                with pytest.raises(redis.TimeoutError):
                    producer.flush()
            producer.buffer_all(_events(20, start=300))  # buffered between the tries
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert producer.flush() == 320  # the 300 sent twice and the 20
        assert producer.pending() == 0
        if format == "jsonl":
            stored = sum(int(f[b"n"]) for k in keys for _, f in client.xrange(k))
        else:
            stored = sum(client.xlen(k) for k in keys)
        assert stored == 620
        cards = [f[b"card"] if format == "fields" else None for k in keys
                 for _, f in client.xrange(k)]  # fmt: skip
        if format == "fields":
            assert len(set(cards)) == 620
        # The producer's marks expire on their own; nothing else is left beside the streams
        left = {k.decode() for k in client.keys("*")} - set(keys) - {"sluice:{stats}"}
        assert all(k.startswith("sluice:produced:") for k in left), left
        assert all(0 < client.ttl(k) <= 3600 for k in left)
    finally:
        client.close()
        server.stop()
