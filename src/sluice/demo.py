"""`sluice demo`: embedded Redis, the Spark pipeline, the API and bursty load, in one process."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from sluice.clock import SYSTEM_CLOCK
from sluice.commands import handlers_kept, stop_spark
from sluice.config import Config, config_from_dict
from sluice.redis.connection import open_redis
from sluice.redis.embedded import port_free

log = logging.getLogger(__name__)

DEMO_CONFIG: dict[str, Any] = {
    "source": {
        "stream": "events",
        "shards": 2,
        "format": "jsonl",
        "schema": {"ts": "long", "card": "string", "merchant": "string", "amount": "double"},
        "time_field": "ts",
    },
    "metrics": [
        {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1h"},
        {"name": "card_max_amount", "key": ["card"], "agg": "max", "value": "amount",
         "slice": "10s", "retention": "1h"},
        {"name": "merchant_txn", "key": ["merchant"], "agg": "count", "slice": "10s",
         "retention": "1h"},
        {"name": "amount_sum", "key": ["merchant"], "agg": "sum", "value": "amount",
         "filter": "amount > 0", "slice": "10s", "retention": "1h"},
        {"name": "avg_amount", "key": ["merchant"], "agg": "avg", "value": "amount",
         "slice": "10s", "retention": "1h"},
    ],
    "derived": [{"name": "avg_ticket", "expr": "amount_sum / merchant_txn"}],
    "spark": {"master": "local[2]", "trigger": "500ms"},
    # Watermarks sized to the demo's bursts (about 2 MB/s of input at their peak), so that a
    # burst visibly throttles the producer and the gate holds the backlog near 1 MB.
    "backpressure": {"controller": "stepwise", "high_watermark": "1MB",
                     "low_watermark": "100KB", "sensitivity": "2s"},
}  # fmt: skip


def demo_config(state_dir: Path) -> Config:
    return config_from_dict({**DEMO_CONFIG, "state_dir": str(state_dir.resolve())})


class _StoppedEarly(Exception):
    """A stop asked for before Spark started (`run_demo`)."""


def run_demo(
    state_dir: Path,
    duration_s: float | None,
    rate: float,
    port: int,
    stop: threading.Event | None = None,
    on_spark: Callable[[], None] | None = None,
) -> None:
    """Run until `duration_s` passes or `stop` is set (the CLI sets it on SIGINT or SIGTERM),
    then stop everything. Prints the URL and a status line. `on_spark` is called once the
    Spark session exists (the CLI puts its signal handlers back then)."""
    from sluice.pipeline.run import Pipeline
    from sluice.pipeline.spark import build_spark
    from sluice.server.app import create_app
    from sluice.source.loadgen import Profile, run_load
    from sluice.status.snapshot import read_status

    state_dir.mkdir(parents=True, exist_ok=True)
    cfg = demo_config(state_dir)
    produced = {"events": 0}
    stop = stop or threading.Event()
    if port and not port_free(port):
        print(f"port {port} is busy; using a free port instead", file=sys.stderr)
        port = 0
    with open_redis(None, cfg.state_dir, durability=cfg.durability) as handle:
        server = uvicorn.Server(
            uvicorn.Config(create_app(cfg, handle.client), host="127.0.0.1", port=port,
                           log_level="warning")
        )  # fmt: skip
        api = threading.Thread(target=server.run, name="api", daemon=True)
        api.start()
        while not server.started and api.is_alive():
            time.sleep(0.05)
        bound = server.servers[0].sockets[0].getsockname()[1] if server.servers else port
        print(f"Sluice demo: open the dashboard at http://127.0.0.1:{bound}/", flush=True)
        spark = None
        try:  # a Ctrl-C to the process group stops the JVM too, maybe as it starts
            if stop.is_set():  # a Ctrl-C while Redis and the API started: Spark never starts
                raise _StoppedEarly
            print("starting Spark (takes a few seconds)...", flush=True)
            with handlers_kept():  # a Ctrl-C while Spark starts stops the demo as any other
                spark = build_spark(cfg, app_name="sluice-demo")
            if on_spark is not None:
                on_spark()
            # As `sluice run` runs it: the supervisor (health, restarts), the lease and the
            # role, so that the dashboard's state, heartbeat and processes are true here too.
            pipeline = Pipeline(cfg, handle, spark)
            # The pipeline knows of a stop at once, as `sluice run`'s does: a signal to the
            # process group takes the JVM, and a query starting then is the stop's, no failure
            threading.Thread(target=_stop_on, args=(stop, pipeline), daemon=True).start()
            pipeline.prepare()
        except BaseException:
            server.should_exit = True
            api.join(timeout=10)
            if spark is not None:
                stop_spark(spark)
            if not stop.is_set():
                raise
            print("stopped before the pipeline started", flush=True)
            return
        failed: list[BaseException] = []

        def run_pipeline() -> None:
            try:
                pipeline.run_forever()
            except Exception as e:  # noqa: BLE001 - shown below, and the demo stops
                failed.append(e)

        runner = threading.Thread(target=run_pipeline, name="pipeline", daemon=True)
        runner.start()
        load = threading.Thread(
            target=run_load,
            kwargs={
                "cfg": cfg, "client": handle.client, "rate": rate,
                "duration_s": duration_s if duration_s is not None else 10**9,
                "profile": Profile("burst"), "stop": stop.is_set,
                "progress": lambda p: produced.update(events=p["events"]),
            },
            name="load", daemon=True,
        )  # fmt: skip
        load.start()
        example = f"http://127.0.0.1:{bound}/v1/metrics/txn_count?key=card-0&window=5m"
        print(f"example: curl '{example}'", flush=True)
        started = time.monotonic()
        bad = _BadEvents(cfg, handle.client)
        tty = sys.stdout.isatty()
        prev_in: tuple[float, int] | None = None
        try:
            while not stop.is_set():
                if duration_s is not None and time.monotonic() - started >= duration_s:
                    break
                stop.wait(1.0 if tty else 2.0)
                if stop.is_set():
                    break
                bad.maybe_send()
                st = read_status(handle.client, cfg, SYSTEM_CLOCK.now_ms(), window_s=5)
                events_in = st["counters"].get("events_in", 0)
                now = time.monotonic()
                backlog_ev = st["backlog"]["entries"] or 0
                # Input rate: what the load generator reports having written (about once a second).
                in_rate = 0.0
                if prev_in is not None and now > prev_in[0]:
                    in_rate = (produced["events"] - prev_in[1]) / (now - prev_in[0])
                prev_in = (now, produced["events"])
                f = st["freshness_ms"]
                line = (
                    f"in {in_rate:>9,.0f} ev/s | processed {st['processed_events_per_s']:>9,.0f}"
                    f" ev/s | backlog {backlog_ev:>6,} entries | freshness p50"
                    f" {_fmt(f['p50'])} p99 {_fmt(f['p99'])} | producer"
                    f" {_flow(st['flow']['stages']['ingest'])} | total {events_in:,}"
                )
                print("\r" + line if tty else line, end="" if tty else "\n", flush=True)
                if failed and not stop.is_set():
                    print(f"\npipeline failed: {failed[0]}", file=sys.stderr)
                    break
        except Exception:
            if not stop.is_set():
                raise
            log.debug("stopped while stopping", exc_info=True)  # the JVM went with the signal
        finally:
            stop.set()
            print("\nstopping...", flush=True)
            load.join(timeout=10)
            pipeline.request_stop()  # the batch in flight ends, then the queries and the lease
            runner.join(timeout=30)
            try:  # a signal to the whole process group stops Spark's JVM too
                spark.stop()
            except Exception as e:  # noqa: BLE001 - py4j raises all kinds once the JVM is gone
                log.debug("spark stop", extra={"error": str(e)})
            server.should_exit = True
            api.join(timeout=10)
            print(f"stopped: {produced['events']:,} events sent", flush=True)


def _stop_on(stop: threading.Event, pipeline: Any) -> None:
    stop.wait()
    pipeline.request_stop()


class _BadEvents:
    """A malformed event now and then, so the dashboard's dead letters and audit books have
    something to show: one every `every_s`, cycling through a few kinds of damage."""

    KINDS = (
        b'{"ts": %d, "card": "card-7", "merchant": "merchant-2", "amount": "twelve"}',
        b'{"ts": %d, "card": "card-3", "merchant": "merchant-1", "amount": 4.5',
        b'{"ts": %d, "merchant": "merchant-5", "amount": 9.99}',
        b'["ts", %d, "card-1"]',
    )

    def __init__(self, cfg: Config, client: Any, every_s: float = 7.0) -> None:
        from sluice.source.producer import Producer

        self.producer = Producer.from_config(cfg, client, flow=False)
        self.every_s = every_s
        self.next_s = time.monotonic() + every_s
        self.n = 0

    def maybe_send(self) -> None:
        if time.monotonic() < self.next_s:
            return
        self.next_s = time.monotonic() + self.every_s
        line = self.KINDS[self.n % len(self.KINDS)] % SYSTEM_CLOCK.now_ms()
        self.n += 1
        self.producer.send_lines(self.n % len(self.producer.keys), [line])
        try:
            self.producer.flush()
        except Exception as e:  # noqa: BLE001 - decoration only; the line stays buffered
            log.debug("bad event not sent", extra={"error": str(e)})


def _flow(stage: dict[str, Any]) -> str:
    """The ingest stage in a few characters: free, throttled to a rate (the flag up), or
    capped at one (the flag clear, a provisional cap not yet released)."""
    rate = stage["rate"]
    if stage["backpressure"]:
        return f"throttled to {rate:,.0f}/s" if rate is not None else "throttled"
    return "free     " if rate is None else f"capped at {rate:,.0f}/s"


def _fmt(ms: float | None) -> str:
    return "   –  " if ms is None else f"{ms:>5,.0f}ms"
