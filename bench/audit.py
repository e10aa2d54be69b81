"""The per-batch XOR audit: its throughput cost, the memory it holds, and how fast `sluice run`
comes back from a `kill -9` with the audit on.

    .venv/bin/python bench/audit.py            # full run, about 14 minutes
    .venv/bin/python bench/audit.py --quick    # smoke run, about 6 minutes

Drains with the audit on and off in ABBA order; the ledger's and `source_xor`'s memory; kills
under load (`lib.failover`). bench/templates/audit.md says what each number means. Writes
bench/results/audit[.quick].json.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import redis

from lib import load
from lib.failover import PREKILL_WINDOW_S, SAMPLE_S, Failover
from lib.procs import Workspace, drain, pipeline_run, stat_counter
from lib.results import Run, log, parser
from lib.stats import median
from sluice.config import AuditConfig, Config, config_from_dict
from sluice.pipeline.spark import build_spark
from sluice.redis.connection import client_for
from sluice.redis.embedded import EmbeddedRedis
from sluice.source.ids import ZERO_ID
from sluice.source.log import Admitted, Span
from sluice.source.options import SourceOptions
from sluice.source.streams import RedisStreamsLog
from sluice.source.walk import WALK_CHUNK as SOURCE_CHUNK
from sluice.status.ledger import LEDGER_KEEP, AuditResult, Ledger

STREAM = "events"
LEDGER_SHARDS = AuditConfig().ledger_shards
DRAIN_EVENTS = {(True, "jsonl"): 400_000, (True, "fields"): 80_000, (False, "jsonl"): 3_000_000,
                (False, "fields"): 800_000}  # fmt: skip
COUNTERS = ("events_in", "batches", "audit_ok", "audit_failed", "events_admitted")


def audited(fmt: str, state_dir: Path, cap: int, audit: bool, controller: str) -> Config:
    """The bench config with the audit on or off and `backpressure.controller` set."""
    backpressure = {"controller": controller}
    return load.bench_config(fmt, state_dir, cap, audit={"enabled": audit},
                             backpressure=backpressure)  # fmt: skip


def drain_once(spark: Any, a: argparse.Namespace, ws: Workspace, fmt: str, pool: load.LoadPool,
               audit: bool, seq: int, n_events: int) -> dict[str, Any]:  # fmt: skip
    """Pre-fill `n_events` into a fresh embedded Redis, start a fold, wait until idle."""
    cap = load.SIZES[(a.quick, fmt)][0]
    label = f"{fmt}-{'on' if audit else 'off'}-{seq}"
    cfg = audited(fmt, ws.state_dir(label), cap, audit, a.controller)
    with pipeline_run(spark, cfg) as (pipeline, handle):
        d = drain(pipeline, handle, cfg, pool, n_events, 120.0 if a.quick else 300.0, label)
        c = {k: stat_counter(handle.client, k) for k in COUNTERS}
        ledger = ledger_memory(handle.client) if audit else None
    sent, idle, records, rate = d["prefilled"], d["idle"], d["records"], d["rate"]
    problems = [] if idle else ["did not drain in time"]
    if c["events_in"] != sent:
        problems.append(f"events_in {c['events_in']:,} != {sent:,} written")
    if audit and (c["audit_ok"] != c["batches"] or c["audit_failed"]):
        problems.append(
            f"audit_ok {c['audit_ok']}, failed {c['audit_failed']}, {c['batches']} batches"
        )
    if audit and c["events_admitted"] != c["events_in"]:
        problems.append(f"events_admitted {c['events_admitted']:,} != events_in")
    return {"format": fmt, "audit": audit, "seq": seq, "prefilled": sent, "problems": problems,
            "busy_polls": d["busy_polls"], "records": records, "ledger": ledger,
            **(rate or {"per_s": None, "busy_per_s": None})}  # fmt: skip


def cost(spark: Any, a: argparse.Namespace, ws: Workspace, fmt: str) -> dict[str, Any]:
    """One uncounted warm-up drain (audit off), then `pairs` on/off pairs in ABBA order."""
    (cap, pool_events), n_events = load.SIZES[(a.quick, fmt)], DRAIN_EVENTS[(a.quick, fmt)]
    pool = load.build_pool(audited(fmt, ws.root, cap, True, "none"), pool_events, a.seed,
                           load.now_ms())  # fmt: skip
    log(f"== cost {fmt}: warm-up drain, audit off (not counted)")
    drain_once(spark, a, ws, fmt, pool, False, 0, 2 * cap)
    order = [x for pair in range(a.pairs) for x in ((True, False), (False, True))[pair % 2]]
    runs = [drain_once(spark, a, ws, fmt, pool, x, i + 1, n_events) for i, x in enumerate(order)]
    on, off = [r for r in runs if r["audit"]], [r for r in runs if not r["audit"]]
    measured = {id(r): r["records"][1:] for r in runs}  # the warm-up batch of each run dropped
    audit_ms = [x["audit"]["audit_ms"] for r in on for x in measured[id(r)] if "audit" in x]
    busy_ms = sum(x["done_ms"] - x["started_ms"] for r in on for x in measured[id(r)])
    sizes = [x["events"] for r in runs for x in measured[id(r)]]
    per_run = [[x["audit"]["audit_ms"] for x in r["records"] if "audit" in x] for r in on]
    ledger = next((r["ledger"] for r in on[::-1] if (r["ledger"] or {}).get("records")), None)
    m_on, m_off = (median([r["per_s"] for r in x if r["per_s"]]) for x in (on, off))
    for r in runs:
        r.pop("records")
    return {
        "format": fmt, "batch_cap": cap, "drain_events": n_events, "runs": runs,
        "on_per_s": m_on, "off_per_s": m_off, "on_vs_off": m_on / m_off if m_on and m_off else None,
        "audit_ms_median": median(audit_ms), "audit_ms_max": max(audit_ms, default=None),
        "audit_share": sum(audit_ms) / busy_ms if busy_ms and audit_ms else None,
        "batch_events": [min(sizes, default=0), max(sizes, default=0)],
        "busy_on": median([r["busy_per_s"] for r in on if r["busy_per_s"]]),
        "busy_off": median([r["busy_per_s"] for r in off if r["busy_per_s"]]),
        "audit_ms_by_position": [median([p[i] for p in per_run if i < len(p)])
                                 for i in range(max(map(len, per_run), default=0))],
        "ledger": ledger,
        "events_per_batch": median([x["events"] for r in on for x in measured[id(r)]]),
    }  # fmt: skip


def ledger_memory(client: Any) -> dict[str, Any]:
    """The ledger's footprint in Redis right now (all `audit.ledger_shards` hashes) and its
    failures list: `MEMORY USAGE ... SAMPLES 0` (every element, not Redis's 5-element guess)."""
    ledger = Ledger(client, STREAM, LEDGER_SHARDS)
    pipe = client.pipeline(transaction=False)
    for k in (ledger.key(n) for n in range(LEDGER_SHARDS)):
        pipe.hlen(k)
        pipe.execute_command("MEMORY", "USAGE", k, "SAMPLES", 0)
        pipe.hvals(k)
    pipe.llen(ledger.failures_key)
    pipe.execute_command("MEMORY", "USAGE", ledger.failures_key, "SAMPLES", 0)
    res = pipe.execute()
    lens = [int(x) for x in res[0 : 3 * LEDGER_SHARDS : 3]]
    values = [v for vs in res[2 : 3 * LEDGER_SHARDS : 3] for v in vs]
    size = sum(int(x or 0) for x in res[1 : 3 * LEDGER_SHARDS : 3])
    return {"hashes": sum(1 for n in lens if n), "records": sum(lens), "bytes": size,
            "per_record": size / sum(lens) if sum(lens) else None,
            "json_bytes": sum(map(len, values)) / len(values) if values else 0.0,
            "failures": int(res[-2]), "failures_bytes": int(res[-1] or 0)}  # fmt: skip


def fill_ledger(client: Any, batches: int, seed: int) -> dict[str, Any]:
    """Record `batches` balanced results (random 64-bit XORs, so the JSON is as long as a real
    one's) through the real `Ledger.record`; past shards x LEDGER_KEEP it must stop growing."""
    rng = random.Random(seed)
    ledger = Ledger(client, STREAM, LEDGER_SHARDS)
    for b in range(batches):
        x, fan = rng.getrandbits(64), rng.getrandbits(64)
        ledger.record(AuditResult(batch=b, attempt=1, source_x=x, fan_x=fan, applied_x=x ^ fan,
                                  events=1_000_000, entries=2000,
                                  audit_ms=round(rng.uniform(50, 500), 1)))  # fmt: skip
    return {**ledger_memory(client), "batches": batches}


def source_xor(url: str, client: Any, cfg: Config, end: dict[str, str]) -> Admitted:
    """The audit's source side (the product's own, `RedisStreamsLog.admitted`) over every
    entry of the shards up to `end`, on the Redis at `url`."""
    log_ = RedisStreamsLog(SourceOptions.from_config(cfg, url), client)
    return log_.admitted([Span(s, ZERO_ID, hi) for s, hi in end.items()])


def xor_memory(url: str, cfg: Config, pool: load.LoadPool, n_events: int) -> dict[str, Any]:
    """Write about `n_events` into `cfg`'s empty shards, then call `source_xor` over all of it:
    once untraced (timing, and warming the client), once under tracemalloc (peak above the
    baseline; tracemalloc sees numpy's buffers)."""
    load.prefill(url, pool, n_events)
    client = client_for(url, timeout_s=120)
    fmt = cfg.source.format
    end, chunk_entries = {}, 0
    for s in cfg.source.shard_keys():
        if top := client.xrevrange(s, "+", "-", count=1):
            end[s] = top[0][0].decode()
            chunk_entries = max(chunk_entries, min(int(client.xlen(s)), SOURCE_CHUNK[fmt]))
    t0 = time.perf_counter()
    source_xor(url, client, cfg, end)
    call_ms = (time.perf_counter() - t0) * 1000
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = source_xor(url, client, cfg, end)
        events, entries = got.events, got.entries
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    client.close()
    chunk_events = round(chunk_entries * pool.events_per_entry())
    per_event = peak / chunk_events if chunk_events else 0.0
    full_chunk = SOURCE_CHUNK[fmt] * chunk_events / max(chunk_entries, 1)  # events in a full one
    return {"format": fmt, "events": events, "entries": entries, "call_ms": call_ms,
            "us_per_event": call_ms * 1000 / max(events, 1), "peak_mb": peak / 1e6,
            "chunk_entries": SOURCE_CHUNK[fmt], "chunk_events": chunk_events,
            "bytes_per_event": per_event, "chunk_mb": full_chunk * per_event / 1e6}  # fmt: skip


def xor_scaling(url: str, cfg: Config, pool: load.LoadPool, entries: int) -> dict[str, Any]:
    """`source_xor` over one shard of `entries` entries (`pool` writes to that shard only),
    while another client PINGs every 50 ms: the longest round trip and the BUSY replies (Redis
    serves nobody else while a script or a command runs)."""
    shard = cfg.source.shard_keys()[0]
    client = client_for(url, timeout_s=600)
    load.prefill(url, pool, round(entries * pool.events_per_entry()))
    end = {shard: client.xrevrange(shard, "+", "-", count=1)[0][0].decode()}
    pinger, stop = client_for(url, timeout_s=600), threading.Event()
    seen = {"max_ms": 0.0, "busy": 0}

    def ping() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                pinger.ping()
            except redis.exceptions.ResponseError as e:
                if not load.is_busy(e):
                    raise
                seen["busy"] += 1
            seen["max_ms"] = max(seen["max_ms"], (time.perf_counter() - t0) * 1000)
            stop.wait(0.05)

    thread = threading.Thread(target=ping, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    try:
        got = source_xor(url, client, cfg, end)
        events, n = got.events, got.entries
        call_ms = (time.perf_counter() - t0) * 1000
    finally:
        stop.set()
        thread.join(timeout=600)
        pinger.close()
        client.close()
    return {"entries": n, "events": events, "call_ms": call_ms, "ping_max_ms": seen["max_ms"],
            "us_per_event": call_ms * 1000 / max(events, 1), "ping_busy": seen["busy"]}  # fmt: skip


def memory(a: argparse.Namespace, ws: Workspace) -> dict[str, Any]:
    """The ledger at its bound, `source_xor`'s memory per format, and its scaling."""
    xor_events = {"jsonl": 50_000 if a.quick else 100_000, "fields": 12_000 if a.quick else 30_000}
    with EmbeddedRedis(ws.state_dir("memory") / "redis") as server:
        client = client_for(server.url, timeout_s=60)
        bound = fill_ledger(client, LEDGER_SHARDS * (LEDGER_KEEP + 64), a.seed)
        xor = []
        for fmt in a.formats:
            client.flushall()
            cfg = load.bench_config(fmt, ws.root, load.SIZES[(a.quick, fmt)][0])
            pool = load.build_pool(cfg, min(load.SIZES[(a.quick, fmt)][1], xor_events[fmt]), a.seed,
                                   load.now_ms())  # fmt: skip
            xor.append(xor_memory(server.url, cfg, pool, xor_events[fmt]))
            log(f"memory {fmt}: {xor[-1]}")
        client.close()
    cfg = load.bench_config("jsonl", ws.root, 1)
    sizes = (20, 200) if a.quick else (20, 100, 400, 2000)
    # Cycled for the larger sizes; the first shard gets about 2/3 of the events.
    n_pool = min(200_000, round(max(sizes) * load.JSONL_EVENTS_PER_ENTRY * 1.6))
    pool = load.build_pool(cfg, n_pool, a.seed, load.now_ms()).only(cfg.source.shard_keys()[0])
    scaling = []
    for entries in sizes:
        with EmbeddedRedis(ws.state_dir(f"lua-{entries}") / "redis") as server:
            scaling.append(xor_scaling(server.url, cfg, pool, entries))
        log(f"source_xor over {entries} jsonl entries: {scaling[-1]}")
    return {"bound": bound, "xor": xor, "scaling": scaling}


def recovery(a: argparse.Namespace, ws: Workspace) -> tuple[dict[str, Any], dict[str, Any]]:
    """`lib.failover` with the audit on: jsonl, a paced producer, `kills` SIGKILLs."""
    root, cap = ws.state_dir("recovery"), 100_000 if a.quick else 1_000_000
    steady = (3.0, 6.0) if a.quick else (5.0, 10.0)
    log(f"== recovery: {a.kills} SIGKILLs, producer at {a.kill_rate:,.0f} events/s")
    with EmbeddedRedis(root / "redis") as server:
        data = load.bench_config_data("jsonl", root / "state", cap) | {
            "redis": server.url, "audit": {"enabled": True},
            "backpressure": {"controller": a.controller}}  # fmt: skip
        pool = load.build_pool(config_from_dict(data), 50_000 if a.quick else 200_000, a.seed + 1,
                               load.now_ms())  # fmt: skip
        res = Failover(data, root, pool, a.kill_rate, a.kills, steady, a.seed).run()
    kills = [c for c in res["cycles"] if c["killed_ms"]]

    def over(key: str) -> dict[str, Any]:
        vs = [c[key] for c in kills if c[key] is not None]
        return {"n": len(vs), "of": len(kills), "median": median(vs), "max": max(vs, default=None)}

    records, flow = res.pop("records"), res.pop("flow")
    big = [r for r in records if "audit" in r and r["events"] >= 10_000]
    k, worst = len(big) // 3, max(big, key=lambda r: r["audit"]["audit_ms"], default=None)

    def us(rs: list[dict[str, Any]]) -> float | None:
        return median([r["audit"]["audit_ms"] * 1000 / r["events"] for r in rs])

    drift = None if len(big) < 6 or worst is None else {
        "batches": len(records), "big": len(big), "first_us": us(big[:k]), "last_us": us(big[-k:]),
        "worst": {"batch": worst["batch"], "events": worst["events"],
                  "audit_ms": worst["audit"]["audit_ms"]}}  # fmt: skip
    res |= {"batch_events": cap, "rate_per_s": a.kill_rate, "steady_s": steady, "drift": drift,
            "summary": {"first_batch": over("first_batch_s"), "back": over("back_s"),
                        "supervisor": over("supervisor_s")}}  # fmt: skip
    series = {
        "t0_ms": res.pop("t0_ms"), "trigger_s": config_from_dict(data).spark.trigger / 1000,
        "samples": res.pop("samples"), "kills_ms": [c["killed_ms"] for c in kills],
        "first_done_ms": [c["first_done_ms"] for c in res["cycles"]],
        "back_ms": [c["back_ms"] for c in kills],
        "records": [[r["done_ms"], r["events"], r.get("audit", {}).get("audit_ms")]
                    for r in records],
        "pressed": [[x["updated_ms"], float(x["rate"])] for x in flow if x.get("backpressure")],
    }  # fmt: skip
    return res, series


def main() -> None:
    parts = ("cost", "memory", "recovery")
    p = parser(__doc__)
    add = p.add_argument
    add("--formats", default="jsonl,fields", help="comma-separated: jsonl,fields")
    add("--parts", default=",".join(parts), help="comma-separated: " + ",".join(parts))
    add("--pairs", type=int, help="on/off pairs per format: 3, quick 1")
    add("--kills", type=int, help="SIGKILLs: 4, quick 2")
    add("--kill-rate", type=float, help="producer events/s while killing: 50000, quick 10000")
    add("--controller", default="none", choices=["none", "stepwise", "aimd", "pid", "fixed"],
        help="backpressure.controller of every run")  # fmt: skip
    add("--seed", type=int, default=7)
    add("--keep-state", action="store_true", help="keep the temporary state dirs")
    a = p.parse_args()
    a.formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    a.parts = [x.strip() for x in a.parts.split(",") if x.strip()]
    if not a.formats or not {*a.formats} <= {"jsonl", "fields"} or not {*a.parts} <= {*parts}:
        p.error("--formats: jsonl and/or fields; --parts: some of " + ",".join(parts))
    a.pairs, a.kills = a.pairs or (1 if a.quick else 3), a.kills or (2 if a.quick else 4)
    a.kill_rate = a.kill_rate or (10_000.0 if a.quick else 50_000.0)
    run, ws = Run("audit", a), Workspace(a.keep_state)
    results: dict[str, Any] = {}
    series: dict[str, Any] = {}
    try:
        if "cost" in a.parts:
            spark = build_spark(load.bench_config("jsonl", ws.state_dir("spark"), 1),
                                "sluice-bench")  # fmt: skip
            try:
                results["cost"] = [cost(spark, a, ws, fmt) for fmt in a.formats]
            finally:
                spark.stop()  # before the recovery run starts its own JVM
        if "memory" in a.parts:
            results["memory"] = memory(a, ws)
        if "recovery" in a.parts:
            results["recovery"], series["recovery"] = recovery(a, ws)
    finally:
        ws.cleanup()
    params = {"pairs": a.pairs, "controller": a.controller, "ledger_shards": LEDGER_SHARDS,
              "ledger_keep": LEDGER_KEEP, "source_chunk": SOURCE_CHUNK,
              "prekill_window_s": PREKILL_WINDOW_S, "sample_ms": 1000 * SAMPLE_S}  # fmt: skip
    run.write(params, results, series)


if __name__ == "__main__":
    main()
