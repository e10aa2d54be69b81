"""The Kafka log's group commits, on a thread of their own.

A synchronous commit blocks while the group coordinator cannot be found (librdkafka waits for it
up to the client's `session.timeout.ms`, 45 s by default), and the thread that releases a batch
is the batch's. So `KafkaLog.release` keeps the offsets in Redis itself (fast, and Redis stays
the truth) and hands the readers' floor to a `Committer`: one thread per log object, the only
user of its client (a confluent-kafka consumer is not safe to share between threads).

- A newer offer supersedes an older one, and offsets only move forward, but in a partition
  read again from its start (a reset). A commit or a floor read that was in flight across a
  reset of its partition is not kept for it: it would put the old, higher offset back.
- After each commit the floor is taken from Redis again, and committed again where it moved:
  readers commit from their own clients and the broker keeps whichever commit lands last, so
  the last commit to land is never behind Redis.
- A failed commit is tried again after a backoff (`FIRST_BACKOFF_S`, doubling up to
  `MAX_BACKOFF_S`) with no batch needed, so the group of an idle topic catches up too. One
  warning opens a run of failures, one info line ends it.
- `close` lets a due commit go, waits at most `CLOSE_WAIT_S`, and abandons a commit still in
  flight: the thread closes its client when that commit returns (within `COMMIT_TIMEOUT_S`).
  Nothing is lost: the offsets in Kafka only say how far Sluice got; Redis decides what is read.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from sluice.graph import KafkaSpec

log = logging.getLogger(__name__)

COMMIT_TIMEOUT_S = 10.0  # how long one commit waits for the coordinator (`session.timeout.ms`)
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
CLOSE_WAIT_S = 2.0


class Committer:
    """Commits offers to `spec.group_id` from a daemon thread (see the module docstring).
    `floors` takes the readers' floor per partition from Redis again; the thread calls it after
    each commit, and retries it as it retries a commit."""

    def __init__(
        self,
        spec: KafkaSpec,
        floors: Callable[[], Mapping[int, int]],
        timeout_s: float = COMMIT_TIMEOUT_S,
        first_backoff_s: float = FIRST_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.failures = 0  # failed tries in a row; 0 once a commit lands
        self._floors = floors
        self._cond = threading.Condition()
        self._wanted: dict[int, int] = {}
        self._committed: dict[int, int] = {}
        self._resets: dict[int, int] = {}  # partition -> resets so far
        self._check = False  # a commit landed, and the floor was not taken again since
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="sluice-kafka-commits", daemon=True)
        self._thread.start()

    def offer(self, offsets: Mapping[int, int], reset: Collection[int] = ()) -> None:
        """Have `offsets` (partition -> offset) committed; returns at once. Offsets only move
        forward, but in the `reset` partitions (read again from their start)."""
        with self._cond:
            for p in reset:
                self._wanted.pop(p, None)
                self._committed.pop(p, None)
                self._resets[p] = self._resets.get(p, 0) + 1
            self._merge(offsets)
            self._cond.notify_all()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> bool:
        """Stop the thread: a due commit still goes, a failed one is not tried again. Waits at
        most `wait_s`; False when a commit was still in flight and is abandoned."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _merge(self, offsets: Mapping[int, int], since: Mapping[int, int] | None = None) -> None:
        """Raise the wanted offsets to `offsets`; with `since` (the resets when they were read),
        not in a partition reset after that."""
        for p, o in offsets.items():
            if since is not None and self._resets.get(p, 0) != since.get(p, 0):
                continue
            if o > self._wanted.get(p, -1):
                self._wanted[p] = o

    def _due(self) -> dict[int, int]:
        return {p: o for p, o in self._wanted.items() if o > self._committed.get(p, -1)}

    def _run(self) -> None:
        client: Any = None
        delay_s = self.first_backoff_s
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._closing or self._check or bool(self._due()))
                    due, since = self._due(), dict(self._resets)
                    if (self._closing and self.failures) or not (due or self._check):
                        return
                try:
                    if client is None:
                        client = self._client()
                    self._step(client, due, since)
                except Exception as e:  # noqa: BLE001 - librdkafka and Redis errors alike: retried
                    self._failed(e, delay_s)
                    with self._cond:
                        self._cond.wait_for(lambda: self._closing, delay_s)
                    delay_s = min(delay_s * 2, self.max_backoff_s)
                    continue
                if self.failures:
                    extra = {"group_id": self.spec.group_id, "failures": self.failures}
                    log.info("kafka offsets committed again", extra=extra)
                    self.failures = 0
                delay_s = self.first_backoff_s
        finally:
            if client is not None:
                try:
                    client.close()
                except Exception:
                    log.debug("committer close failed", exc_info=True)

    def _client(self) -> Any:
        return Consumer(
            self.spec.client_config(
                **{
                    "group.id": self.spec.group_id,
                    "enable.auto.commit": False,
                    "session.timeout.ms": max(1, round(self.timeout_s * 1000)),
                }
            )
        )

    def _step(self, client: Any, due: dict[int, int], since: dict[int, int]) -> None:
        """Commit `due`, taken when the resets were `since` (blocks up to `timeout_s`), then
        take the floor again."""
        if due:
            tps = [TopicPartition(self.spec.topic, p, o) for p, o in sorted(due.items())]
            got = client.commit(offsets=tps, asynchronous=False) or []
            bad = {tp.partition: tp.error for tp in got if tp.error is not None}
            with self._cond:
                self._committed.update({p: o for p, o in due.items() if p not in bad
                                        and self._resets.get(p, 0) == since.get(p, 0)})  # fmt: skip
                self._check = True
            if bad:
                raise KafkaException(next(iter(bad.values())))
        with self._cond:
            since = dict(self._resets)
        low = self._floors()
        with self._cond:
            self._check = False
            self._merge(low, since)

    def _failed(self, e: Exception, delay_s: float) -> None:
        self.failures += 1
        extra = {"group_id": self.spec.group_id, "error": str(e), "retry_s": delay_s}
        if self.failures == 1:
            log.warning("kafka offsets not committed; trying again in the background", extra=extra)
        else:
            log.debug("kafka offsets still not committed", extra={**extra, "tries": self.failures})
