"""The branch experiment: two branches read one source, and one of them is slowed.

    ingest ─▶ events ─┬─▶ [left]  ─▶ left  ─▶ [fold:left]  ─▶ store   (slowed)
                      └─▶ [right] ─▶ right ─▶ [fold:right] ─▶ store

The left branch's store gets slow (every write partition sleeps, so its write time passes the
store's high watermark) from `slow_from_s` to `slow_until_s`. Under `propagation: hop` (seed
000) the store signals `fold:left`, whose input then fills and signals `left`, whose own
backlog on `events` absorbs the rest: the ingest and the right branch are never throttled. Under
`propagation: source` (Heron) the same overloads signal the ingest tasks, and the producer slows
for both branches.

Latency is measured end to end, from the time an event was due at the producer (a steady
schedule) to the moment its branch had folded it: branches see every event in order, so when a
branch has folded N events, the newest was due at start + N / rate. That counts time spent held
back in the producer (Heron) as well as in the streams (hop by hop).

Used by `tests/e2e/test_branches.py` (short) and `bench/branches.py` (long).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from sluice.config import Config, config_from_dict
from sluice.flow.board import Board
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.run import Pipeline
from sluice.pipeline.writer import write_partition
from sluice.redis.connection import RedisHandle
from sluice.redis.keys import stats_keys
from sluice.source.producer import Producer
from sluice.testing.faults import SlowStore

CARDS = 200
BRANCHES = ("left", "right")


def branch_config(
    redis_url: str, state_dir: Path, propagation: str, stream_hw: int = 300_000
) -> Config:
    def branch(name: str) -> dict[str, Any]:
        marks = {"high_watermark": stream_hw, "low_watermark": stream_hw // 10}
        return {
            "name": name, "from": "events", "sql": "SELECT * FROM input",
            "to": {"stream": name, **marks},
        }  # fmt: skip

    data: dict[str, Any] = {
            "redis": redis_url,
            "state_dir": str(state_dir),
            "source": {"stream": "events", "format": "jsonl",
                       "schema": {"ts": "long", "card": "string", "amount": "double"}},
            "metrics": [
                {"name": f"{b}_n", "key": ["card"], "agg": "count", "slice": "1m",
                 "retention": "1d", "from": b}
                for b in BRANCHES
            ],
            "stages": [branch(b) for b in BRANCHES],
            "spark": {"master": "local[2]", "trigger": "500ms"},
            "backpressure": {
                "controller": "stepwise", "propagation": propagation, "sensitivity": "1s",
                "high_watermark": "100MB", "low_watermark": "1MB", "min_rate": 50,
                "store": {"latency_high": "400ms", "latency_low": "100ms"},
            },
        }  # fmt: skip
    return config_from_dict(data)


@dataclass
class Sample:
    t_s: float  # since the producer started
    produced: int
    folded: dict[str, int]
    flagged: dict[str, bool]  # per stage: any of its tasks backpressured


@dataclass
class Result:
    propagation: str
    rate: float
    slow_from_s: float
    slow_until_s: float
    samples: list[Sample] = field(default_factory=list)

    def latency_s(self, s: Sample, branch: str) -> float:
        """How long ago the newest event the branch has folded was due."""
        return max(0.0, s.t_s - s.folded[branch] / self.rate)

    def phase(self, lo: float, hi: float) -> list[Sample]:
        return [s for s in self.samples if lo <= s.t_s < hi]

    def branch_rate(self, branch: str, lo: float, hi: float) -> float:
        """Events folded per second by the branch between lo and hi."""
        ss = self.phase(lo, hi)
        if len(ss) < 2:
            return 0.0
        return (ss[-1].folded[branch] - ss[0].folded[branch]) / (ss[-1].t_s - ss[0].t_s)

    def latencies(self, branch: str, lo: float, hi: float) -> list[float]:
        return [self.latency_s(s, branch) for s in self.phase(lo, hi)]

    def ever_flagged(self, stage: str) -> bool:
        return any(s.flagged.get(stage, False) for s in self.samples)

    def summary(self) -> dict[str, Any]:
        lo, hi = self.slow_from_s, self.slow_until_s
        out: dict[str, Any] = {"propagation": self.propagation}
        for b in BRANCHES:
            lat = sorted(self.latencies(b, lo, hi))
            out[b] = {
                "rate_before": round(self.branch_rate(b, lo - 10, lo), 1),
                "rate_slow": round(self.branch_rate(b, lo, hi), 1),
                "latency_p50_s": round(statistics.median(lat), 2) if lat else None,
                "latency_max_s": round(lat[-1], 2) if lat else None,
            }
        out["flagged"] = sorted({k for s in self.samples for k, v in s.flagged.items() if v})
        behind = [s.t_s - s.produced / self.rate for s in self.phase(lo, float("inf"))]
        out["producer_behind_max_s"] = round(max(behind), 2) if behind else None
        return out


class Steady:
    """Produce `rate` events/s on a schedule (through the ingest valve) until stopped."""

    def __init__(self, cfg: Config, client: redis.Redis, rate: float) -> None:
        self.producer = Producer.from_config(cfg, client, batch_events=200)
        self.rate = rate
        self.sent = 0
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="steady-producer", daemon=True)

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.thread.start()

    def _run(self) -> None:
        epoch_ms = int(time.time() * 1000)
        while not self._stop.is_set():
            due = int((time.monotonic() - self.t0) * self.rate)
            n = min(due - self.sent, int(self.rate))
            if n <= 0:
                time.sleep(0.02)
                continue
            for i in range(self.sent, self.sent + n):
                card = f"c{i % CARDS}"
                self.producer.send({"ts": epoch_ms + int(i * 1000 / self.rate), "card": card,
                                    "amount": 1.0})  # fmt: skip
            self.producer.flush()  # blocks while the ingest is throttled
            self.sent += n

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)
        self.producer.close()


def _flags(board: Board) -> dict[str, bool]:
    out: dict[str, bool] = {}
    for st in board.tasks(int(time.time() * 1000)).values():
        stage = str(st.get("stage"))
        out[stage] = out.get(stage, False) or bool(st.get("backpressure"))
    return out


def run_experiment(
    redis_url: str,
    spark: Any,
    state_dir: Path,
    propagation: str,
    rate: float = 1000.0,
    warm_s: float = 25.0,
    slow_s: float = 30.0,
    tail_s: float = 10.0,
    slow_write_ms: float = 6000.0,
    stream_hw: int = 300_000,
    progress: bool = False,
) -> Result:
    """Run the graph in this process, produce for warm + slow + tail seconds, slow the left
    branch's store in the middle, and sample every half second."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    cfg = branch_config(redis_url, state_dir, propagation, stream_hw)
    run = Pipeline(cfg, RedisHandle(redis_url), spark)
    run.prepare()
    folds = {q.name: q for q in run.queries if isinstance(q, FoldQuery)}
    runner = threading.Thread(target=run.run_forever, name="branches", daemon=True)
    runner.start()
    base = warm_up(cfg, client, 180)
    board = Board(client)
    producer = Steady(cfg, client, rate)
    result = Result(propagation, rate, warm_s, warm_s + slow_s)
    producer.start()
    try:
        end = warm_s + slow_s + tail_s
        while (t := time.monotonic() - producer.t0) < end:
            slow = warm_s <= t < warm_s + slow_s
            folds["fold:left"].writer = SlowStore(slow_write_ms) if slow else write_partition
            folded = {b: n - base[b] for b, n in _folded(client).items()}
            result.samples.append(Sample(t, producer.sent, folded, _flags(board)))
            if progress and len(result.samples) % 10 == 0:
                s = result.samples[-1]
                flagged = sorted(k for k, v in s.flagged.items() if v)
                print(f"  {propagation} t={t:5.1f}s produced={s.produced} folded={s.folded}"
                      f" flagged={flagged}", flush=True)  # fmt: skip
            time.sleep(0.5)
    finally:
        producer.stop()
        run.request_stop()
        runner.join(60)
        client.close()
    return result


def _folded(client: redis.Redis) -> dict[str, int]:
    return {b: int(client.hget(stats_keys(f"fold:{b}").stats, "events_in") or 0) for b in BRANCHES}


def warm_up(cfg: Config, client: redis.Redis, timeout_s: float, n: int = 2000) -> dict[str, int]:
    """Send `n` events and wait until both branches folded them (a new JVM's first batches are
    slow); returns the folded counts to subtract later."""
    with Producer.from_config(cfg, client, batch_events=200) as producer:
        now = int(time.time() * 1000)
        producer.send_many({"ts": now, "card": f"c{i % CARDS}", "amount": 1.0} for i in range(n))
        producer.flush()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        folded = _folded(client)
        if all(v >= n for v in folded.values()):
            return folded
        time.sleep(0.5)
    raise TimeoutError(f"the branches did not fold {n} warm-up events in {timeout_s}s")
