"""Freshness at steady rates, before and after: produce->queryable and the per-batch breakdown.

    .venv/bin/python bench/freshness.py                    # 2 rounds, about 25 minutes
    .venv/bin/python bench/freshness.py --quick            # 1 round, short phases, about 8 minutes
    .venv/bin/python bench/freshness.py --before bf544e9   # the revision to compare with
    .venv/bin/python bench/freshness.py --workload highcard  # six metrics, many keys, ~20 min

Two revisions of src/: `--before` (exported with `git archive`) and the working tree (`after`), each
run as `sluice run -c sluice.yaml` with PYTHONPATH at its src/, in alternating order per round
(before first in odd rounds, after first in even ones). Per cell (format, rate) and revision: a
fresh embedded Redis and state_dir, the bench config (`lib.load.bench_config_data`, default trigger;
with `--workload highcard` the six metrics of `lib.load.HIGHCARD_METRICS` and events of
`lib.load.highcard_frame`, keys uniform over 100,000 cards, times over 10 minutes). One seed event
starts the first batch; then a paced producer at the rate, a warm-up, and the measured phase with a
probe every `lib.freshness.PROBE_EVERY_S` (a card of its own, polled with the query engine until it
counts; `lib.freshness.ProbePoller`). Per cell: the achieved rate, the probes' p50, p99 and max
(those sent in the measured phase), the backlog at its end, the per-batch breakdown (medians of
`sluice:{stats}:timings` over the batches done in the measured phase, when the revision publishes
it) and, once the load stops and the backlog drains, whether `events_in` equals the events sent.
Writes bench/results/freshness[.quick].json (`freshness-highcard` for that workload) after every
cell.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from lib.freshness import PROBE_EVERY_S, ProbePoller
from lib.load import (
    HIGHCARD_METRICS,
    METRICS,
    PacedProducer,
    bench_config_data,
    build_pool,
    now_ms,
    open_writer,
    probe_command,
)
from lib.procs import SluiceProcess, Workspace, stat_counter
from lib.results import ROOT, Run, log, parser
from lib.revisions import REVISIONS, export, order
from lib.stats import median, percentile
from sluice.config import config_from_dict
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import STATS_KEY, timings_key
from sluice.status.snapshot import backlog
from sluice.status.timings import PHASES, summarize

CELLS = {
    "zipf": (("jsonl", 2_000), ("fields", 2_000), ("jsonl", 20_000), ("fields", 20_000),
             ("jsonl", 100_000)),
    # six metric groups: batches past `spark.single_task_events: auto` (5,333 events) at 10,000/s
    "highcard": (("fields", 2_000), ("fields", 10_000), ("jsonl", 10_000)),
}  # fmt: skip
METRICS_OF = {"zipf": METRICS, "highcard": HIGHCARD_METRICS}
TARGET_P99_MS = {2_000: 1_000, 10_000: 1_000, 20_000: 1_000, 100_000: 1_500}
BATCH_CAP = 200_000
POOL_EVENTS = 100_000  # cycled
START_S, TAIL_S, DRAIN_S = 240.0, 30.0, 180.0


def wait(ok: Any, timeout_s: float, proc: SluiceProcess) -> bool:
    """Poll `ok` until true (True) or `timeout_s` (False); raise if `sluice run` exited."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        if not proc.alive():
            raise RuntimeError(f"sluice run exited: {proc.tail()}")
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_cell(rev: str, src: Path, fmt: str, rate: int, ws: Workspace, a: Any) -> dict[str, Any]:
    root = ws.state_dir(f"{rev}-{fmt}-{rate}")
    with EmbeddedRedis(root / "redis") as server:
        data = bench_config_data(fmt, root / "state", BATCH_CAP) | {
            "redis": server.url, "metrics": METRICS_OF[a.workload]}  # fmt: skip
        (cfg_path := root / "sluice.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        cfg, client = config_from_dict(data), redis.Redis.from_url(server.url)
        pool = build_pool(cfg, POOL_EVENTS, a.seed, now_ms(), a.workload)
        proc = SluiceProcess(["run", "-c", str(cfg_path)], root / "run.log",
                             env={"PYTHONPATH": str(src)}).start()  # fmt: skip
        producer = PacedProducer(server.url, pool, rate, retry_busy=True)
        poller, sender = ProbePoller(cfg, server.url), open_writer(server.url)
        t_start, probes = time.monotonic(), int(a.measure_s / PROBE_EVERY_S)
        try:
            sender.call_many([probe_command(cfg, "seed", now_ms())])  # starts the first batch
            if not wait(lambda: client.hget(STATS_KEY, "last_batch"), START_S, proc):
                raise RuntimeError(f"no batch within {START_S:.0f} s: {proc.tail()}")
            started_s = time.monotonic() - t_start
            producer.start()
            poller.start()
            time.sleep(a.warmup_s)
            m0, sent0, t0_ms = time.monotonic(), producer.sent_events, now_ms()
            for i in range(probes):
                command = probe_command(cfg, f"probe-{i}", sent_ms := now_ms())
                with poller.lock:
                    poller.pending[f"probe-{i}"] = sent_ms
                sender.call_many([command])
                time.sleep(max(0.0, m0 + (i + 1) * PROBE_EVERY_S - time.monotonic()))
            m1, sent1, t1_ms = time.monotonic(), producer.sent_events, now_ms()
            left = backlog(client, cfg)[0]
            wait(lambda: not poller.pending or poller.error, TAIL_S, proc)  # the last probes
            producer.stop()
            producer.join(30)
            for who, err in (("probe poller", poller.error), ("producer", producer.error)):
                if err is not None:
                    raise RuntimeError(f"the {who} failed: {err!r}")
            sent = producer.sent_events + probes + 1  # the seed event too
            drained = wait(lambda: stat_counter(client, "events_in") >= sent, DRAIN_S, proc)
            time.sleep(1.0)
            events_in = stat_counter(client, "events_in")
            entries = [orjson.loads(x) for x in client.lrange(timings_key(), 0, -1)]
        finally:
            producer.stop()
            poller.done.set()
            poller.join(5)
            sender.close()
            proc.stop()
    measured = [e for e in entries if t0_ms <= (e.get("done_ms") or 0) < t1_ms]
    lat = sorted(poller.latencies_ms)
    return {
        "revision": rev, "format": fmt, "rate": rate, "first_batch_s": round(started_s, 1),
        "achieved_per_s": (sent1 - sent0) / (m1 - m0), "probes_sent": probes,
        "probes_seen": len(lat), "wrong": poller.wrong, "p50_ms": percentile(lat, 0.5),
        "p99_ms": percentile(lat, 0.99), "max_ms": lat[-1] if lat else None,
        "backlog_entries": left, "backlog_events": round(left * pool.events_per_entry()),
        "events_sent": sent, "events_in": events_in, "drained": drained,
        "exact": events_in == sent,
        "busy_replies": producer.busy_replies, "latencies_ms": lat,
        "breakdown": summarize(measured) if measured else None,
    }  # fmt: skip


def summary(cells: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    """Medians over the rounds per (revision, format, rate); the breakdown's per phase."""
    rows = []
    for fmt, rate in CELLS[workload]:
        for rev in REVISIONS:
            cs = [c for c in cells if (c["revision"], c["format"], c["rate"]) == (rev, fmt, rate)]
            ok = [c for c in cs if "error" not in c]

            def med(key: str, cs: list[Any] = ok) -> float | None:
                return median([c[key] for c in cs if c.get(key) is not None])

            bds = [c["breakdown"] for c in ok if c.get("breakdown")]
            bd = {"batches": sum(b["batches"] for b in bds), "total_ms": median(
                  [b["total_ms"] for b in bds]), "events": median([b["events"] for b in bds]),
                  "phases_ms": {p: median([b["phases_ms"].get(p, 0.0) for b in bds])
                                for p in PHASES}} if bds else None  # fmt: skip
            p99, target = med("p99_ms"), TARGET_P99_MS[rate]
            rows.append({
                "revision": rev, "format": fmt, "rate": rate, "runs": len(ok),
                "errors": [c["error"] for c in cs if "error" in c],
                "achieved_per_s": med("achieved_per_s"), "p50_ms": med("p50_ms"),
                "p99_ms": p99, "max_ms": med("max_ms"), "p99_each": [c["p99_ms"] for c in ok],
                "probes_sent": sum(c["probes_sent"] for c in ok),
                "probes_seen": sum(c["probes_seen"] for c in ok),
                "backlog_entries": med("backlog_entries"), "backlog_events": med("backlog_events"),
                "exact": all(c["exact"] for c in ok) if ok else None,
                "target_p99_ms": target, "met": p99 is not None and p99 <= target,
                "breakdown": bd,
            })  # fmt: skip
    return {"rows": rows, "phases": list(PHASES)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--before", default="bf544e9", help="the revision to compare with")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 2, quick 1)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workload", choices=sorted(CELLS), default="zipf",
                   help="zipf: the bench config; highcard: six metrics, many keys")  # fmt: skip
    a = p.parse_args()
    rounds = a.rounds or (1 if a.quick else 2)
    a.warmup_s, a.measure_s = (8.0, 12.0) if a.quick else (15.0, 30.0)
    cells_of = CELLS[a.workload]
    params = {"before": a.before, "rounds": rounds, "workload": a.workload, "cells": cells_of,
              "metrics": len(METRICS_OF[a.workload]), "warmup_s": a.warmup_s,
              "measure_s": a.measure_s, "probe_every_ms": PROBE_EVERY_S * 1000,
              "batch_cap": BATCH_CAP, "target_p99_ms": TARGET_P99_MS}  # fmt: skip
    name = "freshness" if a.workload == "zipf" else f"freshness-{a.workload}"
    run, ws, cells = Run(name, a), Workspace(), []
    try:
        with tempfile.TemporaryDirectory(prefix="sluice-bench-freshness-") as t:
            srcs = {"before": export(a.before, Path(t)), "after": ROOT / "src"}
            for rnd in range(rounds):
                for fmt, rate in cells_of:
                    for rev in order(rnd):
                        log(f"round {rnd + 1}: {rev} {fmt} at {rate:,}/s")
                        try:
                            cell = run_cell(rev, srcs[rev], fmt, rate, ws, a)
                        except Exception as e:  # noqa: BLE001 - recorded; the other cells go on
                            cell = {"revision": rev, "format": fmt, "rate": rate,
                                    "error": repr(e)}  # fmt: skip
                        cells.append(cell | {"round": rnd + 1})
                        log(", ".join(f"{k} {v}" for k, v in cell.items() if k != "latencies_ms"))
                        run.write(params, summary(cells, a.workload), {"cells": cells})  # so far
    finally:
        ws.cleanup()


if __name__ == "__main__":
    main()
