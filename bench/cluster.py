"""Store writes and queries: a local 3-master Redis Cluster against one Redis server.

    .venv/bin/python bench/cluster.py            # about 2-4 minutes
    .venv/bin/python bench/cluster.py --quick    # smoke run

No Spark: the writer's `run_write_script` from `--writers` processes at once (a new writer token
per round, so every update is applied), and `QueryEngine.run` in batches of 100 and one at a
time. bench/templates/cluster.md says what each number means. Writes
bench/results/cluster[.quick].json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from lib.load import now_ms
from lib.results import Run, log, parser
from sluice.config import config_from_dict
from sluice.pipeline.slice_writes import run_write_script
from sluice.query.engine import Lookup, QueryEngine
from sluice.redis.connection import client_for
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import slice_hash_key
from sluice.redis.local_cluster import LocalCluster

SLICE_MS = 10_000
RETENTION_MS = 86_400_000


def _write(args: tuple[str, bool, int, range, int, int, Any]) -> int:
    """One writer process: wait for the start barrier, apply its keys' updates once."""
    url, cluster, token, keys, slices, at_ms, barrier = args
    client = client_for(url, timeout_s=60)
    first = at_ms // SLICE_MS * SLICE_MS - (slices - 1) * SLICE_MS
    flat = [x for s in range(slices) for x in (str(first + s * SLICE_MS), "1")]
    head = ["count", str(SLICE_MS), str(RETENTION_MS), str(slices), "1"]
    calls = [(slice_hash_key("txn_count", f"card-{k}"), [*head, *flat], ("l", 0, k)) for k in keys]
    client.ping()
    barrier.wait()
    applied = run_write_script(client, token, calls, set(), cluster)[0]
    client.close()
    return int(applied)


def write_rates(url: str, cluster: bool, args: argparse.Namespace) -> list[float]:
    """Updates/s of each of `args.rounds` rounds (after a warm-up round: script load,
    connections)."""
    at_ms = now_ms()
    rates = []
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager, ctx.Pool(args.writers) as pool:
        for rnd in range(args.rounds + 1):
            barrier = manager.Barrier(args.writers + 1)
            parts = [range(w, args.keys, args.writers) for w in range(args.writers)]
            jobs = [(url, cluster, rnd + 1, part, args.slices, at_ms, barrier) for part in parts]
            result = pool.map_async(_write, jobs)
            barrier.wait()
            t0 = time.perf_counter()
            applied = sum(result.get(600))
            elapsed = time.perf_counter() - t0
            if applied != args.keys * args.slices:
                raise AssertionError(f"applied {applied}, expected {args.keys * args.slices}")
            if rnd:
                rates.append(applied / elapsed)
    return rates


def query_rate(url: str, batch: int, args: argparse.Namespace) -> float:
    """Lookups/s of `QueryEngine.run` in batches of `batch`, for `args.query_s` seconds."""
    cfg = config_from_dict(
        {"redis": url, "source": {"schema": {"ts": "long", "card": "string"}},
         "metrics": [{"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s",
                      "retention": "1d"}]}
    )  # fmt: skip
    client = client_for(url, timeout_s=60)
    engine = QueryEngine(cfg, client)
    end = now_ms()
    done = 0
    engine.run([Lookup("txn_count", ("card-0",), 900_000, end)])  # loads the script
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.query_s:
        keys = [f"card-{(done + j) * 7919 % args.keys}" for j in range(batch)]
        answers = engine.run([Lookup("txn_count", (k,), 900_000, end) for k in keys])
        if answers[0]["value"] != args.slices * (args.rounds + 1):
            raise AssertionError(f"unexpected answer {answers[0]}")
        done += batch
    rate = done / (time.perf_counter() - t0)
    client.close()
    return rate


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--keys", type=int, default=20_000)
    p.add_argument("--slices", type=int, default=30)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--query-s", type=float, default=10.0)
    args = p.parse_args()
    if args.quick:
        args.keys, args.slices, args.rounds, args.query_s = 2000, 10, 1, 2.0
    run = Run("cluster", args)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-cluster-") as tmp:
        single = EmbeddedRedis(Path(tmp) / "single", extra_config=["appendonly no"]).start()
        try:
            with LocalCluster(Path(tmp) / "cluster", masters=3) as cluster:
                backends = (("single Redis", single.url, False),
                            ("Redis Cluster, 3 masters", cluster.url, True))  # fmt: skip
                for name, url, is_cluster in backends:
                    log(f"{name}: writing")
                    rounds = write_rates(url, is_cluster, args)
                    log(f"{name}: querying")
                    rows.append({"name": name, "write": statistics.median(rounds),
                                 "write_rounds": rounds, "q100": query_rate(url, 100, args),
                                 "q1": query_rate(url, 1, args)})  # fmt: skip
        finally:
            single.stop()
    ratios = {k: rows[1][k] / rows[0][k] for k in ("write", "q100", "q1")}
    params = {k: getattr(args, k) for k in ("keys", "slices", "writers", "rounds", "query_s")}
    run.write(params, {"rows": rows, "cluster_vs_single": ratios})


if __name__ == "__main__":
    main()
