"""The load generator (`sluice produce`) through a Redis that stops answering: the events made
are kept and retried, so a short outage loses nothing and repeats nothing, and a long one ends
the load with what it wrote and what it did not. A real embedded Redis, killed and started
again."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import redis

from sluice.redis.embedded import EmbeddedRedis
from sluice.source.loadgen import run_load
from tests.conftest import make_config


def _events_in_log(client: redis.Redis, keys: list[str]) -> int:
    """Events the streams hold (each `jsonl` entry says how many it carries)."""
    return sum(int(f[b"n"]) for k in keys for _, f in client.xrange(k))


def _kill(server: EmbeddedRedis) -> None:
    assert server.pid is not None and server.proc is not None
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait()


Loading = tuple[threading.Thread, dict[str, Any]]


def _load(cfg: Any, client: redis.Redis, duration_s: float, **kw: Any) -> Loading:
    out: dict[str, Any] = {}
    seen: list[dict[str, Any]] = []

    def run() -> None:
        out.update(run_load(cfg, client, 2000, duration_s, progress=seen.append, **kw))
        out["progress"] = seen

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_short_outage_loses_nothing(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    cfg = make_config(server.url, tmp_path / "state")
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=1)
    try:
        loader, out = _load(cfg, client, 6.0)
        time.sleep(1.5)
        _kill(server)
        server.stop()  # lets go of it (its use lock): the one started next is the last user
        time.sleep(2.5)  # over a second's progress: it says Redis is down
        server = EmbeddedRedis(tmp_path / "redis", port=server.port, appendfsync="always").start()
        loader.join(60)
        assert not loader.is_alive()
        assert out["error"] is None and out["unsent"] == 0, out
        assert any("redis_down" in p for p in out["progress"]), out["progress"]
        assert out["events"] > 0
        # Exact: a write the kill cut short, if it landed unacknowledged, is skipped when sent
        # again (`produce.lua`)
        assert _events_in_log(client, cfg.source.shard_keys()) == out["events"], out
    finally:
        server.stop()


def test_a_long_outage_ends_the_load_with_what_it_wrote(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    cfg = make_config(server.url, tmp_path / "state")
    client = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=1)
    try:
        loader, out = _load(cfg, client, 60.0, outage_s=2.0)
        time.sleep(1.5)
        _kill(server)
        server.stop()  # lets go of it (its use lock): the one started next is the last user
        loader.join(30)  # long before the duration: the outage ends it
        assert not loader.is_alive()
        assert out["error"] is not None and "Redis did not answer for 2s" in out["error"], out
        assert out["unsent"] > 0, out  # made, kept, and reported: not written later
        server = EmbeddedRedis(tmp_path / "redis", port=server.port, appendfsync="always").start()
        extra = _events_in_log(client, cfg.source.shard_keys()) - out["events"]
        assert 0 <= extra <= out["unsent"], (extra, out)  # a cut write that landed: not sent
    finally:
        server.stop()
