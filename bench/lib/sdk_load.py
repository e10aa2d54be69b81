"""Load through the Producer SDK (so through the ingest valve), counting every event's fate.

`ProfileProducer` offers a rate profile from one thread. Its accounting, in events:

    offered = generated + held_back + lagged (+ less than one event still owed)
    generated = acked + rejected + unsent

- held_back: owed while the producer was throttled, never generated (a real client slowing down);
- lagged: owed while the producer's own thread fell more than a second behind (CPU starved);
- acked: Redis answered the XADD with an id; rejected: Redis answered with an error (e.g. OOM),
  so the client saw the failure ("lost at the door"); unsent: still buffered when the run ended.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from lib.load import TICK_S, now_ms
from sluice.config import Config
from sluice.errors import BackpressureError
from sluice.source.admission import ingest_valve
from sluice.source.loadgen import EventGenerator, produce_frame
from sluice.source.producer import Producer

FINAL_FLUSH_S = 30.0  # how long the producer may block to deliver what it made, at the end


@dataclass(frozen=True)
class LoadProfile:
    """`low_per_s` for `before_s`, `high_per_s` for `burst_s`, then `low_per_s` for `after_s`."""

    low_per_s: float
    high_per_s: float
    before_s: float
    burst_s: float
    after_s: float

    @property
    def burst_end_s(self) -> float:
        return self.before_s + self.burst_s

    @property
    def total_s(self) -> float:
        return self.before_s + self.burst_s + self.after_s

    def rate_at(self, t_s: float) -> float:
        if t_s < 0 or t_s >= self.total_s:
            return 0.0
        return self.high_per_s if self.before_s <= t_s < self.burst_end_s else self.low_per_s


def _count(errors: dict[str, int], err: BaseException) -> None:
    """Tally an error by the first line of its message."""
    key = str(err).split("\n")[0][:120]
    errors[key] = errors.get(key, 0) + 1


@dataclass
class Counts:
    offered: float = 0.0
    generated: int = 0
    held_back: float = 0.0
    lagged: float = 0.0
    acked: int = 0
    rejected: int = 0
    reject_errors: dict[str, int] = field(default_factory=dict)  # error reply -> times
    throttled_flushes: int = 0  # flushes that raised BackpressureError
    valve_errors: dict[str, int] = field(default_factory=dict)  # errors raised by the valve
    unsent: int = 0


class AckClient:
    """Wraps a redis-py client for `Producer`: its pipelines read every XADD's reply, an id
    counting the entry's events as acked, an error reply as rejected. Replies are not raised, so
    one refused entry does not hide which others were taken; other commands pass through."""

    def __init__(self, client: Any, counts: Counts) -> None:
        self.client, self.counts, self.lock = client, counts, threading.Lock()

    def pipeline(self, transaction: bool = False) -> Any:
        pipe, events, ack = self.client.pipeline(transaction=transaction), [], self

        class Pipe:
            def xadd(self, name: Any, fields: Mapping[Any, Any], **kw: Any) -> None:
                pipe.xadd(name, fields, **kw)
                events.append(int(fields.get("n", 1)))  # jsonl: `n` events; fields: one

            def __getattr__(self, name: str) -> Any:
                events.append(None)  # queued by the producer for itself: not counted
                return getattr(pipe, name)

            def execute(self) -> list[Any]:
                replies: list[Any] = pipe.execute(raise_on_error=False)
                with ack.lock:
                    for n, reply in zip(events, replies, strict=True):
                        if n is not None and isinstance(reply, Exception):
                            ack.counts.rejected += n
                            _count(ack.counts.reject_errors, reply)
                        elif n is not None:
                            ack.counts.acked += n
                events.clear()
                return replies

        return Pipe()


class ProfileProducer(threading.Thread):
    """Offers `profile` from wall time `t0_ms` through `Producer.from_config` (flow-controlled,
    `block_timeout_s` per flush) like `loadgen.run_load`: owes events for the time that passed
    (at most 1 s worth), holds back what was owed while a flush is throttled, and at the end
    blocks up to FINAL_FLUSH_S to deliver what it made. `series` gets (t_s, offered, acked) per
    tick; `error` holds an exception that ended the thread early."""

    def __init__(self, cfg: Config, client: Any, profile: LoadProfile, seed: int,
                 block_timeout_s: float, t0_ms: int) -> None:  # fmt: skip
        super().__init__(name="bench-profile-producer", daemon=True)
        self.profile, self.t0_ms, self.counts = profile, t0_ms, Counts()
        # The valve talks to Redis on the plain client; only the XADDs go through AckClient.
        self.producer = Producer.from_config(cfg, AckClient(client, self.counts),
                                             valve=ingest_valve(cfg, client),
                                             block_timeout_s=block_timeout_s)  # fmt: skip
        # No late events: an event's time is when it was made, so freshness is produce → stored.
        self.gen = EventGenerator(cfg, seed=seed, late_fraction=0.0)
        self.series: list[tuple[float, float, int]] = []
        self.error: BaseException | None = None

    def failed(self) -> bool:
        """True if the thread died of something other than the server going away (a bug: the
        run must not be reported)."""
        lost_server = (OSError, redis.ConnectionError, redis.TimeoutError)
        return self.error is not None and not isinstance(self.error, lost_server)

    def run(self) -> None:
        try:
            self._offer()
            deadline = time.monotonic() + FINAL_FLUSH_S
            while self.producer.pending() and time.monotonic() < deadline:
                self._flush()
                if self.producer.pending():
                    time.sleep(TICK_S)
            self.series.append((self._t_s(), self.counts.offered, self.counts.acked))
        except Exception as e:  # noqa: BLE001 - handed to the caller (see `failed`)
            self.error = e
        finally:
            self.counts.unsent = self.producer.pending()
            if self.producer.valve is not None:
                self.producer.valve.close()

    def _t_s(self) -> float:
        return (now_ms() - self.t0_ms) / 1000

    def _flush(self, frame: Any = None) -> None:
        """One bounded flush (of `frame`'s events, if given); throttling and the valve's own
        Redis errors leave the buffer."""
        try:
            if frame is None:
                self.producer.flush()
            else:
                produce_frame(self.producer, frame, self.producer.shard_by)
        except BackpressureError:
            self.counts.throttled_flushes += 1
        except redis.ResponseError as e:  # e.g. OOM on the valve's state write
            _count(self.counts.valve_errors, e)

    def _offer(self) -> None:
        c, owed, last = self.counts, 0.0, self._t_s()
        while (t := self._t_s()) < self.profile.total_s:
            rate = self.profile.rate_at(t)
            due = rate * max(0.0, t - last)
            c.offered, owed, last = c.offered + due, owed + due, t
            if owed > rate:  # a tick that came more than a second late: give up the excess
                c.lagged, owed = c.lagged + owed - rate, rate
            if self.producer.pending():
                self._flush()
                c.held_back, owed = c.held_back + owed, 0.0  # throttled: not generated
            elif (n := math.floor(owed)) > 0:
                owed, c.generated = owed - n, c.generated + n
                self._flush(self.gen.frame(n, now_ms()))
            self.series.append((t, c.offered, c.acked))
            time.sleep(max(0.0, (math.floor(t / TICK_S) + 1) * TICK_S - self._t_s()))
