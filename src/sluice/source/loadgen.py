"""Synthetic load for `sluice produce` and `sluice demo`: Zipf keys, seeded, steady or bursty.

Events follow the configured schema: the time field is "now" (a `late_fraction` of events are
up to `max_late_ms` late), string fields are Zipf-distributed ids (`card-17`), numbers are
log-normal amounts in cents precision or small integers, booleans are fair coins. The RNG is
seeded, so the same seed gives the same keys and values in the same order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import redis

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import BackpressureError
from sluice.source.producer import Producer, shard_of

TICK_S = 0.05
# After its duration, a load waits this long for the input to admit the events it made.
DRAIN_S = 30.0
# How long the load waits for a Redis that stopped answering (the log, or the flow signals'
# store), its events kept, before it stops with what it wrote reported.
OUTAGE_S = 30.0


def zipf_ids(rng: np.random.Generator, n: int, a: float, n_keys: int) -> np.ndarray:
    """`n` key ids in [0, n_keys): Zipf(`a`) ranks folded onto the keys, so a few are hot."""
    return (rng.zipf(a, n) - 1) % n_keys


@dataclass(frozen=True)
class Profile:
    """Rate over time. `burst`: `burst_factor` x the base rate for `burst_s` of every `period_s`."""

    name: str = "steady"
    burst_factor: float = 10.0
    burst_s: float = 3.0
    period_s: float = 20.0

    def rate_at(self, base: float, t_s: float) -> float:
        if self.name == "burst" and (t_s % self.period_s) >= self.period_s - self.burst_s:
            return base * self.burst_factor
        return base


class EventGenerator:
    def __init__(
        self,
        cfg: Config,
        seed: int = 0,
        n_keys: int = 10_000,
        zipf_a: float = 1.3,
        late_fraction: float = 0.01,
        max_late_ms: int = 300_000,
    ) -> None:
        self.cfg = cfg
        # One stream per field (and one for lateness), so the sequence of values of a field
        # does not depend on how the load happens to be cut into frames.
        self.rngs = {
            name: np.random.default_rng([seed, i]) for i, name in enumerate(cfg.source.schema_)
        }
        self.late_rng = np.random.default_rng([seed, len(self.rngs)])
        self.n_keys = n_keys
        self.zipf_a = zipf_a
        self.late_fraction = late_fraction
        self.max_late_ms = max_late_ms
        self.types = cfg.source.field_types()

    def _zipf(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return zipf_ids(rng, n, self.zipf_a, self.n_keys)

    def frame(self, n: int, now_ms: int) -> pd.DataFrame:
        cols: dict[str, Any] = {}
        for name, ft in self.types.items():
            rng = self.rngs[name]
            if name == self.cfg.source.time_field:
                late = self.late_rng.random(n) < self.late_fraction
                lag = self.late_rng.integers(0, self.max_late_ms, n)
                cols[name] = np.where(late, now_ms - lag, now_ms).astype(np.int64)
            elif ft.type == "string":
                cols[name] = pd.Series(self._zipf(rng, n)).map(lambda i, p=name: f"{p}-{i}")
            elif ft.type in ("long", "int"):
                cols[name] = rng.integers(0, 1000, n)
            elif ft.type in ("double", "float"):
                cols[name] = np.round(rng.lognormal(3.0, 1.0, n), 2)
            else:
                cols[name] = rng.random(n) < 0.5
        return pd.DataFrame(cols)


def produce_frame(producer: Producer, df: pd.DataFrame, shard_by: str | None) -> int:
    """Send a frame of events through `producer`, sharded by `shard_by`. Returns events sent."""
    if producer.format == "fields":  # every event buffered before a flush's error, if any
        producer.buffer_all([{str(k): v for k, v in r.items()} for r in df.to_dict("records")])
        return producer.flush()
    text = df.to_json(orient="records", lines=True)
    lines = [ln.encode() for ln in text.split("\n") if ln]
    n_shards = len(producer.keys)
    if n_shards == 1 or shard_by is None:
        producer.send_lines(0, lines)
    else:
        cache: dict[Any, int] = {}
        shards = [cache.setdefault(v, shard_of(v, n_shards)) for v in df[shard_by].tolist()]
        per: list[list[bytes]] = [[] for _ in range(n_shards)]
        for s, ln in zip(shards, lines, strict=True):
            per[s].append(ln)
        for s, part in enumerate(per):
            producer.send_lines(s, part)
    return producer.flush()


def run_load(
    cfg: Config,
    client: Any,
    rate: float,
    duration_s: float,
    profile: Profile = Profile(),
    seed: int = 0,
    clock: Clock = SYSTEM_CLOCK,
    stop: Callable[[], bool] = lambda: False,
    progress: Callable[[dict[str, Any]], None] | None = None,
    drain_s: float = DRAIN_S,
    outage_s: float = OUTAGE_S,
) -> dict[str, Any]:
    """Produce for `duration_s` at `rate` events/s (shaped by `profile`). Blocks; bounded in
    time: at most `duration_s` + `drain_s`, and it returns soon after `stop()` turns true.

    The producer is flow-controlled (`cfg.backpressure`): while it is throttled the generator
    makes no new events, and the shortfall is reported as `held_back` (offered load that the
    source was asked to hold, like a real client that slows down). Events already made stay
    buffered until admitted: after the duration they are waited for up to `drain_s` (the input
    over its high watermark, nothing draining it), unless stopped; any still held then are
    reported as `unsent`, never written later and never silently dropped.

    While Redis does not answer, the events made stay buffered and are retried every tick; one
    that stays down for `outage_s` ends the load there, with `error` saying so.

    Returns {"events", "offered", "held_back", "unsent", "seconds", "rate", "largest_frame",
    "error"} (the most events one frame carried: a frame after a stalled tick makes up for it;
    `error` is None unless an outage ended it); `progress` is called about once a second, with
    `waiting` (events made and not admitted) while it waits after the duration, and
    `redis_down` (the error) while Redis does not answer.
    """
    gen = EventGenerator(cfg, seed=seed)
    # What it sent is what its producer wrote: a flush a cluster's master failed part way
    # included (`Producer.sent_events`).
    producer = Producer.from_config(cfg, client, block_timeout_s=TICK_S)
    shard_by = producer.shard_by
    t0 = time.monotonic()
    largest = 0
    owed = offered = 0.0
    last_report = last_tick = t0
    down_since: float | None = None  # when Redis stopped answering
    down = ""  # its last error
    error: str | None = None

    def outage(e: redis.RedisError) -> bool:
        """Note that Redis did not answer; whether it has been down for too long."""
        nonlocal down_since, down, error
        now = time.monotonic()
        down_since, down = down_since or now, str(e)
        if now - down_since < outage_s:
            return False
        error = f"Redis did not answer for {outage_s:.0f}s ({e}); stopped"
        return True

    while not stop():
        tick = time.monotonic()
        elapsed = tick - t0
        if elapsed >= duration_s:
            break
        due = profile.rate_at(rate, elapsed) * (tick - last_tick)
        offered += due
        # Owe events for the real time that passed, so a slow tick is made up by the next ones
        # (at most a second's worth at once).
        owed = min(owed + due, profile.rate_at(rate, elapsed))
        last_tick = tick
        try:
            if producer.pending():
                producer.flush()
                owed = 0.0  # throttled: what was owed meanwhile is held back, not queued here
            else:
                n = math.floor(owed)
                if n > 0:
                    owed -= n
                    largest = max(largest, n)
                    produce_frame(producer, gen.frame(n, clock.now_ms()), shard_by)
            down_since = None
        except BackpressureError:
            down_since = None  # Redis answered; the events stay buffered, retried next tick
        except redis.RedisError as e:  # still buffered; retried next tick, for a while
            if outage(e):
                break
            owed = 0.0
        now = time.monotonic()
        if progress is not None and now - last_report >= 1.0:
            sent = producer.sent_events
            p = {"events": sent, "seconds": now - t0, "rate": sent / (now - t0)}
            progress(p if down_since is None else {**p, "redis_down": down})
            last_report = now
        next_tick = t0 + (math.floor(elapsed / TICK_S) + 1) * TICK_S
        time.sleep(max(0.0, next_tick - time.monotonic()))
    # What was made is delivered, if the input admits it within `drain_s`.
    waited_from = time.monotonic()
    while (producer.pending() and not stop() and error is None
           and time.monotonic() - waited_from < drain_s):  # fmt: skip
        try:
            producer.flush()
        except redis.RedisError as e:
            if outage(e):
                break
            time.sleep(TICK_S)
        except BackpressureError:
            down_since = None
            now = time.monotonic()
            if progress is not None and now - last_report >= 1.0:
                sent = producer.sent_events
                progress({"events": sent, "seconds": now - t0, "rate": sent / (now - t0),
                          "waiting": producer.pending()})  # fmt: skip
                last_report = now
    sent = producer.sent_events
    unsent = producer.discard()
    producer.close()
    seconds = time.monotonic() - t0
    return {
        "events": sent,
        "offered": round(offered),
        "held_back": max(0, round(offered) - sent),
        "unsent": unsent,
        "seconds": seconds,
        "rate": sent / seconds if seconds else 0.0,
        "largest_frame": largest,
        "error": error,
    }
