"""Flow control against a real Redis: the gate, the 429, and seed 000's signal round trips
through the signal stream and the stage-state hash (time from a ManualClock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from fastapi.testclient import TestClient

from sluice.clock import ManualClock
from sluice.errors import BackpressureError
from sluice.flow.board import Board
from sluice.flow.task import STALE_SIGNAL_MS
from sluice.flow.valves import AdmissionValve, IngestValve, StoreMonitor, spark_task_id
from sluice.graph import graph_topology
from sluice.redis.keys import STATS_KEY
from sluice.server.app import create_app
from sluice.source.producer import Producer
from sluice.status.flow import flow_status
from tests.conftest import make_config
from tests.integration.helpers import stream_level

NOW = 1_800_000_000_000


def _cfg(redis_url: str, tmp_path: Path, **bp: Any) -> Any:
    marks = {"high_watermark": "64KB", "low_watermark": "8KB", "sensitivity": "2s", "tick": "250ms"}
    return make_config(redis_url, tmp_path, backpressure={**marks, **bp})


def _fill(r: redis.Redis, cfg: Any, target_bytes: int) -> None:
    """Add jsonl entries to every shard until the input holds `target_bytes`."""
    streams = tuple(cfg.source.shard_keys())
    line = b'{"ts":1,"card":"c1","merchant":"m1","amount":1.5,"qty":1}'
    while stream_level(r, streams, cfg.backpressure).bytes < target_bytes:
        for s in streams:
            r.xadd(s, {"d": b"\n".join([line] * 50), "n": 50})


def _drain(r: redis.Redis, cfg: Any) -> None:
    for s in cfg.source.shard_keys():
        r.xtrim(s, maxlen=0)


def _measure(r: redis.Redis, cfg: Any) -> Any:
    def measure() -> Any:
        return stream_level(r, tuple(cfg.source.shard_keys()), cfg.backpressure)

    return measure


def _ingest(r: redis.Redis, cfg: Any, clock: ManualClock) -> IngestValve:
    return IngestValve(
        r, cfg.backpressure, cfg.spark.trigger, _measure(r, cfg), clock, clock_sleep(clock)
    )


def clock_sleep(clock: ManualClock) -> Any:
    def sleep(seconds: float) -> None:
        clock.advance(max(1, round(seconds * 1000)))

    return sleep


def _spark(r: redis.Redis, cfg: Any, clock: ManualClock) -> AdmissionValve:
    flow = graph_topology(cfg).flow
    return AdmissionValve(
        r, cfg.backpressure, cfg.spark.trigger, 1_000_000, flow["spark"], _measure(r, cfg), clock
    )


def _store(r: redis.Redis, cfg: Any, clock: ManualClock) -> StoreMonitor:
    return StoreMonitor(r, cfg.backpressure, graph_topology(cfg).flow["store"], clock)


def _warm(valve: IngestValve, clock: ManualClock, per_tick: int = 2_500, ticks: int = 12) -> None:
    """Admit `per_tick` events every 250 ms: a measured rate of 10,000 events/s."""
    for _ in range(ticks):
        assert valve.try_admit(per_tick) == 0
        clock.advance(250)


def test_gate_shuts_at_the_high_watermark_and_opens_below(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    valve = _ingest(r, cfg, clock)
    assert valve.try_admit(100) == 0
    _fill(r, cfg, cfg.backpressure.high_watermark)
    clock.advance(250)
    wait = valve.try_admit(100)
    assert wait > 0 and not valve.gate_open
    with pytest.raises(BackpressureError, match=r"not admitted within 1\.0s"):
        valve.admit(100, timeout_s=1.0)
    _drain(r, cfg)
    clock.advance(250)
    assert valve.try_admit(100) == 0 and valve.gate_open
    st = Board(r).tasks(clock.now_ms(), "ingest")[valve.task.id]
    assert st["gate_open"] is True and st["queue"]["bytes"] < cfg.backpressure.low_watermark
    # The time spent refused shows as a backpressure ratio.
    assert st["backpressure_ratio"] > 0


def test_a_task_that_did_not_read_for_long_ignores_stale_signals(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """An idle `sluice serve` worker reads its signals only when a request comes: an overload
    sent minutes before throttled it to `min_rate` with the input empty. A signal older than
    STALE_SIGNAL_MS is ignored; a fresh one still acts."""
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    ingest = _ingest(r, cfg, clock)
    _warm(ingest, clock)
    board = Board(r)
    board.send(ingest.task.id, "overload", "spark/x", 0, clock.now_ms())
    clock.advance(STALE_SIGNAL_MS + 250)  # the worker was idle meanwhile
    assert ingest.try_admit(1) == 0
    assert ingest.task.controller.rate is None and ingest.task.signals_seen == 0
    board.send(ingest.task.id, "overload", "spark/x", 0, clock.now_ms())
    clock.advance(250)
    ingest.try_admit(1)
    assert ingest.task.controller.backpressured and ingest.task.signals_seen == 1


def test_writes_between_two_looks_stop_at_the_high_watermark(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """The gate looks at the input once a tick. Between two looks, writes are admitted only
    until what they add takes the input to the high watermark: six concurrent 7.6 MB requests
    each found the gate open and took a 5 MB high watermark to 41 MB. The first write after a
    look always goes (one write is the slack), and the next look starts afresh."""
    cfg = _cfg(redis_url, tmp_path)  # high watermark 64 KB
    clock = ManualClock(NOW)
    valve = _ingest(r, cfg, clock)
    big = cfg.backpressure.high_watermark  # each write alone is the whole headroom
    assert valve.try_admit(1000, big) == 0  # the first after a look
    assert valve.try_admit(1000, big) > 0  # nothing more until the next look
    assert valve.try_admit(1, 10) > 0
    clock.advance(250)  # the next look: the writes never landed, so the input is empty
    assert valve.try_admit(1000, big) == 0 and valve.gate_open
    clock.advance(250)
    small = cfg.backpressure.high_watermark // 10
    assert all(valve.try_admit(10, small) == 0 for _ in range(10))  # up to the mark: all go
    assert valve.try_admit(10, small) > 0


def test_post_events_answers_429_with_retry_after_while_over_the_high_watermark(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path, tick="50ms")
    body = [{"ts": NOW, "card": "c1", "merchant": "m1", "amount": 1.0, "qty": 1}]
    with TestClient(create_app(cfg, r)) as http:
        assert http.post("/v1/events", json=body).status_code == 202
        _fill(r, cfg, cfg.backpressure.high_watermark)
        import time

        time.sleep(0.06)
        refused = http.post("/v1/events", json=body)
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "backpressure"
        _drain(r, cfg)
        time.sleep(0.06)
        assert http.post("/v1/events", json=body).status_code == 202


def test_post_events_is_never_refused_under_controller_none(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path, controller="none", tick="50ms")
    body = [{"ts": NOW, "card": "c1", "merchant": "m1", "amount": 1.0, "qty": 1}]
    _fill(r, cfg, cfg.backpressure.high_watermark * 2)
    with TestClient(create_app(cfg, r)) as http:
        assert http.post("/v1/events", json=body).status_code == 202


def test_stepwise_round_trip_through_redis(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    """The spark stage's queue overloads: it signals the ingest task, which steps its rate down
    once; after the queue stays quiet for `sensitivity`, one underload steps it back to its
    origin and clears the flag."""
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    ingest = _ingest(r, cfg, clock)
    spark = _spark(r, cfg, clock)
    _warm(ingest, clock)
    measured = ingest.task.meter.rate()
    assert measured == pytest.approx(10_000, rel=0.15)

    _fill(r, cfg, cfg.backpressure.high_watermark)
    spark.limit()  # overload: signal the (unflagged, listening) ingest task
    clock.advance(250)
    measured = ingest.task.meter.rate()  # what the task measures when the signal arrives
    ingest.try_admit(1)  # next tick reads the signal
    ctl = ingest.task.controller
    assert ctl.backpressured and ctl.origin_rate == pytest.approx(measured, rel=0.01)
    assert ctl.rate == pytest.approx(measured * cfg.backpressure.step, rel=0.01)
    assert ingest.bucket.rate == ctl.rate

    # Still overloaded: the rate holds (one throttle per episode). The flagged task still hears
    # of the overload, since its origin was measured: it must not probe while it goes on.
    for _ in range(4):
        spark.limit()
        clock.advance(250)
        ingest.try_admit(1)
    assert ctl.rate == pytest.approx(measured * cfg.backpressure.step, rel=0.01)
    assert ingest.task.signals_seen == 5

    _drain(r, cfg)
    # Quiet, but not yet for a whole sensitivity (0 .. 1.75 s): no change.
    for _ in range(8):
        spark.limit()
        clock.advance(250)
        ingest.try_admit(1)
    assert ctl.backpressured
    spark.limit()  # 2 s quiet: underload
    clock.advance(250)
    ingest.try_admit(1)
    assert not ctl.backpressured  # back at origin: the flag clears
    assert ctl.rate == pytest.approx(measured, rel=0.01)
    # Nothing held back for a whole sensitivity: the provisional cap at the origin is lifted.
    for _ in range(9):
        clock.advance(250)
        ingest.try_admit(1)
    assert ctl.rate is None
    timeline = Board(r).timeline()
    flags = [ev["backpressure"] for ev in timeline if ev.get("task") == ingest.task.id]
    assert True in flags and flags[0] is False  # newest first: freed after being throttled


def test_slow_store_throttles_the_spark_stage(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path, store={"latency_high": "500ms", "latency_low": "100ms"})
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    for _ in range(8):  # 4,000 events per 250 ms admitted: 16,000 events/s
        spark.limit()
        spark.admitted(4_000, held_back=False)
        clock.advance(250)
    store = _store(r, cfg, clock)
    store.observe(write_ms=900.0)  # over latency_high: overload to the spark task
    limit = spark.limit()
    ctl = spark.task.controller
    assert ctl.backpressured
    assert ctl.rate == pytest.approx(16_000 * cfg.backpressure.step, rel=0.1)
    # Planned 250 ms after the previous batch (the trigger is 200 ms): the budget covers 250 ms.
    assert limit == pytest.approx(ctl.rate * 250 / 1000, rel=0.01)
    spark.admitted(limit, held_back=True)

    st = flow_status(r, cfg, clock.now_ms())
    assert st["stages"]["spark"]["backpressure"] is True
    assert st["stages"]["store"]["overloaded"] is True
    assert spark_task_id(graph_topology(cfg).flow["spark"]) in {
        t["task"] for t in st["stages"]["spark"]["task_states"]
    }


def test_spark_task_resumes_its_throttle_after_a_restart(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    spark.limit()
    spark.admitted(4_000, held_back=False)
    clock.advance(250)
    Board(r).send(spark.task.id, "overload", "store/x", 0, clock.now_ms())
    spark.limit()
    spark.admitted(10, held_back=True)
    rate = spark.task.controller.rate
    assert rate is not None
    again = _spark(r, cfg, clock)  # a new reader after a query restart
    assert again.task.controller.backpressured and again.task.controller.rate == rate


def _provisional(spark: AdmissionValve, clock: ManualClock) -> None:
    """Admit 4,000 events per 250 ms (16,000 events/s), then an overload from the store and,
    later, an underload: the spark task is back at its measured origin, flag clear."""
    for _ in range(8):
        spark.limit()
        spark.admitted(4_000, held_back=False)
        clock.advance(250)
    board = spark.task.board
    board.send(spark.task.id, "overload", "store/x", 0, clock.now_ms())
    spark.admitted(spark.limit() or 0, held_back=True)
    clock.advance(250)
    board.send(spark.task.id, "underload", "store/x", 0, clock.now_ms())
    spark.admitted(spark.limit() or 0, held_back=True)


def test_spark_probes_its_provisional_cap_until_an_overload(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A provisional cap that keeps holding input back while the store sends no overload rises
    one step per quiet sensitivity; an overload throttles from the probed cap."""
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    _provisional(spark, clock)
    ctl = spark.task.controller
    origin = ctl.rate
    assert origin is not None and not ctl.backpressured

    rates = []
    for _ in range(16):  # 4 s of batches, every one held back by the cap
        clock.advance(250)
        spark.admitted(spark.limit() or 0, held_back=True)
        rates.append(ctl.rate)
    assert rates == [origin] * 7 + [origin * 2] * 8 + [origin * 4]  # once per 2 s
    state = Board(r).tasks(clock.now_ms(), "spark")[spark.task.id]
    assert (state["rate"], state["backpressure"]) == (origin * 4, False)
    assert state["batch_limit"] == int(origin * 2 * 250 / 1000)  # the batch planned before
    clock.advance(250)
    assert spark.limit() == int(origin * 4 * 250 / 1000)

    Board(r).send(spark.task.id, "overload", "store/x", 0, clock.now_ms())
    clock.advance(250)
    spark.admitted(spark.limit() or 0, held_back=True)
    assert (ctl.rate, ctl.origin_rate, ctl.backpressured) == (origin * 2, origin * 4, True)


def test_flagged_spark_steps_back_once_the_store_stops_overloading(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Throttled from a measured origin, the spark task still hears the store's overloads and
    holds; once they stop for a sensitivity it steps back, even though the store's write time
    stays between its watermarks and so never sends an underload."""
    cfg = _cfg(redis_url, tmp_path, store={"latency_high": "500ms", "latency_low": "100ms"})
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    for _ in range(8):  # 16,000 events/s
        spark.limit()
        spark.admitted(4_000, held_back=False)
        clock.advance(250)
    store = _store(r, cfg, clock)
    ctl = spark.task.controller
    for _ in range(12):  # 3 s of overload, every batch held back by the cap
        store.observe(write_ms=900.0)
        spark.admitted(spark.limit() or 0, held_back=True)
        clock.advance(250)
    assert (ctl.rate, ctl.origin_rate, ctl.backpressured) == (8_000, 16_000, True)
    assert spark.task.signals_seen == 12  # heard, not acted on again

    rates = []
    for _ in range(9):  # between the watermarks: neither overload nor underload
        store.observe(write_ms=300.0)
        spark.admitted(spark.limit() or 0, held_back=True)
        rates.append(ctl.rate)
        clock.advance(250)
    assert rates == [8_000] * 7 + [16_000] * 2  # 2 s after the last overload
    assert not ctl.backpressured


def test_spark_releases_a_probed_cap_once_it_holds_nothing_back(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    _provisional(spark, clock)
    ctl = spark.task.controller
    for _ in range(8):
        clock.advance(250)
        spark.admitted(spark.limit() or 0, held_back=True)
    assert ctl.rate == 32_000  # probed once
    for _ in range(7):  # the offered load now fits under the cap
        clock.advance(250)
        spark.admitted(1_000, held_back=False)
    assert ctl.rate == 32_000
    clock.advance(250)
    spark.admitted(1_000, held_back=False)  # 2 s without holding anything back
    assert ctl.rate is None and spark.limit() == 1_000_000  # the static cap only


def test_spark_budget_covers_the_time_since_the_previous_batch(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Batches that overrun the 200 ms trigger get a budget for their real interval, bounded
    at four triggers, so the admitted rate stays at the controller's rate."""
    cfg = _cfg(redis_url, tmp_path, controller="fixed", fixed_rate=10_000)
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    assert spark.limit() == 2_000  # the first batch: one trigger
    clock.advance(700)
    assert spark.limit() == 7_000
    clock.advance(100)
    assert spark.limit() == 2_000  # never under one trigger
    clock.advance(60_000)
    assert spark.limit() == 8_000  # a stall earns at most four triggers
    spark.admitted(8_000, held_back=True)
    assert Board(r).tasks(clock.now_ms(), "spark")[spark.task.id]["batch_limit"] == 8_000


def _throttled_and_clear(r: redis.Redis, ingest: IngestValve, clock: ManualClock) -> float:
    """An overload, then an underload: the ingest task's cap back at its measured origin, the
    flag clear, the cap provisional. Returns the origin."""
    board = Board(r)
    board.send(ingest.task.id, "overload", "spark/x", 0, clock.now_ms())
    clock.advance(250)
    ingest.try_admit(1)
    board.send(ingest.task.id, "underload", "spark/x", 0, clock.now_ms())
    clock.advance(250)
    ingest.try_admit(1)
    ctl = ingest.task.controller
    assert ctl.rate is not None and not ctl.backpressured
    return ctl.rate


def _offer(ingest: IngestValve, clock: ManualClock, n: int, ticks: int = 12) -> list[float]:
    """Offer `n` events every 250 ms; the waits the valve answered."""
    waits = []
    for _ in range(ticks):
        clock.advance(250)
        waits.append(ingest.try_admit(n))
    return waits


def test_ingest_probes_its_provisional_cap_only_while_its_input_is_quiet(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """The ingest task's measured cap is not probed up behind a shut gate, nor while the input
    is between the watermarks (the gate bounds the input, looking once a tick; a probed cap
    would let a catch-up burst past it between two looks). At or below the low watermark it
    is, one step per sensitivity; it is released after a sensitivity with nothing held."""
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    ingest = _ingest(r, cfg, clock)
    _warm(ingest, clock)
    origin = _throttled_and_clear(r, ingest, clock)
    ctl = ingest.task.controller

    _fill(r, cfg, cfg.backpressure.high_watermark)  # the gate shuts
    assert all(w > 0 for w in _offer(ingest, clock, 10**6))
    assert not ingest.gate_open and ctl.rate == origin

    _drain(r, cfg)
    _fill(r, cfg, (cfg.backpressure.low_watermark + cfg.backpressure.high_watermark) // 2)
    waits = _offer(ingest, clock, 10**6)  # far over the cap, for 3 s (sensitivity 2 s)
    # The first goes into the bucket's debt, then the cap holds the rest back: no probe.
    assert ingest.gate_open and waits[0] == 0 and all(w > 0 for w in waits[1:])
    assert ctl.rate == origin and ingest.bucket.rate == origin

    _drain(r, cfg)  # quiet: the cap that holds input back is probed, a step per sensitivity
    assert all(w > 0 for w in _offer(ingest, clock, 10**6))
    step = cfg.backpressure.step  # at once (unchanged for over a sensitivity), and 2 s later
    assert ctl.rate is not None and ctl.rate == pytest.approx(origin / step**2)
    assert ingest.bucket.rate == ctl.rate

    clock.advance(int(3 * 10**6 / origin * 1000))  # the bursts' debt is paid
    assert all(w == 0 for w in _offer(ingest, clock, 1))  # nothing held back for 3 s
    assert ctl.rate is None and ingest.bucket.rate is None


def test_a_producer_held_by_the_gate_is_throttled_from_its_rate_before_the_gate(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """A producer the gate held for longer than its rate meter's window emits nothing meanwhile.
    The overload signal that comes then throttles it from the rate it sent before the gate shut,
    not from 0 (`min_rate`: a 3,000 events/s producer was held at 100/s with an empty backlog,
    as nothing it offered was ever below the cap); and once the flag clears, a cap it no longer
    reaches is released."""
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    ingest = _ingest(r, cfg, clock)
    _warm(ingest, clock)  # 10,000 events/s
    _fill(r, cfg, cfg.backpressure.high_watermark)  # the gate holds the producer for 3 s
    assert all(w > 0 for w in _offer(ingest, clock, 750))
    assert ingest.task.meter.rate() == 0
    _drain(r, cfg)  # the gate opens, one catch-up write goes, and it shuts again at once
    clock.advance(250)
    assert ingest.try_admit(750) == 0 and ingest.gate_open
    _fill(r, cfg, cfg.backpressure.high_watermark)
    assert all(w > 0 for w in _offer(ingest, clock, 750, ticks=4))
    origin = _throttled_and_clear(r, ingest, clock)
    assert 8_000 <= origin <= 10_000  # measured when the gate first shut, not 100 (nor 667)
    _drain(r, cfg)
    ctl = ingest.task.controller
    assert all(w == 0 for w in _offer(ingest, clock, 750))  # 3,000 events/s: under the cap
    assert ctl.rate is None  # released after a sensitivity with nothing held back


def test_send_all_under_backpressure_raises_with_every_event_buffered(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """`send_all` buffers every event before it flushes: a BackpressureError from that flush
    leaves all of them buffered, for `flush()` to retry. It used to flush part way through, so
    the error came with part of them buffered (3,998 of 5,000), and a retry of the call
    counted those twice."""
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    producer = Producer.from_config(cfg, r, valve=_ingest(r, cfg, clock), block_timeout_s=0.5)
    _fill(r, cfg, cfg.backpressure.high_watermark)
    clock.advance(250)
    events = [{"ts": NOW, "card": f"c{i}", "merchant": "m", "amount": 1.0, "qty": 1}
              for i in range(5_000)]  # fmt: skip
    with pytest.raises(BackpressureError):
        producer.send_all(events)
    assert producer.pending() == 5_000
    _drain(r, cfg)
    clock.advance(250)
    assert producer.flush() == 5_000 and producer.pending() == 0


def test_a_producer_is_made_while_redis_is_down_and_keeps_what_it_could_not_write(
    redis_url: str, tmp_path: Path
) -> None:
    """Making a producer read the flow signals' tail: with Redis down it raised a raw
    ConnectionError, so nothing could even be buffered. Now it is made; a flush fails with the
    Redis error and keeps every event."""
    from tests.conftest import free_port

    cfg = _cfg(redis_url, tmp_path)
    down = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    producer = Producer.from_config(cfg, down)
    producer.send({"ts": NOW, "card": "c1", "merchant": "m", "amount": 1.0, "qty": 1})
    with pytest.raises(redis.ConnectionError):
        producer.flush()
    assert producer.pending() == 1


def test_ingest_flush_survives_a_full_redis_and_still_raises_for_its_entries(
    r: redis.Redis, redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At `maxmemory` (noeviction) the valve's state HSET is refused too: that is logged, and
    the flush raises for its own XADDs and keeps its buffer."""
    cfg = _cfg(redis_url, tmp_path)
    clock = ManualClock(NOW)
    producer = Producer.from_config(cfg, r, valve=_ingest(r, cfg, clock), block_timeout_s=1.0)
    event = {"ts": NOW, "card": "c1", "merchant": "m1", "amount": 1.0, "qty": 1}
    producer.send(event)
    old = r.config_get("maxmemory*")
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError, match="XADD"):
            producer.flush()
        assert producer.pending() == 1
        clock.advance(250)
        assert producer.valve is not None and producer.valve.try_admit(1) == 0  # no raise
        warnings = [m for m in caplog.messages if "could not publish its state" in m]
        assert len(warnings) == 1  # once per outage, not once per tick
    finally:
        r.config_set("maxmemory", old["maxmemory"])
        r.config_set("maxmemory-policy", old["maxmemory-policy"])
    clock.advance(250)
    assert producer.flush() == 1 and producer.pending() == 0
    assert producer.valve.task.id in Board(r).tasks(clock.now_ms(), "ingest")


def _record(r: redis.Redis, token: int, events: int, started_ms: int, done_ms: int) -> None:
    """What `Pipeline.process_batch` records once a batch is written."""
    rec = {"token": token, "events": events, "started_ms": started_ms, "done_ms": done_ms}
    r.hset(STATS_KEY, mapping={"last_token": token, "last_batch": orjson.dumps(rec)})


def test_batch_records_feed_aimd_normal_slow_and_busy_after_a_restart(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path, controller="aimd")
    a = cfg.backpressure.aimd  # target RTT: 2 x the 200 ms trigger
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    assert spark.limit() == a.initial_window
    t = clock.now_ms()
    spark.admitted(a.initial_window, held_back=True)
    clock.advance(300)
    _record(r, 1, a.initial_window, t + 20, t + 300)  # round trip 300 ms: NORMAL
    assert spark.limit() == a.initial_window + a.increase
    t = clock.now_ms()
    spark.admitted(1_000, held_back=True)
    clock.advance(900)
    _record(r, 2, 1_000, t + 20, t + 900)  # 900 ms: SLOW
    assert spark.limit() == a.initial_window
    assert spark.task.controller.snapshot()["state"] == "slow"
    spark.admitted(1_000, held_back=True)  # admitted, then the process dies mid-batch
    again = _spark(r, cfg, clock)
    assert again.limit() == int(a.initial_window * a.busy_factor)
    assert again.task.controller.snapshot()["state"] == "busy"


def test_batch_records_feed_pid_with_scheduling_delay(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = _cfg(redis_url, tmp_path, controller="pid")
    clock = ManualClock(NOW)
    spark = _spark(r, cfg, clock)
    assert spark.task.controller.rate is None
    for token in (1, 2, 3):
        spark.limit()
        t = clock.now_ms()
        spark.admitted(2_000, held_back=True)
        clock.advance(1_000)  # 1 s batches on a 200 ms trigger: late by 800 ms each
        _record(r, token, 2_000, t, t + 1_000)
    spark.limit()
    pid = spark.task.controller
    # 2,000 events/s processed and a standing delay: the estimate falls below it.
    assert pid.rate is not None and pid.rate < 2_000
    assert spark.task.controller.batch_limit() == int(pid.rate * 0.2)


def test_the_timeline_is_newest_first_by_when_each_change_happened(r: redis.Redis) -> None:
    """A task restarted from its snapshot publishes its last change again as it starts, at that
    change's older time: it sits among the others by that time, not on top."""
    board = Board(r)
    for task, at in [("a", NOW), ("b", NOW + 2_000), ("c", NOW + 1_000)]:  # c: restored
        board.publish(task, {"task": task, "changed_ms": at}, changed=True)
    board.publish("b", {"task": "b", "changed_ms": NOW + 2_000}, changed=True)  # a tie: both
    assert [ev["task"] for ev in board.timeline()] == ["b", "b", "c", "a"]
