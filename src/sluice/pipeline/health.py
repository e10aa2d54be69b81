"""The supervisor's published state, and its periodic progress line.

`Health` keeps `sluice:{stats}:health` (state, failures in a row, restarts, last error,
heartbeat) for `/healthz`, `/v1/status` and `sluice status`, and logs every change of state:
INFO for running and stopped, WARNING while restarting or waiting for Redis, ERROR once
failing. `Progress` logs what the pipeline did since its last line.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sluice.clock import Clock
from sluice.redis.keys import HEALTH_KEY, STATS_KEY

log = logging.getLogger(__name__)

FAILING_AFTER = 3
PROGRESS_EVERY_S = 60.0
_STATE_LEVEL = {
    "restarting": logging.WARNING,
    "waiting_for_redis": logging.WARNING,
    "failing": logging.ERROR,
}


class Progress:
    """An INFO line every PROGRESS_EVERY_S while `sluice run` runs: what was done since the last
    one. (Each batch is logged at DEBUG only: at two batches a second that would drown the
    rest.)"""

    def __init__(self, client: Any, every_s: float = PROGRESS_EVERY_S) -> None:
        self.client = client
        self.every_s = every_s
        self.next_s = time.monotonic()  # the first call takes the baseline
        self.last: dict[str, int] | None = None

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now < self.next_s:
            return
        self.next_s = now + self.every_s
        names = ("batches", "events_in", "dead_letters", "audit_failed")
        try:
            raw = self.client.hmget(STATS_KEY, list(names))
        except Exception:  # noqa: BLE001 - the supervisor reports Redis outages itself
            return
        cur = {n: int(v or 0) for n, v in zip(names, raw, strict=True)}
        prev, self.last = self.last, cur
        if prev is None:
            return
        log.info(
            "progress",
            extra={
                "batches": cur["batches"] - prev["batches"],
                "events": cur["events_in"] - prev["events_in"],
                "dead_letters": cur["dead_letters"] - prev["dead_letters"],
                "audit_failed": cur["audit_failed"] - prev["audit_failed"],
                "events_per_s": round((cur["events_in"] - prev["events_in"]) / self.every_s, 1),
                "total_events": cur["events_in"],
            },
        )


class Health:
    """The supervisor's state in Redis (`sluice:{stats}:health`). Writes never raise: a Redis
    outage is itself a state the supervisor lives through."""

    def __init__(self, client: Any, clock: Clock, leased: bool = False, restarts: int = 0) -> None:
        self.client = client
        self.clock = clock
        self.leased = leased  # runs under a lease (`sluice run`), which status then reads too
        self.state = "starting"
        self.failures = 0
        self.restarts = restarts  # this process's, over its terms as leader: a counter
        self.last_error: str | None = None

    def set(self, state: str, error: str | None = None) -> None:
        changed = state != self.state
        self.state = state
        if error is not None:
            self.last_error = error
        if changed:
            fields: dict[str, Any] = {"state": state, "restarts": self.restarts}
            if state not in ("running", "starting", "stopped") and self.last_error:
                fields["error"] = self.last_error
            log.log(_STATE_LEVEL.get(state, logging.INFO), "pipeline state", extra=fields)
        self._write(changed)

    def failed(self, error: str, in_a_row: int | None = None) -> None:
        """A query failed; `in_a_row`: the most failures in a row of any one query (the
        supervisor counts per query), else one more than before."""
        self.failures = self.failures + 1 if in_a_row is None else in_a_row
        self.restarts += 1
        self.set("failing" if self.failures >= FAILING_AFTER else "restarting", error)

    def waiting_for_redis(self) -> None:
        """A query stopped because Redis went away: it is started again once Redis answers
        (a restart), and it is no failure of its own."""
        self.restarts += 1
        self.set("waiting_for_redis", "redis is unreachable")

    def recovered(self) -> None:
        if self.failures or self.state != "running":
            self.failures = 0
            self.set("running")

    def beat(self) -> None:
        self._write(False)

    def _write(self, changed: bool) -> None:
        now = self.clock.now_ms()
        fields: dict[str, Any] = {
            "state": self.state,
            "consecutive_failures": self.failures,
            "restarts": self.restarts,
            "last_error": self.last_error or "",
            "heartbeat_ms": now,
            "leased": int(self.leased),
        }
        if changed:
            fields["changed_ms"] = now
        try:
            self.client.hset(HEALTH_KEY, mapping=fields)
        except Exception as e:  # noqa: BLE001 - Redis may be the thing that is down
            log.debug("could not publish health", extra={"error": str(e)})
