"""Crash test: `sluice run` is killed with SIGKILL twice under steady load (at least once in the
middle of a batch) and restarted each time. At the end every count and sum equals the
reference computed from what the producer had acknowledged, and every batch passed its audit."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import orjson
import pytest
import redis
import yaml

from sluice.redis.keys import STATS_KEY
from sluice.status.ledger import Ledger
from tests.conftest import wait_until

pytestmark = [pytest.mark.spark, pytest.mark.slow]
SLUICE = [sys.executable, "-m", "sluice.cli"]
KILLS = 2  # each a cold restart (~25-40 s here); every one lands mid-batch or close to it. The
# second kill lands on a process that had itself recovered from a kill.


class SteadyProducer(threading.Thread):
    """About 1,000 events/s in jsonl entries of 50 (`send` writes one); keeps the reference of
    what the log acknowledged."""

    def __init__(self, client: redis.Redis | None) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.stop = threading.Event()
        self.cards: Counter[str] = Counter()
        self.qty: Counter[str] = Counter()
        self.events = 0

    def send(self, i: int, payload: bytes, n: int) -> bool:
        """Write one entry of `n` events; True once the log acknowledged it."""
        assert self.client is not None
        self.client.xadd(f"events:{i % 2}", {"d": payload, "n": n})
        return True

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            now = time.time_ns() // 1_000_000
            batch = [
                {"ts": now, "card": f"c{(i + j) % 50}", "merchant": f"m{(i + j) % 7}",
                 "amount": 1.5, "qty": (i + j) % 5}
                for j in range(50)
            ]  # fmt: skip
            if self.send(i, b"\n".join(orjson.dumps(e) for e in batch), len(batch)):
                for e in batch:  # acknowledged: now it is owed
                    self.cards[e["card"]] += 1
                    self.qty[e["merchant"]] += e["qty"]
                self.events += len(batch)
            i += 50
            time.sleep(0.05)


def _in_flight(ckpt: Path) -> bool:
    """A batch is logged in the offset log and not yet in the commit log."""
    offsets = [int(p.name) for p in (ckpt / "offsets").glob("[0-9]*")]
    commits = {int(p.name) for p in (ckpt / "commits").glob("[0-9]*")}
    return bool(offsets) and max(offsets) not in commits


def _sum_slices(r: redis.Redis, metric: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in r.scan_iter(match=f"sluice:s:{{{metric}|*"):
        k = key.decode().split("|", 1)[1].rstrip("}")
        out[k] = sum(int(v.split(b":")[1]) for f, v in r.hgetall(key).items() if f != b"_m")
    return out


def kill_repeatedly(
    start: Callable[[], subprocess.Popen[bytes]],
    events_in: Callable[[], int],
    ckpt: Path,
    rng: random.Random,
    kills: int = KILLS,
) -> tuple[subprocess.Popen[bytes], int]:
    """SIGKILL `sluice run` (`start()` starts one) `kills` times, each after it committed a
    batch, at a random moment then when a batch is in flight if one comes within 3 s, and
    start it again each time. Returns the running process and the kills that landed
    mid-batch."""
    proc, mid_batch = start(), 0
    for _ in range(kills):
        before = events_in()
        wait_until(lambda b=before: events_in() > b, 180, "a committed batch after the (re)start")
        time.sleep(rng.uniform(0.2, 2.5))
        deadline = time.monotonic() + 3.0
        while not _in_flight(ckpt) and time.monotonic() < deadline:
            time.sleep(0.005)
        mid_batch += _in_flight(ckpt)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc = start()
    return proc, mid_batch


def steady_config(tmp_path: Path, redis_url: str, state: str = "state", **extra: Any) -> Path:
    """The config the SteadyProducer's events are folded with (`extra`: more sections), written
    to `<state>.yaml`; its state_dir is `tmp_path/<state>`."""
    path = tmp_path / f"{state}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "redis": redis_url,
                "state_dir": str(tmp_path / state),
                "source": {
                    "stream": "events", "shards": 2, "format": "jsonl",
                    "schema": {"ts": "long", "card": "string", "merchant": "string",
                               "amount": "double", "qty": "long"},
                },
                "metrics": [
                    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
                     "retention": "1d"},
                    {"name": "qty_sum", "key": ["merchant"], "agg": "sum", "value": "qty",
                     "slice": "1m", "retention": "1d"},
                ],
                "spark": {"trigger": "200ms"},
                **extra,
            }
        )
    )  # fmt: skip
    return path


def test_repeated_sigkills_under_load_lose_nothing_and_count_nothing_twice(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    cfg = steady_config(tmp_path, redis_url)
    ckpt = tmp_path / "state" / "checkpoint"
    crash_run(r, cfg, ckpt, random.Random(20261122), SteadyProducer(r), tmp_path)


class Owed(Protocol):
    """A producer thread and the reference of what its log acknowledged."""

    stop: threading.Event
    events: int
    cards: Counter[str]
    qty: Counter[str]

    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...


def crash_run(
    r: redis.Redis, cfg: Path, ckpt: Path, rng: random.Random, producer: Owed, tmp_path: Path
) -> None:
    """`sluice run -c cfg` under load from `producer`, killed KILLS times (`kill_repeatedly`),
    then drained and stopped with SIGTERM; every count, sum and audit must be exact."""
    logs = []
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        log = (tmp_path / f"run-{len(logs)}.log").open("w")
        logs.append(log)
        procs.append(subprocess.Popen([*SLUICE, "run", "-c", str(cfg)], stdout=log, stderr=log))
        return procs[-1]

    def events_in() -> int:
        return int(r.hget(STATS_KEY, "events_in") or 0)

    producer.start()
    try:
        proc, mid_batch = kill_repeatedly(start, events_in, ckpt, rng)
        time.sleep(3.0)
        producer.stop.set()
        producer.join(30)
        wait_until(lambda: events_in() >= producer.events, 240, "the backlog to drain")
        time.sleep(1.0)  # anything counted twice would show up as more than produced
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        producer.stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    print(f"kills that landed mid-batch: {mid_batch} of {KILLS}")
    assert mid_batch >= 1, "no kill landed in the middle of a batch"
    assert_exact(r, producer)


def assert_exact(r: redis.Redis, producer: Owed) -> dict[str, str]:
    """Every count and sum equals what the producer had acknowledged, and every committed
    batch passed its audit (a batch killed after its audit is audited again, counted once)."""
    stats = {k.decode(): v.decode() for k, v in r.hgetall(STATS_KEY).items()}
    assert int(stats["events_in"]) == producer.events
    assert _sum_slices(r, "txn_count") == dict(producer.cards)
    assert _sum_slices(r, "qty_sum") == dict(producer.qty)
    batches = int(stats["batches"])
    assert int(stats["audit_ok"]) == batches
    records = Ledger(r, "events", 16).recent(json_last_batch(stats), batches + 10)
    assert records and all(rec["ok"] for rec in records)
    return stats


def json_last_batch(stats: dict[str, str]) -> int:
    return int(orjson.loads(stats["last_batch"])["batch"])
