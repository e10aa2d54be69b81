"""A leader whose Spark driver JVM stops answering (SIGSTOP of `java` alone, a long pause) lets
its lease lapse, so a standby takes over: the lease is renewed by the Python process, which
alone would keep it for ever (`standby.JvmProbe`). The JVM stopped is a driver JVM of the test's
own (Spark's py4j gateway, started as a session starts it), not the suite's shared session's:
other tests' queries and workers must not see their JVM freeze."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pyspark.java_gateway import launch_gateway

from sluice.pipeline.lease import Claim, Keeper, Lease
from sluice.pipeline.standby import JvmProbe
from tests.conftest import wait_until

TTL_MS = 2_000  # the default


@pytest.fixture
def gateway() -> Iterator[Any]:
    """A driver JVM of its own, with py4j's gateway to it."""
    gw = launch_gateway()
    try:
        yield gw
    finally:
        os.kill(gw.proc.pid, signal.SIGCONT)
        gw.shutdown()
        gw.proc.kill()
        gw.proc.wait(30)


def test_a_leader_whose_jvm_stops_answering_lets_its_lease_lapse(
    gateway: Any, r: redis.Redis, tmp_path: Path
) -> None:
    claims = [Claim("spark", tmp_path / "checkpoint")]
    leader, standby = Lease(r, claims, TTL_MS, pid=1), Lease(r, claims, TTL_MS, pid=2)
    assert leader.try_acquire() is None
    probe = JvmProbe(gateway.jvm, leader.renew_every_s, TTL_MS / 1000)
    probe.start()
    reasons: list[str] = []
    keeper = Keeper(leader, reasons.append, probe.stalled)
    keeper.start()
    jvm = gateway.proc.pid
    try:
        end = time.monotonic() + 3 * TTL_MS / 1000  # answering: renewed, several ttls long
        while time.monotonic() < end:
            assert standby.try_acquire() is not None
            time.sleep(0.1)
        assert not reasons and probe.stalled() is None
        os.kill(jvm, signal.SIGSTOP)
        try:
            # about twice the ttl: the JVM's limit (the ttl), then the lease's own ttl
            wait_until(lambda: standby.try_acquire() is None, 20, "the standby to take over")
            assert reasons and "JVM has not answered for over 2 s" in reasons[0], reasons
            assert leader.lost.is_set()
        finally:
            os.kill(jvm, signal.SIGCONT)
        wait_until(lambda: probe.stalled() is None, 30, "the JVM to answer again")
    finally:
        os.kill(jvm, signal.SIGCONT)
        keeper.stop()
        probe.stop()
        standby.release()
        leader.release()
