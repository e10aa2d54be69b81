"""The supervisor: seed 001's two-stage fault handling, for every streaming query of a run.

A query that fails is restarted from its checkpoint with exponential backoff (1 s doubling up to
`max_backoff_s`), on its own: the other stages keep running. While Redis is unreachable nothing
is started; everything starts again as soon as it answers. The state is published for
`/healthz` and `sluice status`: `running`, `restarting`, `waiting_for_redis`, `failing`
(FAILING_AFTER or more failures in a row of one query) or `stopped`. Each query counts its own
failures in a row, and its own progress since its restart (a batch, or an idle trigger) resets
its count: the state is `running` again once no query has any. A query that stops while Redis
does not answer is waited for (`waiting_for_redis`), not counted.

Under a leadership lease (`pipeline.lease`) the supervisor runs only while its process leads:
once the lease is lost it stops every query at once (a batch in flight fails its lease check
and is not committed) and returns, leaving the published state to the new leader.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from sluice.clock import Clock
from sluice.pipeline.health import Health, Progress
from sluice.pipeline.lease import Lease

log = logging.getLogger(__name__)


class Part(Protocol):
    """One streaming query (`pipeline.query.StreamQuery`): a fold or a stage."""

    name: str
    query: Any

    def start(self) -> Any: ...

    def stop(self, grace_s: float = 15.0) -> None: ...


class Supervisor:
    def __init__(
        self,
        parts: Sequence[Part],
        client: Any,
        clock: Clock,
        stop: threading.Event | None = None,
        lease: Lease | None = None,
        restarts: int = 0,
    ) -> None:
        self.parts = list(parts)
        self.restarts = restarts  # the process's query restarts so far (its earlier terms')
        self.client = client
        self.clock = clock
        self.lease = lease
        self._stop = stop or threading.Event()
        self._backoff = {p.name: 1.0 for p in self.parts}
        self._failures = {p.name: 0 for p in self.parts}  # each query's, in a row
        self._start_at = {p.name: 0.0 for p in self.parts}

    def request_stop(self) -> None:
        self._stop.set()

    def leading(self) -> bool:
        return self.lease is None or not self.lease.lost.is_set()

    def run_forever(self, max_backoff_s: float = 15.0) -> None:
        """Run every query until `request_stop()` (or the lease is lost); then stop them."""
        health = Health(self.client, self.clock, self.lease is not None, self.restarts)
        try:
            self._supervise(health, max_backoff_s)
        finally:
            self.restarts = health.restarts

    def _supervise(self, health: Health, max_backoff_s: float) -> None:
        health.set("starting")
        progress = Progress(self.client)
        while not self._stop.is_set() and self.leading():
            progress.maybe_log()
            if any(p.query is None for p in self.parts) and not self._redis_up():
                health.set("waiting_for_redis", "redis is unreachable")
                self._stop.wait(1.0)
                continue
            for part in self.parts:
                if self._stop.is_set() or not self.leading():
                    break
                if part.query is None:
                    self._start(part, health, max_backoff_s)
                else:
                    self._watch(part, health, max_backoff_s)
            running = [p for p in self.parts if p.query is not None]
            if len(running) == len(self.parts):
                health.beat()
            if len(self.parts) == 1 and running:
                self._await(running[0])
            else:
                self._stop.wait(0.5)
        if not self.leading():
            for part in reversed(self.parts):
                part.stop(grace_s=0.0)
            return
        for part in reversed(self.parts):
            part.stop()
        health.set("stopped")

    def _start(self, part: Part, health: Health, max_backoff_s: float) -> None:
        if time.monotonic() < self._start_at[part.name]:
            return
        try:
            part.start()
            health.set("running" if health.failures == 0 else health.state)
        except Exception as e:  # noqa: BLE001 - start errors are retried like failures
            if self._stop.is_set():  # the stop's own doing (the JVM went with the signal)
                return
            self._failed(part, health, f"start failed: {e}", max_backoff_s)

    def _await(self, part: Part) -> None:
        """One query: wait on it for a second rather than poll (returns early when it ends)."""
        with contextlib.suppress(Exception):  # StreamingQueryException: seen in _watch
            part.query.awaitTermination(1)

    def _watch(self, part: Part, health: Health, max_backoff_s: float) -> None:
        q = part.query
        if q.isActive:
            # Progress since this (re)start: a batch ran, or an idle trigger found nothing to
            # read (a batch that failed before runs again first, so a fault that persists never
            # gets this far). Either way the query works: after an outage with no input since,
            # the state went on saying `failing` until an event came.
            p = q.lastProgress
            if p:
                if p.get("numInputRows", 0) > 0:
                    self._backoff[part.name] = 1.0
                self._failures[part.name] = 0  # its own progress only: a query that idles
                if not any(self._failures.values()):  # must not hide one that crash-loops
                    health.recovered()
            return
        err = q.exception()
        part.query = None
        if self._stop.is_set() or not self.leading():
            return
        error = str(err).splitlines()[0] if err else "query stopped"
        if not self._redis_up():  # the store went away under it: not the query's failure (a
            # plan with five queries was `failing` on one outage); the loop waits for Redis
            log.warning("query stopped: redis is unreachable; waiting for it",
                        extra={"stage": part.name, "error": error})  # fmt: skip
            health.waiting_for_redis()
            return
        self._failed(part, health, error, max_backoff_s)

    def _failed(self, part: Part, health: Health, error: str, max_backoff_s: float) -> None:
        backoff = self._backoff[part.name]
        self._failures[part.name] += 1
        health.failed(error, max(self._failures.values()))
        log.error("query failed", extra={"stage": part.name, "error": error,
                                         "retry_in_s": backoff})  # fmt: skip
        self._start_at[part.name] = time.monotonic() + backoff
        self._backoff[part.name] = min(backoff * 2, max_backoff_s)

    def _redis_up(self) -> bool:
        try:
            self.client.ping()
        except Exception:  # noqa: BLE001 - any failure means not reachable
            return False
        return True
