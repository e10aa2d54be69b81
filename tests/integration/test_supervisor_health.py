"""The supervisor's failure count, per query: one query that crash-loops makes the pipeline
`failing`, even while another query idles along (its idle progress used to reset the shared
count on every pass, so the state flipped between `restarting` and `running` for ever). The
queries here stand in for Spark's (the supervisor sees only `isActive`, `lastProgress` and
`exception()`); the health it publishes goes to a real Redis."""

from __future__ import annotations

import threading
from typing import Any

import redis

from sluice.clock import SYSTEM_CLOCK
from sluice.pipeline.supervisor import Supervisor
from sluice.redis.keys import HEALTH_KEY
from tests.conftest import wait_until


class _Query:
    def __init__(self, active: bool) -> None:
        self.isActive = active
        self.lastProgress = {"numInputRows": 0} if active else None

    def exception(self) -> Exception | None:
        return None if self.isActive else RuntimeError("the store refused the batch")

    def awaitTermination(self, timeout: float) -> bool:
        return not self.isActive


class _Part:
    def __init__(self, name: str, healthy: bool) -> None:
        self.name, self.healthy, self.query = name, healthy, None
        self.starts = 0

    def start(self) -> Any:
        self.starts += 1
        self.query = _Query(self.healthy)
        return self.query

    def stop(self, grace_s: float = 15.0) -> None:
        self.query = None


def test_a_crash_looping_query_makes_the_pipeline_failing_beside_an_idle_one(
    r: redis.Redis,
) -> None:
    broken, idle = _Part("broken", healthy=False), _Part("idle", healthy=True)
    stop = threading.Event()
    sup = Supervisor([broken, idle], r, SYSTEM_CLOCK, stop)
    runner = threading.Thread(target=sup.run_forever, kwargs={"max_backoff_s": 0.2}, daemon=True)
    runner.start()
    try:
        wait_until(lambda: r.hget(HEALTH_KEY, "state") == b"failing", 30, "failing")
        assert broken.starts >= 3 and idle.starts == 1
    finally:
        stop.set()
        runner.join(30)
    assert not runner.is_alive()
