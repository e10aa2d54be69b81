"""The query service: the real `sluice serve` process under 100 concurrent clients.

    .venv/bin/python bench/query.py            # full run, about 5-8 minutes
    .venv/bin/python bench/query.py --quick    # smoke run, about 2-3 minutes

Dense slices loaded straight into Redis (`lib.slice_data`); wrk (`lib.wrk`) against
`sluice serve`; the in-process cost of a lookup; window length; a py-spy profile. Side by side
first, in alternating order per round: the HTTP servers of `--http`, or with `--before REV` that
commit's src/ (exported with `git archive`) against the working tree's. Needs wrk
(apt-get install wrk). bench/templates/query.md says what each number means. Writes
bench/results/query[.quick].json (with `--transports`, query-transports[.quick].json).
"""

from __future__ import annotations

import argparse
import itertools
import math
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

from lib import pyspy
from lib import slice_data as sd
from lib.procs import CpuSnapshot, ServeProcess, http_json, proc_cpu_s
from lib.results import Run, log, parser
from lib.revisions import export
from lib.slice_format import SLICE_MS, check_writer_format
from lib.stats import median, percentile, time_calls_us
from lib.wrk import WrkJob, WrkResult, require_wrk, run_wrk
from sluice.config import Config, config_from_dict
from sluice.query.engine import QueryEngine
from sluice.redis.connection import client_for
from sluice.redis.embedded import EmbeddedRedis
from sluice.slices.window import cover
from sluice.units import format_duration_ms, parse_duration_ms

AHEAD_MIN = 20  # slices loaded past "now", so windows ending during the run stay covered
GET_REQUESTS, BATCH_REQUESTS, WINDOW_REQUESTS = 100_000, 4_000, 20_000  # distinct, cycled
DRAIN_QUIET_S, DRAIN_MAX_S = 0.5, 120.0
# What lookups make Redis run: HMGET (slices), EVALSHA (read_slices.lua), PFCOUNT (distinct)
READ_COMMANDS = ("hmget", "evalsha", "pfcount")
THREAD_ROOT = "Thread._bootstrap (threading.py"  # the root frame of anyio's worker threads
INCLUSIVE = (  # (id, stack marker, negate): shares of the server's samples; labels in the docs
    ("event_loop", THREAD_ROOT, True), ("threadpool", THREAD_ROOT, False),
    ("fast", "(sluice/server/fast.py", False), ("engine", "(sluice/query/engine.py", False),
    ("mux", "(sluice/redis/mux.py", False), ("redis_py", "(redis/", False),
)  # fmt: skip


class Variant(NamedTuple):
    """One server compared side by side: a label, its `--http` server, its PYTHONPATH."""

    label: str
    http: str
    src: Path | None = None  # another revision's src/; None: the working tree's
    config: Path | None = None  # a config of its own; None: the run's (the embedded default)


class Scenario(NamedTuple):
    name: str
    mode: str  # "get" | "batch"
    connections: int
    lookups_per_request: int = 1
    think_ms: float = 0.0  # mean think time of each client; 0 = closed loop, no pause


@dataclass
class Bench:
    """What the run reaches: its arguments, Redis and its client, the data, the server."""

    args: argparse.Namespace
    tmp: Path
    redis: EmbeddedRedis
    client: Any
    spec: sd.DataSpec
    rng: np.random.Generator
    serve: ServeProcess | None = None
    files: dict[str, Path] = field(default_factory=dict)

    def write_config(self, resolutions_ms: Sequence[int]) -> tuple[Config, Path]:
        # The embedded default (no `redis:`): serve joins the server under tmp/redis, as a
        # second Sluice process on the same state_dir does.
        data = sd.served_config(None, self.tmp, resolutions_ms)
        path = self.tmp / f"sluice-{len(resolutions_ms)}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return config_from_dict(data), path

    def read_stats(self) -> tuple[int, float]:
        """(calls, µs) of READ_COMMANDS since the last CONFIG RESETSTAT."""
        info = self.client.info("commandstats")
        stats = [info.get(f"cmdstat_{c}", {}) for c in READ_COMMANDS]
        return sum(s.get("calls", 0) for s in stats), sum(s.get("usec", 0) for s in stats)

    def wait_drained(self) -> float:
        """Wait until the server has finished the requests a wrk run left in flight (a client
        that closes its connection does not cancel work already queued): until Redis sees no
        lookup for DRAIN_QUIET_S. Returns the seconds waited (DRAIN_MAX_S if never quiet)."""
        t0, last = time.monotonic(), self.read_stats()[0]
        while time.monotonic() - t0 < DRAIN_MAX_S:
            time.sleep(DRAIN_QUIET_S)
            if (now := self.read_stats()[0]) == last:
                return time.monotonic() - t0 - DRAIN_QUIET_S
            last = now
        log(f"warning: the server was still busy {DRAIN_MAX_S:g} s after the run")
        return DRAIN_MAX_S

    def job(self, sc: Scenario, seconds: float, requests: Path | None = None) -> WrkJob:
        assert self.serve is not None
        return WrkJob(self.serve.base_url, requests or self.files[sc.mode], sc.mode, sc.connections,
                      self.args.wrk_threads, seconds, sc.think_ms)  # fmt: skip

    def measure(self, job: WrkJob) -> WrkResult:
        """One wrk run with the cores each party used and Redis' time in the lookups' commands,
        then the time the server needed to finish the requests left in flight."""
        assert self.serve is not None and self.redis.proc is not None
        parties = {"server": self.serve.pids(), "redis": [self.redis.proc.pid]}
        self.client.config_resetstat()
        before = CpuSnapshot.take(parties)
        res = run_wrk(job)
        res.extra["cpu"] = CpuSnapshot.take(parties).cores_since(before)
        res.extra["redis_usec"] = self.read_stats()[1]
        res.extra["drain_s"] = self.wait_drained()
        self.serve.check_alive()
        return res

    def scenario(self, sc: Scenario) -> dict[str, Any]:
        """A warm-up run, then `runs` measured ones: medians (max for the worst latency)."""
        a = self.args
        log(f"{sc.name}: warm-up {a.warmup_s:g} s, then {a.runs} runs of {a.duration_s:g} s")
        run_wrk(self.job(sc, a.warmup_s))
        self.wait_drained()
        runs = [self.measure(self.job(sc, a.duration_s)) for _ in range(a.runs)]
        out = summarize(sc, runs)
        log(f"{sc.name}: {out}")
        return out


def summarize(sc: Scenario, runs: Sequence[WrkResult]) -> dict[str, Any]:
    """Measured runs of `sc` (`Bench.measure`): medians, max for the worst latency, the rates
    of each run, and the latency curve of the median run."""
    rates = [r.rate_per_s for r in runs]
    per = sc.lookups_per_request

    def med(fn: Callable[[WrkResult], float]) -> float | None:
        return median([fn(r) for r in runs])

    return {
        "name": sc.name, "rate": median(rates), "rate_min": min(rates), "rate_max": max(rates),
        "rate_each": rates,
        "lookups_per_s": (median(rates) or 0) * per, "p50_ms": med(lambda r: r.pct_ms[50.0]),
        "p99_ms": med(lambda r: r.pct_ms[99.0]), "max_ms": max(r.max_ms for r in runs),
        "errors": sum(sum(r.errors.values()) for r in runs),
        "redis_us_per_lookup": med(lambda r: r.extra["redis_usec"] / max(1, r.requests * per)),
        "drain_s": max(r.extra["drain_s"] for r in runs),
        "cpu": {k: med(lambda r, k=k: r.extra["cpu"][k]) for k in runs[0].extra["cpu"]},
        "pct_ms": sorted(runs, key=lambda r: r.rate_per_s)[len(runs) // 2].pct_ms,
    }  # fmt: skip


def verify_http(b: Bench) -> None:
    """Answers over HTTP equal values merged in Python from the raw hashes; a batch answers
    every lookup. Raises RuntimeError otherwise."""
    assert b.serve is not None
    end_ms = b.spec.now_ms
    hot = [sd.LookupSpec(m, b.spec.key_name(m, 0), w) for m in b.spec.keys for w in sd.WINDOWS]
    for lk in hot + sd.draw_lookups(b.spec, 24, b.rng):
        status, body = http_json(b.serve.base_url + lk.path(end_ms))
        want = sd.expected_value(b.client, lk.metric, lk.key, lk.window, end_ms)
        if status != 200 or not math.isclose(body["value"], want, rel_tol=1e-12):
            raise RuntimeError(f"{lk.path(end_ms)} -> {status} {body}, expected {want}")
    body_ = sd.batch_body(sd.draw_lookups(b.spec, b.args.batch_size, b.rng))
    status, body = http_json(b.serve.base_url + "/v1/query", body_)
    if status != 200 or len(body.get("results", [])) != b.args.batch_size:
        raise RuntimeError(f"POST /v1/query -> {status} {str(body)[:300]}")


def serve_transport(b: Bench) -> str:
    """How the server's workers reach Redis: over its Unix socket (CLIENT LIST flag U) or TCP."""
    unix = [c for c in b.client.client_list() if "U" in c.get("flags", "")]
    return "Unix socket" if unix else "TCP"


def slices_read(a: argparse.Namespace, spec: sd.DataSpec, window: str) -> int | None:
    """Slices one lookup of `window` merges (ending at the load time) with the served config."""
    ms = sd.WINDOW_MS.get(window)
    return None if ms is None else cover(spec.now_ms, ms, list(a.resolutions_ms)).n_slices


def in_process(b: Bench, cfg: Config, n: int) -> dict[str, Any]:
    """The cost of one lookup without HTTP, per window and for the request mix (median, p99,
    validation only, Redis' own time), a PING round trip, a batch through `QueryEngine.run`,
    and the Redis commands one `engine.query` sends."""
    engine = QueryEngine(cfg, b.client)
    rows = []
    for label in (*sd.WINDOWS, "mix"):
        args = [(lk.metric, [lk.key], lk.window if label == "mix" else label)
                for lk in sd.draw_lookups(b.spec, n, b.rng)]  # fmt: skip
        time_calls_us(engine.query, args[:50])  # warm the script cache and the connection
        b.client.config_resetstat()
        query_us = time_calls_us(engine.query, args)
        rows.append({"label": label, "slices": slices_read(b.args, b.spec, label),
                     "query_us": median(query_us), "p99_us": percentile(query_us, 0.99),
                     "redis_us": b.read_stats()[1] / len(args),
                     "lookup_us": median(time_calls_us(engine.lookup, args))})  # fmt: skip
    batches = [[engine.lookup(x.metric, [x.key], x.window)
                for x in sd.draw_lookups(b.spec, b.args.batch_size, b.rng)]
               for _ in range(max(20, n // b.args.batch_size))]  # fmt: skip
    batch_us = median(time_calls_us(engine.run, [(x,) for x in batches]))
    b.client.config_resetstat()
    for lk in sd.draw_lookups(b.spec, 100, b.rng):
        engine.query(lk.metric, [lk.key], lk.window)
    stats = b.client.info("commandstats")
    return {"ping_us": median(time_calls_us(b.client.ping, [()] * n)), "rows": rows,
            "batch_us": batch_us, "commands_per_query": {
                c: stats.get(f"cmdstat_{c.lower()}", {}).get("calls", 0) / 100
                for c in ("SCRIPT", "EVALSHA", "HMGET")}}  # fmt: skip


def window_length(b: Bench, coarse: tuple[int, ...], seconds: float) -> list[dict[str, Any]]:
    """Serve the data with `[1m]` and with `coarse` resolutions (it holds both) and run GETs of
    one window (5 min, 24 h) at 1 and at `connections` connections, after a 1 s warm-up."""
    files = {}
    for w in ("5m", "24h"):
        lookups = sd.draw_lookups(b.spec, WINDOW_REQUESTS, b.rng)
        paths = (sd.LookupSpec(x.metric, x.key, w).path() for x in lookups)
        files[w] = sd.write_request_file(b.tmp / f"get-{w}.txt", paths)
    main_serve, rows = b.serve, []
    try:
        for res in ((SLICE_MS,), coarse):
            b.serve = ServeProcess(b.write_config(res)[1], b.args.workers, b.tmp / "serve-w.log")
            b.serve.start()
            try:
                for w, requests in files.items():
                    one, many = Scenario(w, "get", 1), Scenario(w, "get", b.args.connections)
                    run_wrk(b.job(many, 1.0, requests))
                    r1, rn = (b.measure(b.job(sc, seconds, requests)) for sc in (one, many))
                    merged = cover(b.spec.now_ms, parse_duration_ms(w), list(res)).n_slices
                    rows.append({
                        "resolutions": ", ".join(map(format_duration_ms, res)), "window": w,
                        "slices": merged, "one_p50_ms": r1.pct_ms[50.0],
                        "one_p99_ms": r1.pct_ms[99.0], "many_rate": rn.rate_per_s,
                        "many_p50_ms": rn.pct_ms[50.0], "many_p99_ms": rn.pct_ms[99.0],
                        "redis_us": rn.extra["redis_usec"] / max(1, rn.requests),
                    })  # fmt: skip
                    log(f"window: {rows[-1]}")
            finally:
                b.serve.stop()
    finally:
        b.serve = main_serve
    by = {(r["resolutions"] != "1m", r["window"]): r for r in rows}
    for r in rows:  # 24 h against 5 min, with the same resolutions
        base = by[(r["resolutions"] != "1m", "5m")]
        r["vs_5m"] = {k: r[k] / base[k] for k in ("one_p50_ms", "many_rate")}
    return rows


def profile(b: Bench, sc: Scenario) -> dict[str, Any] | None:
    """py-spy on the server during one extra run of `sc`; None if py-spy is missing or fails."""
    spy_bin = pyspy.find(b.args.py_spy)
    if spy_bin is None or b.serve is None:
        return None
    pid = max(b.serve.pids(), key=proc_cpu_s)  # with several workers: the busiest one
    log(f"profiling the server with py-spy during a {b.args.duration_s:g} s run of {sc.name}")
    runs: list[WrkResult] = []
    seconds = b.args.duration_s
    work = lambda: runs.append(run_wrk(b.job(sc, seconds - 1)))  # noqa: E731
    raw = pyspy.profile_during(spy_bin, pid, seconds, b.args.profile_out, work)
    b.wait_drained()
    if raw is None:
        return None
    return pyspy.summarize(raw, INCLUSIVE) | {"rate_per_s": runs[0].rate_per_s, "scenario": sc.name}


def side_by_side(
    b: Bench, config_path: Path, scs: Sequence[Scenario], variants: Sequence[Variant]
) -> list[dict[str, Any]]:
    """Each variant side by side: per round, each one started in turn (alternating the order
    from round to round) on the same config and data, its answers checked, a warm-up, one run
    of each scenario, stopped. Medians over rounds."""
    a = b.args
    main_serve, runs = b.serve, {v.label: {sc.name: [] for sc in scs} for v in variants}
    transports: dict[str, str] = {}
    try:
        for rnd in range(a.runs):
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                env = {"PYTHONPATH": str(v.src)} if v.src is not None else None
                log_path = b.tmp / f"serve-{v.label}.log"
                conf = v.config or config_path
                b.serve = ServeProcess(conf, a.workers, log_path, v.http, env).start()
                try:
                    verify_http(b)
                    transports[v.label] = serve_transport(b)
                    for sc in scs:
                        run_wrk(b.job(sc, a.warmup_s))
                        b.wait_drained()
                        r = b.measure(b.job(sc, a.duration_s))
                        runs[v.label][sc.name].append(r)
                        log(f"round {rnd} {v.label} {sc.name}: {r.rate_per_s:,.0f}/s,"
                            f" p99 {r.pct_ms[99.0]:.1f} ms")  # fmt: skip
                finally:
                    b.serve.stop()
    finally:
        b.serve = main_serve
    rows = []
    for sc in scs:
        for v in variants:
            row = summarize(sc, runs[v.label][sc.name])
            del row["pct_ms"]
            rows.append(row | {"server": v.label, "scenario": sc.name,
                               "transport": transports.get(v.label, "?")})  # fmt: skip
    return rows


def run(a: argparse.Namespace, record: Run) -> None:
    require_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="sluice-query-bench-"))
    before = export(a.before, tmp / "before") if a.before else None  # a bad commit fails here
    server = EmbeddedRedis(tmp / "redis").start()
    b: Bench | None = None
    try:
        client = client_for(server.url, timeout_s=120)
        client.config_set("appendonly", "no")  # the benchmark only reads; no AOF rewrite forks
        coarse = a.resolutions_ms if len(a.resolutions_ms) > 1 else (SLICE_MS, 3_600_000)
        keys, both = {"txn_count": a.cards, "amount_sum": a.merchants}, {*a.resolutions_ms, *coarse}
        spec = sd.DataSpec(keys, a.hours, AHEAD_MIN, int(time.time() * 1000), tuple(sorted(both)))
        b = Bench(a, tmp, server, client, spec, np.random.default_rng(a.seed))
        cfg, config_path = b.write_config(a.resolutions_ms)
        check_writer_format(client, server.url, spec.now_ms)
        log(f"the slice format matches write_slices.lua; loading {spec.total_fields():,} fields")
        t0 = time.monotonic()
        sd.load_slices(server.url, spec, a.seed)
        setup = {"load_s": time.monotonic() - t0, "total_fields": spec.total_fields(),
                 "redis_version": client.info("server").get("redis_version", "?"),
                 "slices_read": [slices_read(a, spec, w) for w in sd.WINDOWS]}  # fmt: skip
        inproc = in_process(b, cfg, a.inproc_iterations)
        gets = (lk.path() for lk in sd.draw_lookups(spec, GET_REQUESTS, b.rng))
        bodies = (
            sd.batch_body(sd.draw_lookups(spec, a.batch_size, b.rng)) for _ in range(BATCH_REQUESTS)
        )
        b.files = {"get": sd.write_request_file(tmp / "get.txt", gets),
                   "batch": sd.write_request_file(tmp / "batch.txt", bodies)}  # fmt: skip
        if before is not None:
            variants = [Variant("before", a.http[-1], before), Variant("after", a.http[-1])]
        elif a.transports:
            # The same code and config, but for `redis:` naming the server's TCP port: loopback
            # TCP against the embedded default's Unix socket.
            tcp = b.tmp / "sluice-tcp.yaml"
            tcp.write_text(yaml.safe_dump({**yaml.safe_load(config_path.read_text()),
                                           "redis": server.url}, sort_keys=False))  # fmt: skip
            variants = [Variant("TCP", a.http[-1], config=tcp),
                        Variant("Unix socket", a.http[-1])]  # fmt: skip
        else:
            variants = [Variant(h, h) for h in a.http] if len(a.http) > 1 else []
        servers = side_by_side(b, config_path, [
            Scenario("GET, 1 connection", "get", 1),
            Scenario(f"GET, {a.connections} connections", "get", a.connections),
            Scenario(f"POST batch of {a.batch_size}, {a.connections} connections", "batch",
                     a.connections, a.batch_size)], variants) if variants else []  # fmt: skip
        b.serve = ServeProcess(config_path, a.workers, tmp / "serve.log", a.http[-1]).start()
        verify_http(b)
        setup["serve_transport"] = serve_transport(b)
        log("HTTP answers match values merged from the raw hashes; the server reaches Redis"
            f" over {setup['serve_transport']}")  # fmt: skip
        get100 = Scenario(f"GET, {a.connections} connections", "get", a.connections)
        batch = f"POST batch of {a.batch_size}, {a.connections} connections"
        scs = [Scenario("GET, 1 connection", "get", 1), get100,
               Scenario(batch, "batch", a.connections, a.batch_size)]  # fmt: skip
        results = [b.scenario(sc) for sc in scs]
        # The same clients pausing between requests (exponential think time), so that they offer
        # about `paced_load` of the saturated rate: latency at a sustainable load.
        think_ms = a.connections / max(1.0, a.paced_load * results[1]["rate"]) * 1000
        paced = f"GET, {a.connections} clients, {think_ms:,.0f} ms mean think time"
        results.append(b.scenario(Scenario(paced, "get", a.connections, 1, think_ms)))
        windows = window_length(b, coarse, 3.0 if a.quick else 8.0)
        prof = profile(b, get100)
        setup["redis_memory"] = client.info("memory").get("used_memory_human", "?")
    finally:
        if b is not None and b.serve is not None:
            b.serve.stop()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    keep = ("cards", "merchants", "hours", "warmup_s", "duration_s", "runs", "connections",
            "batch_size", "workers", "wrk_threads", "paced_load", "inproc_iterations")  # fmt: skip
    params = {k: getattr(a, k) for k in keep} | {
        "resolutions": ", ".join(map(format_duration_ms, a.resolutions_ms)), "ahead_min": AHEAD_MIN,
        "window_run_s": 3.0 if a.quick else 8.0, "drain_quiet_s": DRAIN_QUIET_S,
        "profile_rate_hz": pyspy.RATE_HZ,
    }  # fmt: skip
    curves = {r["name"]: r.pop("pct_ms") for r in results}
    found = {"setup": setup, "scenarios": results, "windows": windows, "in_process": inproc,
             "profile": prof, "http_servers": servers, "http": a.http[-1],
             "before": a.before, "transports": a.transports}  # fmt: skip
    record.write(params, found, {"latency_pct_ms": curves})


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    add = p.add_argument
    add("--keys", type=int, help="cards (txn_count keys): 10000, quick 1000")
    add("--merchants", type=int, help="amount_sum keys: keys/10")
    add("--hours", type=float, default=24.0, help="hours of 1 m slices per key")
    add("--warmup-s", type=float, help="the warm-up run: 5 s, quick 2 s")
    add("--duration-s", type=float, help="each run: 20 s, quick 5 s")
    add("--runs", type=int, help="timed runs per scenario: 3, quick 2")
    add("--connections", type=int, default=100, help="concurrent clients")
    add("--batch-size", type=int, default=50, help="lookups per POST /v1/query")
    add("--workers", type=int, default=2, help="server worker processes")
    add("--wrk-threads", type=int, default=1, help="wrk threads (CPU it takes)")
    add("--paced-load", type=float, default=0.5, help="the paced clients' offered load, as a"
        " fraction of the saturated GET rate")  # fmt: skip
    add("--resolutions", default="1m,1h", help="slice lengths kept per metric, finest first"
        " (1m alone: a 24 h window merges 1,441 slices)")  # fmt: skip
    add("--seed", type=int, default=11)
    add("--py-spy", default="auto", help="py-spy binary, 'auto' (venv or PATH) or 'off'")
    add("--profile-out", type=Path, help="keep py-spy's raw stacks there")
    add("--before", help="a commit: its src/ against the working tree's, side by side under the"
        " last --http server (instead of the HTTP servers side by side)")  # fmt: skip
    add(
        "--transports",
        action="store_true",
        help="loopback TCP against the Unix socket side by"
        " side, the same code under the last --http server (instead of the HTTP servers)",
    )
    add("--http", default="granian,uvicorn", help="`sluice serve --http`: one server, or several"
        " to run side by side first (the last one serves the other sections)")  # fmt: skip
    a = p.parse_args()
    a.http = [h.strip() for h in a.http.split(",") if h.strip()]
    if not a.http or set(a.http) - {"uvicorn", "granian"}:
        p.error("--http takes uvicorn and/or granian")
    try:
        a.resolutions_ms = tuple(parse_duration_ms(x.strip()) for x in a.resolutions.split(","))
    except ValueError as e:
        p.error(f"--resolutions: {e}")
    res = a.resolutions_ms
    if res[0] != SLICE_MS or any(y <= x or y % x for x, y in itertools.pairwise(res)):
        p.error("--resolutions must start at 1m, each a multiple of the one before")
    if not 0 < a.paced_load <= 1 or min(a.connections, a.batch_size, a.workers, a.wrk_threads) < 1:
        p.error("--paced-load must be in (0, 1]; --connections, --batch-size, --workers and"
                " --wrk-threads at least 1")  # fmt: skip
    q = a.quick
    a.cards = a.keys or (1_000 if q else 10_000)
    a.merchants = a.merchants or max(10, a.cards // 10)
    a.warmup_s = a.warmup_s or (2.0 if q else 5.0)
    a.duration_s = a.duration_s or (5.0 if q else 20.0)
    a.runs, a.inproc_iterations = a.runs or (2 if q else 3), 300 if q else 2_000
    return a


def _on_sigterm(signum: int, _: Any) -> None:
    raise SystemExit(128 + signum)  # so the server and Redis are stopped on the way out


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _on_sigterm)
    args = parse_args()
    run(args, Run("query-transports" if args.transports else "query", args))
