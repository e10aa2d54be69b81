"""The store's write rate on its own: folded batches written to one Redis (issue 15's store
target), with nothing else running on the machine.

    .venv/bin/python bench/store.py            # 3 rounds of 5 batches of 50,000 events, ~3 min
    .venv/bin/python bench/store.py --quick    # 1 round of 3 batches of 10,000 events
    .venv/bin/python bench/store.py --before 9b2bbbd   # that revision's writer beside this one's
    .venv/bin/python bench/store.py --server-before /usr/bin/redis-server \
        --out bench/results/store-servers.json   # another redis-server beside the default
    .venv/bin/python bench/store.py --callgrind --before 9b2bbbd \
        --out bench/results/store-instructions.json        # Redis's instructions per update

In the pipeline the store shares the cores with Spark's fold (bench/ingest.py): its rate there
is the pipeline's. This benchmark asks what the write path itself can do on these cores. Per
workload (`highcard`: keys uniform over 100,000 cards and 200 merchants, times over the last 10
minutes, the six metrics of `lib.load.HIGHCARD_METRICS`; `zipf`: the throughput benchmark's events
and 3 metrics), a local Spark session decodes and folds `--batches` batches of `--events` events
each with the fold's own plan (`plan.explode_updates` + `plan.fold_updates`, collected as Arrow,
as write-behind collects them) and is stopped. Then, per round, a fresh embedded Redis (the
default one: AOF on, `appendfsync everysec`) takes the batches in order through the fold's
writer (`pipeline.writer.write_partition`: the slice hashes' keys, the states' text, the
`write_slices.lua` calls, their replies checked), each with its own writer token, from one
thread in this process, as the driver writes under write-behind; then the first batch once more
with its own token (a replay: every update a duplicate). Per batch: updates applied / wall time,
Redis's CPU time (from /proc) and its time in scripts and in the commands they call (`INFO
commandstats`), and this process's CPU time (building the calls, reading the replies). At the
end the `txn_count` metric summed over the store must equal the events folded.

With `--before REV`, each round writes the same folded batches twice, into a fresh Redis each
time: once with REV's writer and script (its src/ exported with `git archive`) and once with the
working tree's, each in a worker process of its own, in alternating order (REV first in odd
rounds); the medians of both are reported side by side, with their ratio. With
`--server-before PATH` the two workers run the working tree's writer, the before one against the
redis-server binary PATH and the after one against the default (`$SLUICE_REDIS_SERVER` unset).
Writes bench/results/store[.quick].json.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from lib import callgrind
from lib.bare import write_arrow_batch
from lib.load import HIGHCARD_METRICS, bench_config
from lib.procs import Workspace, command_usec, count_metric_total, proc_cpu_s
from lib.results import ROOT, Run, log, parser
from lib.revisions import REVISIONS, export, order
from sluice.config import Config
from sluice.pipeline import plan
from sluice.pipeline.writer import WriterContext, write_partition
from sluice.redis.embedded import EmbeddedRedis

WORKLOADS = ("highcard", "zipf")
EPOCH = 10**12  # writer token = epoch * 10**12 + batch id, as `query.writer_token` makes them


def config_of(ws: Workspace, workload: str, events: int) -> Config:
    extra: dict[str, Any] = {"metrics": HIGHCARD_METRICS} if workload == "highcard" else {}
    return bench_config("jsonl", ws.state_dir(f"cfg-{workload}"), events, **extra)


def fold_batches(ws: Workspace, a: Any) -> dict[str, tuple[Config, list[Any], list[pa.Table]]]:
    """Per workload: its config, metric specs and `a.batches` folded batches (Arrow tables)."""
    from sluice.pipeline.spark import build_spark

    out: dict[str, tuple[Config, list[Any], list[pa.Table]]] = {}
    spark = build_spark(config_of(ws, "zipf", a.events), "sluice-bench-store")
    try:
        for workload in a.workloads:
            cfg = config_of(ws, workload, a.events)
            specs = plan.metric_specs(cfg, plan.check_expressions(spark, cfg))
            folds = plan.fold_columns(specs, cfg.audit.enabled)
            tables = []
            for i in range(a.batches):
                path = ws.state_dir(f"{workload}-{i}") / "batch.arrow"
                write_arrow_batch(cfg, a.events, a.seed + i, path, workload)
                with pa.OSFile(str(path), "rb") as f:
                    events = spark.createDataFrame(pa.ipc.open_file(f).read_all())
                tables.append(plan.fold_updates(plan.explode_updates(events, cfg, specs),
                                                folds).toArrow())  # fmt: skip
                log(f"{workload} batch {i}: {a.events:,} events -> {tables[-1].num_rows:,} rows")
            out[workload] = (cfg, specs, tables)
    finally:
        spark.stop()
    return out


def write_batch(srv: EmbeddedRedis, cfg: Config, specs: list[Any], table: pa.Table,
                batch_id: int, counter: callgrind.Counter | None = None
                ) -> dict[str, Any]:  # fmt: skip
    """Write one folded batch through the fold's writer; its counters and costs (with
    `counter`, Redis's instructions too)."""
    import redis

    ctx = WriterContext(url=srv.url, token=EPOCH + batch_id, specs=tuple(specs),
                        source_stream=cfg.source.stream,
                        dead_letter_maxlen=cfg.source.dead_letter_maxlen)  # fmt: skip
    with redis.Redis.from_url(srv.url) as c:
        c.config_resetstat()
        assert srv.pid is not None
        if counter:
            counter.zero()
        redis0, own0, t0 = proc_cpu_s(srv.pid), time.process_time(), time.perf_counter()
        rows = [r for b in write_partition(ctx, iter(table.to_batches())) for r in b.to_pylist()]
        wall = time.perf_counter() - t0
        redis_s, own_s = proc_cpu_s(srv.pid) - redis0, time.process_time() - own0
        instructions, dump = counter.dump() if counter else (None, None)
        usec = command_usec(c)
    where = callgrind.parts(dump, instructions) if dump and instructions else None
    stats = next(r for r in rows if r["kind"] == "stats")
    updates = stats["updates_applied"] + stats["updates_duplicate"] + stats["updates_expired"]
    script_s = usec.get("evalsha", 0) / 1e6
    called = {k: v for k, v in usec.items() if k not in ("evalsha", "config", "script", "info")}
    return {
        "batch": batch_id, "rows": table.num_rows, "updates": updates,
        "applied": stats["updates_applied"], "duplicate": stats["updates_duplicate"],
        "expired": stats["updates_expired"], "wall_s": wall,
        "per_s": updates / wall if wall else None, "redis_cpu_s": redis_s, "own_cpu_s": own_s,
        "script_s": script_s, "script_per_s": updates / script_s if script_s else None,
        "called_s": sum(called.values()) / 1e6, "called": called, "instructions": instructions,
        "instructions_where": where,
    }  # fmt: skip


def round_of(ws: Workspace, workload: str, folded: tuple[Config, list[Any], list[pa.Table]],
             rnd: int, conf: list[str], count: bool = False) -> dict[str, Any]:  # fmt: skip
    """One round: a fresh embedded Redis, every batch in order, then the first one replayed.
    With `count`, Redis runs under callgrind and each batch's instructions are counted."""
    import redis

    cfg, specs, tables = folded
    data = ws.state_dir(f"redis-{workload}-{rnd}")
    if count:
        from sluice.redis.embedded import find_server_binary

        os.environ["SLUICE_REDIS_SERVER"] = str(callgrind.wrapper(find_server_binary(), data))
    srv = EmbeddedRedis(data, extra_config=conf).start(timeout_s=120 if count else 15)
    counter = callgrind.Counter(srv.pid, data) if count and srv.pid else None
    try:
        batches = [write_batch(srv, cfg, specs, t, i + 1, counter) for i, t in enumerate(tables)]
        replay = write_batch(srv, cfg, specs, tables[0], 1, counter)
        with redis.Redis.from_url(srv.url) as c:
            stored = count_metric_total(c, "txn_count")
            version = c.info("server")["redis_version"]
    finally:
        srv.stop()
    for b in batches:
        log(f"{workload} round {rnd + 1} batch {b['batch']}: {b['updates']:,} updates,"
            f" {b['per_s']:,.0f}/s, Redis {b['redis_cpu_s']:.2f} cpu-s,"
            f" scripts {b['script_s']:.2f} s")  # fmt: skip
    log(f"{workload} round {rnd + 1} replay: {replay['per_s']:,.0f}/s, all duplicate"
        f" {replay['duplicate'] == replay['updates']}")  # fmt: skip
    return {"round": rnd + 1, "batches": batches, "replay": replay, "stored_txn_count": stored,
            "redis_version": version}  # fmt: skip


def save_folded(ws: Workspace, folded: dict[str, tuple[Config, list[Any], list[pa.Table]]]
                ) -> dict[str, Path]:  # fmt: skip
    """Each workload's folded batches (Arrow files) and its config and specs (pickled), for
    the workers: one directory per workload."""
    out = {}
    for workload, (cfg, specs, tables) in folded.items():
        d = ws.state_dir(f"folded-{workload}")
        for i, t in enumerate(tables):
            with pa.OSFile(str(d / f"{i}.arrow"), "wb") as f, pa.ipc.new_file(f, t.schema) as w:
                w.write_table(t)
        (d / "spec.pickle").write_bytes(pickle.dumps((cfg, specs, len(tables))))
        out[workload] = d
    return out


def worker(job_path: Path) -> None:
    """`--worker JOB`: one round of one revision (the `sluice` this process imports), its
    result written as JSON next to the job."""
    import sluice

    job = json.loads(job_path.read_text())
    log(f"worker: sluice from {Path(sluice.__file__).parent}")
    d = Path(job["folded"])
    cfg, specs, n = pickle.loads((d / "spec.pickle").read_bytes())
    tables = []
    for i in range(n):
        with pa.OSFile(str(d / f"{i}.arrow"), "rb") as f:
            tables.append(pa.ipc.open_file(f).read_all())
    ws = Workspace()
    try:
        out = round_of(ws, job["workload"], (cfg, specs, tables), job["round"], job["conf"],
                       job["count"])  # fmt: skip
    finally:
        ws.cleanup()
    Path(job["out"]).write_text(json.dumps(out))


def revision_round(ws: Workspace, src: Path, folded_dir: Path, workload: str, rnd: int,
                   revision: str, conf: list[str], count: bool,
                   server: str | None = None) -> dict[str, Any]:  # fmt: skip
    """One round of one revision in a worker process that imports `sluice` from `src` (and
    starts the redis-server binary `server`, when given: `$SLUICE_REDIS_SERVER`)."""
    job = ws.state_dir(f"job-{workload}-{rnd}-{revision}") / "job.json"
    out = job.with_name("out.json")
    job.write_text(json.dumps({"folded": str(folded_dir), "workload": workload, "round": rnd,
                               "conf": conf, "out": str(out), "count": count}))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(ROOT / "bench")])}
    if server:
        env["SLUICE_REDIS_SERVER"] = server
    log(f"{workload} round {rnd + 1}: {revision}{f' ({server})' if server else ''}")
    subprocess.run([sys.executable, __file__, "--worker", str(job)], env=env, check=True)
    return dict(json.loads(out.read_text()))


def summarize(workload: str, tables: list[pa.Table], events: int,
              rounds: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Medians over the rounds: the first batch (every hash new) apart from the later ones."""

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
        updates = sum(r["updates"] for r in rows)
        per = {k: sum(r[k] for r in rows) for k in ("wall_s", "redis_cpu_s", "own_cpu_s",
                                                     "script_s", "called_s")}  # fmt: skip
        counted = [r["instructions"] for r in rows if r.get("instructions") is not None]
        return {
            "updates": updates,
            **per,
            "per_s": updates / per["wall_s"],
            "redis_cpu_us": per["redis_cpu_s"] * 1e6 / updates,
            "own_cpu_us": per["own_cpu_s"] * 1e6 / updates,
            "script_per_s": updates / per["script_s"] if per["script_s"] else None,
            "called_share": per["called_s"] / per["script_s"] if per["script_s"] else None,
            "instr_per_update": sum(counted) / updates if len(counted) == len(rows) else None,
            "instr_where": {
                k: sum(r["instructions_where"][k] for r in rows) / updates
                for k in rows[0]["instructions_where"]
            }
            if all(r.get("instructions_where") for r in rows)
            else None,
        }

    kinds = {
        "first": [totals(r["batches"][:1]) for r in rounds],
        "later": [totals(r["batches"][1:]) for r in rounds] if len(tables) > 1 else [],
        "all": [totals(r["batches"]) for r in rounds],
        "replay": [totals([r["replay"]]) for r in rounds],
    }
    out: dict[str, Any] = {"workload": workload, "events_per_batch": events,
                           "batches": len(tables),
                           "updates_per_batch": statistics.median(t.num_rows for t in tables),
                           "events_folded": events * len(tables)}  # fmt: skip
    for kind, rows in kinds.items():
        out[kind] = {k: med(rows, k) for k in ("per_s", "redis_cpu_us", "own_cpu_us",
                                               "script_per_s", "called_share",
                                               "instr_per_update")}  # fmt: skip
        out[kind]["instr_where"] = rows[0]["instr_where"] if rows else None  # one round
        out[kind]["each"] = [r["per_s"] for r in rows]
    out["exact"] = all(r["stored_txn_count"] == events * len(tables) for r in rounds)
    out["stored_txn_count"] = [r["stored_txn_count"] for r in rounds]
    out["redis_version"] = rounds[0]["redis_version"]
    out["replay_all_duplicate"] = all(
        r["replay"]["duplicate"] == r["replay"]["updates"] for r in rounds
    )
    out["applied_each_batch"] = all(
        b["applied"] + b["expired"] == b["updates"] for r in rounds for b in r["batches"]
    )
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--events", type=int, help="events per batch (default 50,000; quick 10,000)")
    p.add_argument("--batches", type=int, help="batches per round (default 5; quick 3)")
    p.add_argument("--rounds", type=int, help="rounds, each on a fresh Redis (default 3; quick 1)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--before", help="a revision whose writer to measure beside the working tree's")
    p.add_argument(
        "--callgrind",
        action="store_true",
        help="run Redis under valgrind's callgrind and count its instructions per"
        " update (one round, slow; rates are then valgrind's, not Redis's)",
    )
    p.add_argument(
        "--server-before",
        metavar="PATH",
        help="instead of a revision: the working tree's writer against this redis-server"
        " binary (before) and against the default one (after)",
    )
    p.add_argument(
        "--conf-after",
        action="append",
        default=[],
        metavar="LINE",
        help="instead of a revision: the working tree's writer and the default server, without"
        " (before) and with (after) these redis.conf lines, e.g. 'lua-replicate-commands no'",
    )
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument(
        "--redis-conf",
        action="append",
        default=[],
        metavar="LINE",
        help="a redis.conf line for the embedded Redis, e.g. 'appendonly no'",
    )
    a = p.parse_args()
    if a.worker:
        worker(a.worker)
        return
    a.events = a.events or (10_000 if a.quick else 50_000)
    a.batches = a.batches or (3 if a.quick else 5)
    a.rounds = a.rounds or (1 if a.quick or a.callgrind else 3)
    if a.callgrind:
        callgrind.require()
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    if unknown := [w for w in a.workloads if w not in WORKLOADS]:
        p.error(f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    if a.events < 1 or a.batches < 1 or a.rounds < 1:
        p.error("--events, --batches and --rounds must be at least 1")
    if a.server_before and a.before:
        p.error("--server-before compares two servers with one writer: leave out --before")
    if a.conf_after and (a.before or a.server_before):
        p.error("--conf-after compares two configs with one writer and server: leave out"
                " --before and --server-before")  # fmt: skip
    if a.server_before and not os.access(a.server_before, os.X_OK):
        p.error(f"--server-before: {a.server_before} is not an executable file")
    run = Run("store", a)
    ws = Workspace()
    try:
        folded = fold_batches(ws, a)
        params = {"events": a.events, "batches": a.batches, "rounds": a.rounds,
                  "redis_conf": a.redis_conf, "before": a.before, "callgrind": a.callgrind,
                  "server_before": a.server_before, "conf_after": a.conf_after,
                  "metrics": HIGHCARD_METRICS}  # fmt: skip
        if not a.before and not a.server_before and not a.conf_after:
            results = []
            for workload in a.workloads:
                rounds = [round_of(ws, workload, folded[workload], r, a.redis_conf, a.callgrind)
                          for r in range(a.rounds)]  # fmt: skip
                results.append(summarize(workload, folded[workload][2], a.events, rounds))
            run.write(params, {"workloads": results})
            return
        (ws.root / "before").mkdir()
        same = a.server_before or a.conf_after  # one writer: the working tree's
        before = ROOT / "src" if same else export(a.before, ws.root / "before")
        srcs = {"before": before, "after": ROOT / "src"}
        servers = {"before": a.server_before, "after": None}
        confs = {"before": a.redis_conf, "after": [*a.redis_conf, *a.conf_after]}
        dirs = save_folded(ws, folded)
        by_rev: dict[str, list[Any]] = {rev: [] for rev in REVISIONS}
        for workload in a.workloads:
            rounds: dict[str, list[Any]] = {rev: [] for rev in REVISIONS}
            for r in range(a.rounds):
                for rev in order(r):
                    rounds[rev].append(revision_round(ws, srcs[rev], dirs[workload], workload, r,
                                                      rev, confs[rev], a.callgrind,
                                                      servers[rev]))  # fmt: skip
            for rev in REVISIONS:
                by_rev[rev].append(summarize(workload, folded[workload][2], a.events,
                                             rounds[rev]))  # fmt: skip
        run.write(params, {"workloads": by_rev["after"], "before_workloads": by_rev["before"]})
    finally:
        ws.cleanup()


if __name__ == "__main__":
    main()
