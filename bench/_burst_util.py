"""Helpers for bench/burst.py: the offered-load profile, a producer that counts every event's
fate, and the statistics of a run (admitted rate, oscillation, drain time, freshness).

Event accounting in `ProfileProducer` (all in events):

    offered = generated + held_back + lagged (+ less than one event still owed)
    generated = acked + rejected + unsent

- held_back: owed while the producer was throttled, never generated (a real client slowing down);
- lagged: owed while the producer's own thread fell more than a second behind (CPU starved);
- acked: Redis answered the XADD with an id; rejected: Redis answered with an error (e.g. OOM),
  so the client saw the failure ("lost at the door"); unsent: still buffered when the run ended.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from _util import percentile
from sluice.config import Config
from sluice.errors import BackpressureError
from sluice.flow.valves import IngestValve
from sluice.redis.keys import SLICE_PREFIX
from sluice.source.loadgen import EventGenerator, produce_frame
from sluice.source.producer import Producer

TICK_S = 0.05  # the producer's pace, as `sluice.source.loadgen.run_load`
FINAL_FLUSH_S = 30.0  # how long the producer may block to deliver what it made, at the end


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- the offered load -------------------------------------------------------------------------


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


# -- a producer that knows which events Redis took ------------------------------------------


@dataclass
class Tally:
    acked: int = 0
    rejected: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # error reply (first line) -> times


def _count(errors: dict[str, int], err: BaseException) -> None:
    """Tally an error by the first line of its message (plain dicts: they survive `asdict`)."""
    key = str(err).split("\n")[0][:120]
    errors[key] = errors.get(key, 0) + 1


class _AckPipeline:
    """A redis-py pipeline for `Producer.flush` that reads every XADD's reply: an id counts its
    events as acked, an error reply as rejected. Replies are not raised, so one refused entry
    does not hide which others were taken. Any other queued command (e.g. the producer's own
    counter) passes through, its reply ignored."""

    def __init__(self, pipe: Any, tally: Tally, lock: threading.Lock) -> None:
        self._pipe = pipe
        self._tally = tally
        self._lock = lock
        self._events: list[int | None] = []  # per queued command: XADD events, else None

    def xadd(self, name: Any, fields: Mapping[Any, Any], **kw: Any) -> None:
        self._pipe.xadd(name, fields, **kw)
        self._events.append(int(fields.get("n", 1)))  # jsonl: `n` events; fields: one

    def __getattr__(self, name: str) -> Any:
        command = getattr(self._pipe, name)

        def queue(*args: Any, **kw: Any) -> Any:
            self._events.append(None)
            return command(*args, **kw)

        return queue

    def execute(self) -> list[Any]:
        replies: list[Any] = self._pipe.execute(raise_on_error=False)
        with self._lock:
            for n, reply in zip(self._events, replies, strict=True):
                if n is None:
                    continue
                if isinstance(reply, Exception):
                    self._tally.rejected += n
                    _count(self._tally.errors, reply)
                else:
                    self._tally.acked += n
        self._events = []
        return replies


class AckClient:
    """Wraps a redis-py client for `Producer`: its pipelines count acked and rejected events."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.tally = Tally()
        self.lock = threading.Lock()

    def pipeline(self, transaction: bool = False) -> _AckPipeline:
        return _AckPipeline(self.client.pipeline(transaction=transaction), self.tally, self.lock)


@dataclass
class ProducerCounts:
    offered: float = 0.0
    generated: int = 0
    held_back: float = 0.0
    lagged: float = 0.0
    throttled_flushes: int = 0  # flushes that raised BackpressureError
    valve_errors: dict[str, int] = field(default_factory=dict)  # errors raised by the valve
    unsent: int = 0


class ProfileProducer(threading.Thread):
    """Offers `profile` through `Producer.from_config` (flow-controlled, `block_timeout_s` per
    flush) from one thread, starting at wall time `t0_ms`; stops by itself after the profile.

    Like `sluice.source.loadgen.run_load`: owes events for the real time that passed (at most
    one second's worth); while a flush is throttled nothing new is generated and what was owed
    meanwhile is held back. At the end it blocks up to FINAL_FLUSH_S to deliver what it made.
    `series` gets (t_s, offered, acked) after every tick, for rates over time; `error` holds an
    exception that ended the thread early (e.g. the server went away).
    """

    def __init__(
        self,
        cfg: Config,
        client: Any,
        profile: LoadProfile,
        seed: int,
        block_timeout_s: float,
        t0_ms: int,
    ) -> None:
        super().__init__(name="bench-burst-producer", daemon=True)
        self.cfg = cfg
        self.profile = profile
        self.t0_ms = t0_ms
        self.ack = AckClient(client)
        # The valve talks to Redis on the plain client; only the XADDs go through AckClient.
        self.producer = Producer.from_config(
            cfg,
            self.ack,
            valve=IngestValve.from_config(cfg, client),
            block_timeout_s=block_timeout_s,
        )
        # No late events: an event's time is when it was made, so freshness is produce → stored.
        self.gen = EventGenerator(cfg, seed=seed, late_fraction=0.0)
        self.counts = ProducerCounts()
        self.series: list[tuple[float, float, int]] = []
        self.error: BaseException | None = None
        self._stop_evt = threading.Event()

    @property
    def acked(self) -> int:
        return self.ack.tally.acked

    @property
    def rejected(self) -> int:
        return self.ack.tally.rejected

    def stop(self) -> None:
        self._stop_evt.set()

    def failed(self) -> bool:
        """True if the thread died of something other than the server going away (a bug: the
        run must not be reported)."""
        lost_server = (OSError, redis.ConnectionError, redis.TimeoutError)
        return self.error is not None and not isinstance(self.error, lost_server)

    def run(self) -> None:
        try:
            self._offer()
            self._deliver_rest()
        except Exception as e:  # noqa: BLE001 - handed to the caller (see `failed`)
            self.error = e
        finally:
            self.counts.unsent = self.producer.pending()
            if self.producer.valve is not None:
                self.producer.valve.close()

    def _t_s(self) -> float:
        return (now_ms() - self.t0_ms) / 1000

    def _flush(self) -> None:
        """One bounded flush; throttling and the valve's own Redis errors leave the buffer."""
        try:
            self.producer.flush()
        except BackpressureError:
            self.counts.throttled_flushes += 1
        except redis.ResponseError as e:  # e.g. OOM on the valve's state write
            _count(self.counts.valve_errors, e)

    def _offer(self) -> None:
        c = self.counts
        owed = 0.0
        last = self._t_s()
        shard_by = self.producer.shard_by
        while not self._stop_evt.is_set():
            t = self._t_s()
            if t >= self.profile.total_s:
                break
            rate = self.profile.rate_at(t)
            due = rate * max(0.0, t - last)
            last = t
            c.offered += due
            owed += due
            if owed > rate:  # a tick that came more than a second late: give up the excess
                c.lagged += owed - rate
                owed = rate
            if self.producer.pending():
                self._flush()
                c.held_back += owed  # throttled meanwhile: not generated, not queued here
                owed = 0.0
            else:
                n = math.floor(owed)
                if n > 0:
                    owed -= n
                    c.generated += n
                    try:
                        produce_frame(self.producer, self.gen.frame(n, now_ms()), shard_by)
                    except BackpressureError:
                        c.throttled_flushes += 1
                    except redis.ResponseError as e:
                        _count(c.valve_errors, e)
            self.series.append((t, c.offered, self.acked))
            next_tick = (math.floor(t / TICK_S) + 1) * TICK_S
            self._stop_evt.wait(max(0.0, next_tick - self._t_s()))

    def _deliver_rest(self) -> None:
        deadline = time.monotonic() + FINAL_FLUSH_S
        while self.producer.pending() and time.monotonic() < deadline:
            self._flush()
            if self.producer.pending():
                time.sleep(TICK_S)
        self.series.append((self._t_s(), self.counts.offered, self.acked))


# -- statistics of a run ----------------------------------------------------------------------


def admitted_per_s(
    batches: Sequence[Mapping[str, Any]],
    t0_ms: int,
    end_s: float,
    trigger_ms: int,
    restarts_s: Sequence[float] = (),
) -> list[float]:
    """Events/s admitted in each whole second [k, k+1) of [0, end_s), from batch records.

    A batch's events arrived between the previous batch's start and its own start, so they are
    spread evenly over that interval (over one trigger interval for the first batch, and for
    the first batch after a query restart in `restarts_s`: nothing was admitted while the query
    was down). Counting whole batches per second instead would alias: at one batch every 0.8 s
    the seconds alternate between one and two batches, a 40 % swing no controller caused.
    """
    n_bins = max(0, math.floor(end_s))
    bins = [0.0] * n_bins
    rs = sorted(batches, key=lambda b: b["started_ms"])
    prev: float | None = None
    for b in rs:
        hi = (b["started_ms"] - t0_ms) / 1000
        restarted = prev is not None and any(prev < r <= hi for r in restarts_s)
        lo = hi - trigger_ms / 1000 if prev is None or restarted else prev
        prev = hi
        n = b["events"]
        if n <= 0 or hi <= lo:
            continue
        density = n / (hi - lo)
        for k in range(max(0, math.floor(lo)), min(n_bins, math.ceil(hi))):
            overlap = min(hi, k + 1) - max(lo, k)
            if overlap > 0:
                bins[k] += density * overlap
    return bins


def coefficient_of_variation(values: Sequence[float]) -> float | None:
    """Population std / mean; None for fewer than 2 values or a zero mean."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else None


def rises(flags: Sequence[bool]) -> int:
    """How many times `flags` goes from False to True (a start already True counts once)."""
    return sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))


def drain_time_s(
    samples: Sequence[tuple[float, int]], from_s: float, until_s: float, threshold: float
) -> float | None:
    """Seconds from `from_s` until the value is at or under `threshold` and stays there up to
    `until_s`; None if it is still over at the last sample before `until_s`. `samples` are
    (t_s, value), in time order."""
    window = [(t, v) for t, v in samples if from_s <= t <= until_s]
    if not window:
        return None
    settled: float | None = None
    for t, v in window:
        if v > threshold:
            settled = None
        elif settled is None:
            settled = t
    return None if settled is None else settled - from_s


@dataclass(frozen=True)
class Freshness:
    batches: int
    p50_ms: float | None
    p99_ms: float | None


def freshness(
    batches: Sequence[Mapping[str, Any]], t0_ms: int, lo_s: float, hi_s: float
) -> Freshness:
    """Like `sluice.pipeline.status.read_status`, over the batches done in [lo_s, hi_s): per
    batch, done − newest event time and done − oldest event time; p50 over both, p99 over the
    oldest. Per batch, not per event, so with tens of batches p99 is about the worst batch."""
    rs = [b for b in batches if lo_s * 1000 <= b["done_ms"] - t0_ms < hi_s * 1000]
    newest = [b["done_ms"] - b["max_ems"] for b in rs if b.get("max_ems") is not None]
    oldest = [b["done_ms"] - b["min_ems"] for b in rs if b.get("min_ems") is not None]
    return Freshness(len(rs), percentile(newest + oldest, 0.5), percentile(oldest, 0.99))


def input_level(client: Any, streams: Sequence[str]) -> tuple[int, int]:
    """(entries, exact bytes) of the input streams in one round trip: `MEMORY USAGE ... SAMPLES
    0` sizes every stream node (the default samples 5 and extrapolates, which entries of uneven
    size skew)."""
    pipe = client.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
        pipe.execute_command("MEMORY", "USAGE", s, "SAMPLES", 0)
    res = pipe.execute()
    return sum(int(x) for x in res[0::2]), sum(int(x or 0) for x in res[1::2])


def count_metric_total(client: Any, metric: str) -> int:
    """A count metric summed over every key and slice of its base resolution (each slice field
    holds `<writer token>:<count>`): the events the store holds, independent of the counters."""
    total = 0
    for key in client.scan_iter(match=f"{SLICE_PREFIX}{{{metric}|*", count=1000):
        if b":r" in key.rsplit(b"}", 1)[1]:
            continue  # a coarser resolution of the same metric
        for fld, value in client.hgetall(key).items():
            if fld != b"_m":
                total += int(value.split(b":")[1])
    return total
