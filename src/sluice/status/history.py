"""A short per-second history of the pipeline, for the dashboard's charts.

Every API process runs a `Sampler` (started with the app, see `server.app`). Once a second it
reads a compact sample from Redis and offers it to `record_sample.lua`, which keeps the first
sample of each second and drops the rest: N workers (or servers) cost N small reads but one
write a second, and they share one history, so a reload of the page, whichever worker answers,
shows the same past. The list keeps `HISTORY_LEN` samples (10 minutes); nothing is kept while
no API server runs.

A sample holds counters, not rates, so samples taken by different processes still diff
exactly: `read_history` turns them into rates over `RATE_WINDOW` samples. Input is the
producers' `events_produced`; processed is `events_in`; each stage's rate is the difference of
its live tasks' `emitted_total` (for the spark stage: events admitted into micro-batches, counted
in `latestOffset`, before the batch runs). A counter that went down (a restarted task) gives no
rate for that step.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import orjson

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.redis.keys import HISTORY_KEY, HISTORY_SECOND_KEY, STATS_KEY
from sluice.redis.scripts import RECORD_SAMPLE, execute_loading, script_sha
from sluice.status.flow import flow_status
from sluice.status.snapshot import freshness_of, log_status, pipeline_health, recent_batches

log = logging.getLogger(__name__)

HISTORY_LEN = 600
RATE_WINDOW = 3  # samples a rate is taken over: smooths batches that land every few seconds
MAX_GAP_MS = 5_000  # consecutive samples further apart than this are not diffed


def take_sample(client: Any, cfg: Config, now_ms: int) -> dict[str, Any]:
    """One compact sample (about 400 bytes of JSON). Blocks on a few Redis round trips."""
    level, log_section = log_status(client, cfg)
    raw = client.hmget(STATS_KEY, list(_COUNTERS))
    stats = {k: int(v) for k, v in zip(_COUNTERS, raw, strict=True) if v is not None}
    recent = [b for b in recent_batches(client, 30) if b["done_ms"] >= now_ms - 10_000]
    fresh = freshness_of(recent)
    flow = flow_status(client, cfg, now_ms, timeline=0)
    stages = {
        name: {
            "rate": st["rate"],
            "origin": st["origin_rate"],
            "bp": int(st["backpressure"]),
            "over": int(st["overloaded"]),
            "ratio": st["backpressure_ratio"],
            "emitted": st["emitted_total"],
            "tasks": st["tasks"],
        }
        for name, st in flow["stages"].items()
    }
    return {
        "t": now_ms,
        "produced": stats.get("events_produced", 0),
        "in": stats.get("events_in", 0),
        "dead": stats.get("dead_letters", 0),
        "backlog": {
            "entries": level.entries if level else None,
            "bytes": level.bytes if level else None,
        },
        "fresh": {"p50": fresh["p50"], "p99": fresh["p99"]},
        "stages": stages,
        "state": pipeline_health(client, now_ms, log_section)["state"],
    }


_COUNTERS = ("events_produced", "events_in", "dead_letters")


def record_sample(client: Any, sample: dict[str, Any], keep: int = HISTORY_LEN) -> bool:
    """Offer `sample` for its second; False when another process already recorded that second."""
    second = int(sample["t"]) // 1000

    def run() -> Any:
        return client.evalsha(
            script_sha(RECORD_SAMPLE), 2, HISTORY_KEY, HISTORY_SECOND_KEY,
            second, orjson.dumps(sample), keep,
        )  # fmt: skip

    return bool(execute_loading(client, run, (RECORD_SAMPLE,)))


def read_history(client: Any, seconds: int) -> list[dict[str, Any]]:
    """The samples of the last `seconds` (at most HISTORY_LEN), oldest first, each with
    `input_per_s` and `processed_per_s` (None where the samples before it are missing)."""
    n = max(0, min(seconds, HISTORY_LEN))
    if n == 0:
        return []
    raw = client.lrange(HISTORY_KEY, 0, n + RATE_WINDOW - 1)
    samples = [orjson.loads(b) for b in reversed(raw)]
    with_rates = with_rates_of(samples)
    return with_rates[-n:]


def with_rates_of(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add rates to each sample, from the counters of the sample RATE_WINDOW back (or of the
    oldest one since the last gap): `input_per_s`, `processed_per_s`, `admitted_per_s`, and
    each stage's `emitted_per_s`. None where there is nothing to diff. Pure; oldest first."""
    out = []
    run_start = 0  # the first sample after the last gap
    for i, s in enumerate(samples):
        if i and not 0 < s["t"] - samples[i - 1]["t"] <= MAX_GAP_MS:
            run_start = i
        a = samples[max(run_start, i - RATE_WINDOW)]
        dt_s = (s["t"] - a["t"]) / 1000

        def rate(now: Any, then: Any, dt_s: float = dt_s) -> float | None:
            if dt_s <= 0 or now is None or then is None or now < then:
                return None
            return round((now - then) / dt_s, 1)

        stages = {
            name: {**st, "emitted_per_s": rate(st.get("emitted"), _emitted(a, name))}
            for name, st in (s.get("stages") or {}).items()
        }
        out.append(
            {
                **s,
                "input_per_s": rate(s["produced"], a["produced"]),
                "processed_per_s": rate(s["in"], a["in"]),
                "admitted_per_s": (stages.get("spark") or {}).get("emitted_per_s"),
                "stages": stages,
            }
        )
    return out


def _emitted(sample: dict[str, Any], stage: str) -> Any:
    return ((sample.get("stages") or {}).get(stage) or {}).get("emitted")


class Sampler:
    """Takes and records one sample every `interval_s`, on a daemon thread, until `stop()`.

    Never raises: a Redis outage is logged at debug and the next second tries again.
    """

    def __init__(
        self, client: Any, cfg: Config, clock: Clock = SYSTEM_CLOCK, interval_s: float = 1.0
    ) -> None:
        self.client = client
        self.cfg = cfg
        self.clock = clock
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> bool:
        now = self.clock.now_ms()
        return record_sample(self.client, take_sample(self.client, self.cfg, now))

    def _loop(self) -> None:
        while True:
            try:
                self.sample_once()
            except Exception as e:  # noqa: BLE001 - Redis may be down; the next second retries
                log.debug("history sample failed", extra={"error": str(e)})
            # Sample just after each second starts, so one sample lands in every second.
            wait = self.interval_s - (self.clock.now_ms() % 1000) / 1000
            if self._stop.wait(wait if wait > 0 else self.interval_s):
                return

    def start(self) -> Sampler:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="sluice-history", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
