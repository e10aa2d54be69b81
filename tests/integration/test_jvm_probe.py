"""A leader whose Spark driver JVM stops answering (SIGSTOP of `java` alone, a long pause) lets
its lease lapse, so a standby takes over: the lease is renewed by the Python process, which
alone would keep it for ever (`standby.JvmProbe`). The real JVM of the suite's Spark session
is stopped for a few seconds, and continued."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import redis
from pyspark import SparkContext

from sluice.pipeline.lease import Claim, Keeper, Lease
from sluice.pipeline.standby import JvmProbe
from tests.conftest import wait_until

TTL_MS = 2_000  # the default


def test_a_leader_whose_jvm_stops_answering_lets_its_lease_lapse(
    spark: Any, r: redis.Redis, tmp_path: Path
) -> None:
    claims = [Claim("spark", tmp_path / "checkpoint")]
    leader, standby = Lease(r, claims, TTL_MS, pid=1), Lease(r, claims, TTL_MS, pid=2)
    assert leader.try_acquire() is None
    probe = JvmProbe(spark, leader.renew_every_s, TTL_MS / 1000)
    probe.start()
    reasons: list[str] = []
    keeper = Keeper(leader, reasons.append, probe.stalled)
    keeper.start()
    jvm = SparkContext._gateway.proc.pid  # type: ignore[union-attr]
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
