"""Freshness, produce → queryable: probe events with unique cards beside a paced load, and a
poller that queries each probe's count until it shows. Latency = the first poll reply that
counts the probe − its send time, so up to one poll interval high.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from lib.load import LoadPool, PacedProducer, now_ms, open_writer, probe_command
from lib.stats import percentile
from sluice.config import Config
from sluice.query.engine import QueryEngine
from sluice.redis.connection import client_for

PROBE_EVERY_S, POLL_EVERY_S = 0.1, 0.025
PROBE_WINDOW = "5m"
METRIC = "txn_count"  # a count by card: each probe's own key counts 1


class ProbePoller(threading.Thread):
    """Polls METRIC for every pending probe card until it counts >= 1: `latencies_ms` gets
    visible - sent per probe seen, `wrong` a card's count when it was not exactly 1."""

    def __init__(self, cfg: Config, url: str) -> None:
        super().__init__(name="bench-probe-poller", daemon=True)
        self.engine = QueryEngine(cfg, client_for(url))
        self.pending: dict[str, int] = {}  # card -> sent ms
        self.latencies_ms: list[float] = []
        self.wrong: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.lock, self.done = threading.Lock(), threading.Event()

    def run(self) -> None:
        try:
            while not self.done.wait(POLL_EVERY_S):
                with self.lock:
                    cards = list(self.pending)[:1000]
                lookups = [self.engine.lookup(METRIC, [c], PROBE_WINDOW) for c in cards]
                answers = self.engine.run(lookups) if cards else []
                seen_ms = now_ms()
                with self.lock:
                    for card, ans in zip(cards, answers, strict=True):
                        if ans["value"] >= 1:
                            self.latencies_ms.append(seen_ms - self.pending.pop(card))
                            if ans["value"] != 1:
                                self.wrong[card] = ans["value"]
        except Exception as e:  # noqa: BLE001 - handed to the caller, which raises it
            self.error = e


def measure(url: str, cfg: Config, pool: LoadPool, rate_per_s: float, seconds: float,
            on_probe: Callable[[], object], target: Any = None) -> dict[str, Any]:  # fmt: skip
    """Load at `rate_per_s` (2 s to reach its pace first) into `target` (default `url`, the
    slices' Redis), a probe every PROBE_EVERY_S for `seconds` (`on_probe` called after each),
    then up to 30 s for the last probes to show. Raises RuntimeError if a thread failed."""
    producer = PacedProducer(target or url, pool, rate_per_s, seconds + 3.0)
    poller, sender = ProbePoller(cfg, url), open_writer(target or url)
    producer.start()
    time.sleep(2.0)
    poller.start()
    n_probes = int(seconds / PROBE_EVERY_S)
    try:
        t0 = time.monotonic()
        for i in range(n_probes):
            command = probe_command(cfg, f"probe-{i}", sent_ms := now_ms())
            with poller.lock:
                poller.pending[f"probe-{i}"] = sent_ms
            sender.call_many([command])
            on_probe()
            time.sleep(max(0.0, t0 + (i + 1) * PROBE_EVERY_S - time.monotonic()))
        producer.join(10.0)
        until = time.monotonic() + 30.0
        while poller.pending and time.monotonic() < until and poller.is_alive():
            time.sleep(0.1)
    finally:
        producer.stop()
        poller.done.set()
        poller.join(5.0)
        sender.close()
    for who, err in (("probe poller", poller.error), ("load producer", producer.error)):
        if err is not None:
            raise RuntimeError(f"the {who} failed: {err}")
    lat = sorted(poller.latencies_ms)
    return {"load_per_s": producer.achieved_per_s(), "load_events": producer.sent_events,
            "sent": n_probes, "seen": len(lat), "p50_ms": percentile(lat, 0.5),
            "p99_ms": percentile(lat, 0.99), "max_ms": lat[-1] if lat else None,
            "wrong": poller.wrong}  # fmt: skip
