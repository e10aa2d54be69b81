"""Throughput and freshness per source: Redis Streams (`jsonl`, `fields`) and Kafka (`jsonl`,
`json`, on the test broker `sluice.testing.kafka.KafkaBroker`), side by side in one run.

    .venv/bin/python bench/throughput.py            # full run, 13 minutes to half an hour
    .venv/bin/python bench/throughput.py --quick    # smoke run, about 5 minutes

Per source: the drain of a pre-filled backlog, the highest sustained produce rate, freshness
probes (`lib.freshness`), and the bare engine (the same Spark plan fed from in-memory Arrow).
bench/templates/throughput.md says what each number means. Writes
bench/results/throughput[.quick].json.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from lib import freshness
from lib.bare import BARE_PARTITIONS, bare_run
from lib.load import SHARDS, SIZES, PacedProducer, bench_config, build_pool, now_ms
from lib.procs import CpuSnapshot, Workspace, drain, pipeline_run, stat_counter
from lib.results import Run, log, parser
from lib.stats import judge_step
from sluice.pipeline.spark import build_spark
from sluice.source.kafka_records import forget_consumers
from sluice.status.snapshot import backlog, recent_batches
from sluice.testing.arrow_source import ArrowFileSource
from sluice.testing.kafka import BULK_PRODUCER_OPTIONS, KafkaBroker

SAMPLE_EVERY_S = 0.5
MAX_LAG_S = 15.0  # a step whose final backlog exceeds this much input is not bounded
ABORT_LAG_S = 25.0  # ... and one whose backlog passes this is cut short
BATCH_HISTORY = 600  # the store keeps this many batch records
DRAIN_EVENTS = {(True, "jsonl"): 400_000, (True, "fields"): 80_000, (False, "jsonl"): 3_000_000,
                (False, "fields"): 1_000_000}  # fmt: skip
SOURCES = ("redis-jsonl", "kafka-jsonl", "redis-fields", "kafka-json")  # pairs side by side


def rows(records: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Batch records as [batch, events, started_ms, done_ms], for the plots."""
    return [[r["batch"], r["events"], r["started_ms"], r["done_ms"]] for r in records]


class Case:
    """Every measurement of one source (log and format); `results` and `series` fill up."""

    def __init__(self, spark: Any, a: Any, name: str, ws: Workspace, budget_s: float,
                 broker: KafkaBroker | None) -> None:  # fmt: skip
        self.spark, self.a, self.name, self.ws, self.broker = spark, a, name, ws, broker
        self.log, self.fmt = name.split("-")
        sized = (a.quick, "fields" if self.fmt == "json" else self.fmt)  # both an event an entry
        (self.cap, self.pool_events), self.drain_events = SIZES[sized], DRAIN_EVENTS[sized]
        self.deadline = time.monotonic() + budget_s
        self.kafka = None if broker is None else (broker.bootstrap, f"events-{self.fmt}")
        if broker is not None:  # a topic per source
            broker.create_topic(f"events-{self.fmt}", partitions=SHARDS)
        self.results: dict[str, Any] = {"source": name, "log": self.log, "format": self.fmt}
        self.results |= {"batch_events": self.cap, "drain_events": self.drain_events}
        self.series: dict[str, Any] = {"samples": [], "spans": []}
        self.t0_ms, self.sent = 0, 0

    def measure(self) -> None:
        """1. drain, 2. sustained, 3. freshness on one pipeline, events in vs sent; 4. bare."""
        self.cfg = bench_config(self.fmt, self.ws.state_dir(f"{self.name}-pipeline"), self.cap,
                                kafka=self.kafka)  # fmt: skip
        with pipeline_run(self.spark, self.cfg) as (self.pipeline, self.handle):
            self.target = self.kafka or self.handle.url  # where the load goes
            e, b = self.handle.embedded, self.broker  # the servers beside Spark
            pids = {"redis": e and e.pid, "broker": b and b.proc and b.proc.pid}
            cpu0 = CpuSnapshot.take(servers := {k: [v] for k, v in pids.items() if v})
            drain_per_s = self.drain()
            if drain_per_s is None:
                log(f"{self.name}: no drain rate, skipping the sustained and freshness runs")
            else:
                self.sustained(drain_per_s)
            idle = self.pipeline.wait_idle(60.0)
            counted = stat_counter(self.handle.client, "events_in")
            self.results["events"] = {"sent": self.sent, "counted": counted, "idle": idle}
            self.results["cores"] = CpuSnapshot.take(servers).cores_since(cpu0)
        self.bare()
        r, bare = self.results, self.results["bare"].get("per_s")
        rates = {"drain": r["drain"].get("per_s"), "sustained": r.get("sustained_per_s")}
        r |= {f"{x}_vs_bare": v / bare if v and bare else None for x, v in rates.items()}

    def drain(self) -> float | None:
        """Pre-fill, then start the pipeline and wait until it is idle; its rate or None."""
        handle, cfg = self.handle, self.cfg
        pool = build_pool(cfg, self.pool_events, self.a.seed, now_ms())
        d = drain(self.pipeline, handle, cfg, pool, self.drain_events, self.a.drain_timeout_s,
                  self.name, self.target)  # fmt: skip
        rate, sizes = d["rate"], sorted(r["events"] for r in d["records"])
        self.sent += d["prefilled"]
        self.results |= {
            "shard_share": [n / pool.total_events for n in pool.shard_events],
            "drain_batch_events": [sizes[0], sizes[-1]] if sizes else None,
            "drain": {"prefilled": d["prefilled"], "idle": d["idle"], **(rate or {}),
                      "events_in": stat_counter(handle.client, "events_in"),
                      "dead_letters": stat_counter(handle.client, "dead_letters")},
        }  # fmt: skip
        self.series["drain"] = rows(d["records"])
        return rate["per_s"] if rate and d["idle"] else None

    def sustained(self, drain: float) -> None:
        """The rate ladder (factors of the drain rate from 0.9: 1.25 x after a bounded step,
        0.7 x after an unbounded one, until both outcomes were seen), then freshness at about
        half the best bounded rate (half the lowest rate tried if none was bounded)."""
        self.t0_ms = self.series["t0_ms"] = now_ms()
        steps: list[dict[str, Any]] = []
        factor, reserve_s = 0.9, self.a.step_s + self.a.freshness_s + self.a.bare_reserve_s
        for i in range(self.a.max_steps):
            if self.deadline - time.monotonic() < reserve_s:
                log(f"{self.name} sustained: time budget reached, skipping further steps")
                break
            pool = build_pool(self.cfg, self.pool_events, self.a.seed + 10 + i, now_ms())
            steps.append(self.step(pool, factor * drain))
            log(f"{self.name} sustained: {steps[-1]}")
            if not steps[-1]["drained"]:
                log(f"{self.name} sustained: the backlog did not drain; stopping the ladder")
                break
            if len({s["bounded"] for s in steps}) == 2:
                break
            factor *= 1.25 if steps[-1]["bounded"] else 0.7
        best = max((s for s in steps if s["bounded"]), key=lambda s: s["achieved_per_s"],
                   default=None)  # fmt: skip
        self.results |= {"steps": steps, "sustained_per_s": best and best["achieved_per_s"],
                         "best_reason": best and best["reason"]}  # fmt: skip
        if steps and all(s["drained"] for s in steps):
            base = best["achieved_per_s"] if best else min(s["achieved_per_s"] for s in steps)
            pool = build_pool(self.cfg, self.pool_events, self.a.seed + 99, now_ms())
            t_from = (now_ms() - self.t0_ms) / 1000
            per = pool.events_per_entry()
            res = freshness.measure(self.handle.url, self.cfg, pool, base / 2, self.a.freshness_s,
                                    lambda: self.sample(per), self.target)  # fmt: skip
            self.sent += res["load_events"] + res["sent"]
            t_to = (now_ms() - self.t0_ms) / 1000
            self.series["spans"].append([t_from, t_to, res["load_per_s"], None])
            self.results["freshness"] = res
            log(f"{self.name} freshness: {res}")
        self.series["sustained"] = rows(recent_batches(self.handle.client, BATCH_HISTORY))

    def sample(self, per_entry: float) -> tuple[float, int]:
        """(t_s, the backlog in events: uncommitted entries x events per entry), for the plot."""
        entries = backlog(self.handle.client, self.cfg)[0]
        t_b = ((now_ms() - self.t0_ms) / 1000, round(entries * per_entry))
        self.series["samples"].append(list(t_b))
        return t_b

    def step(self, pool: Any, rate_per_s: float) -> dict[str, Any]:
        """Produce at `rate_per_s` for `step_s` beside the running pipeline, sampling the
        backlog (cut short past ABORT_LAG_S of input); let it drain, then judge the step."""
        client, per = self.handle.client, pool.events_per_entry()
        events_before = stat_counter(client, "events_in")
        producer = PacedProducer(self.target, pool, rate_per_s, self.a.step_s)
        start_ms = now_ms()
        producer.start()
        samples: list[tuple[float, int]] = []
        aborted = False
        while producer.is_alive():
            producer.join(SAMPLE_EVERY_S)
            samples.append(self.sample(per))
            if samples[-1][1] > ABORT_LAG_S * rate_per_s and not aborted:
                aborted = True
                producer.stop()
        if producer.error is not None:
            raise RuntimeError(f"the load producer failed: {producer.error}")
        end_ms, achieved = now_ms(), producer.achieved_per_s()
        self.sent += producer.sent_events
        elapsed_s = max(producer.elapsed_s, 1e-9)
        processed = (stat_counter(client, "events_in") - events_before) / elapsed_s
        deadline = time.monotonic() + min(120.0, 20.0 + samples[-1][1] / max(processed, 1.0) * 2)
        while not (drained := self.pipeline.wait_idle(timeout_s=SAMPLE_EVERY_S)):
            self.sample(per)
            if time.monotonic() > deadline:
                break
        judged_from = start_ms + (end_ms - start_ms) / 3  # the step's last two thirds
        admitted = [r["events"] for r in recent_batches(client, BATCH_HISTORY)
                    if judged_from <= r["started_ms"] <= end_ms]  # fmt: skip
        bounded, reason = judge_step(samples, achieved, MAX_LAG_S, admitted, self.cap)
        if aborted:
            bounded, reason = False, f"cut short: backlog over {ABORT_LAG_S:.0f} s of input"
        span = [(start_ms - self.t0_ms) / 1000, (end_ms - self.t0_ms) / 1000]
        self.series["spans"].append([*span, achieved, bounded])
        return {"target_per_s": rate_per_s, "achieved_per_s": achieved, "reason": reason,
                "processed_per_s": processed, "bounded": bounded, "drained": drained}  # fmt: skip

    def bare(self) -> None:
        """The bare engine over `bare_batches` micro-batches of the same size (`bare_run`)."""
        state_dir = self.ws.state_dir(f"{self.name}-bare")
        cfg = bench_config(self.fmt, state_dir, self.cap, kafka=self.kafka)
        result, records = bare_run(self.spark, cfg, state_dir, self.cap, self.a.seed + 7,
                                   self.a.bare_batches, self.a.drain_timeout_s)  # fmt: skip
        self.results["bare"] = result
        self.series["bare"] = rows(records)
        log(f"{self.name} bare engine: {self.results['bare']}")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--sources", default=",".join(SOURCES), help=f"comma-separated: {SOURCES}")
    p.add_argument("--budget-s", type=float, help="time budget (default 450, quick 120 a source)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--keep-state", action="store_true", help="keep the temporary state dirs")
    a = p.parse_args()
    names = [f.strip() for f in a.sources.split(",") if f.strip()]
    if not names or any(n not in SOURCES for n in names):
        p.error(f"--sources: expected some of {','.join(SOURCES)}, got {a.sources!r}")
    # step length, steps, freshness run, bare batches, drain timeout, time kept for the bare run
    a.step_s, a.max_steps, a.freshness_s, a.bare_batches, a.drain_timeout_s, a.bare_reserve_s = (
        (10.0, 2, 8.0, 5, 120.0, 25.0) if a.quick else (30.0, 4, 30.0, 6, 300.0, 60.0))  # fmt: skip
    budget_s = a.budget_s or len(names) * (120.0 if a.quick else 450.0)
    run, ws, done, spark, broker = Run("throughput", a), Workspace(a.keep_state), [], None, None
    try:
        if any(n.startswith("kafka") for n in names):  # one broker; a topic per source
            broker = KafkaBroker(ws.root / "kafka-broker.log").start()
        spark = build_spark(bench_config("jsonl", ws.state_dir("spark"), 1), "sluice-bench")
        spark.dataSource.register(ArrowFileSource)
        for i, name in enumerate(names):
            share_s = (budget_s - (time.monotonic() - run.t0)) / (len(names) - i)
            log(f"== {name} (time share {share_s:.0f} s)")
            done.append(Case(spark, a, name, ws, share_s, broker if "kafka" in name else None))
            done[-1].measure()
    finally:
        if spark is not None:
            spark.stop()
        if broker is not None:
            forget_consumers()  # before the broker goes, or they keep trying to reach it
            broker.stop()
        ws.cleanup()
    f = freshness
    params = {"step_s": a.step_s, "max_lag_s": MAX_LAG_S, "bare_partitions": BARE_PARTITIONS,
              "probe_window": f.PROBE_WINDOW, "probe_every_ms": 1000 * f.PROBE_EVERY_S,
              "poll_every_ms": 1000 * f.POLL_EVERY_S,
              "kafka_bulk": BULK_PRODUCER_OPTIONS}  # fmt: skip
    run.write(params, {"sources": [c.results for c in done]}, {"sources": [c.series for c in done]})


if __name__ == "__main__":
    main()
