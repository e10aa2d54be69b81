"""Sluice query-service benchmark: the real `sluice serve` process under 100 concurrent clients.

    .venv/bin/python bench/query.py            # full run, about 5-8 minutes
    .venv/bin/python bench/query.py --quick    # smoke run, about 1-2 minutes

1. An embedded redis-server in a temporary directory is loaded directly (no Spark) with slice
   hashes in the writer's exact format (checked against `write_slices.lua`): `txn_count` (count
   by card) and `amount_sum` (sum of amount by merchant), 1 m slices (`--resolutions 1m,1h`
   adds coarser hashes), 7 d retention, every key with a value in every 1 m slice of the last
   24 h (dense: every slice a lookup reads holds data, the most work per lookup).
2. `sluice serve -c <config> --port <free port> --workers N` (default 2, as `serve`'s own
   default) runs as a separate process.
3. wrk (C, one thread by default, a Lua script cycling through pre-generated requests) is the
   load generator: keep-alive connections, closed loop. Keys are Zipf(1.3) like
   `sluice.source.loadgen`, windows uniform over 1m, 15m, 1h, 24h, metrics uniform.
4. Scenarios, each a warm-up run then N timed runs (medians reported): GET single lookups at 1
   and at 100 connections; POST /v1/query batches at 100 connections; GET at 100 clients that
   pause between requests (exponential think time) so they offer about half the saturated GET
   rate, for latency at a sustainable load. Plus the in-process cost
   of `QueryEngine.query` against the same Redis (no HTTP), and Redis' own time per script call
   (INFO commandstats), and the CPU each party used (server, Redis, wrk, the rest).
5. Window length: a 5 min and a 24 h window on their own, each served with 1 m slices only and
   with coarser resolutions too (`--resolutions`, or 1m,1h when that is 1m only), on the same
   data: the cost of one request at 1 connection, and throughput at 100.
6. Optionally a py-spy profile of the server under the 100-connection GET load.

The machine has 2 cores shared by wrk, the server and Redis (and any other work running), so
the CPU table matters as much as the rates. Results go to the `## Query service
(bench/query.py)` section of docs/benchmarks.md (only that section is replaced), a latency plot
to docs/query_latency.png, a summary to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import itertools
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from _query_util import (
    SLICE_MS,
    WINDOW_MS,
    WINDOWS,
    WRK_LUA,
    CpuSnapshot,
    CpuUse,
    DataSpec,
    LookupSpec,
    ServeProcess,
    WrkJob,
    WrkResult,
    batch_body,
    check_writer_format,
    config_dict,
    cpu_use,
    draw_lookups,
    expected_value,
    free_port,
    get_path,
    http_json,
    load_slices,
    log,
    median,
    percentile,
    proc_cpu_s,
    redis_read_stats,
    run_wrk,
    serve_supports_workers,
    time_calls_us,
    write_request_file,
)
from _query_windows import WindowRow, compare_windows, windows_text
from _util import replace_section
from sluice.config import Config, config_from_dict
from sluice.query.engine import QueryEngine
from sluice.redis.connection import client_for
from sluice.redis.embedded import EmbeddedRedis
from sluice.slices.window import cover
from sluice.units import format_duration_ms, parse_duration_ms

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Query service (bench/query.py)"
TARGET_P99_MS = 16.0
TARGET_BATCH_LOOKUPS_PER_S = 70_000  # lookups inside POST /v1/query batches
AHEAD_MIN = 20  # slices loaded past "now", so windows ending during the run stay covered
GET_REQUESTS = 100_000  # distinct pre-generated GET requests wrk cycles through
BATCH_REQUESTS = 4_000  # distinct pre-generated batch bodies
PROFILE_RATE_HZ = 200
DRAIN_QUIET_S = 0.5
DRAIN_MAX_S = 120.0


# -- plan -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    quick: bool
    cards: int
    merchants: int
    hours: float
    warmup_s: float
    duration_s: float
    runs: int
    connections: int
    batch_size: int
    inproc_iterations: int
    workers: int
    wrk_threads: int
    seed: int
    py_spy: str | None
    paced_load: float  # offered load of the think-time scenario, as a fraction of saturation
    profile_out: Path | None
    resolutions_ms: tuple[int, ...]  # (60000,) or finest-first, e.g. (60000, 3600000)


def make_plan(args: argparse.Namespace) -> Plan:
    """Quick: 1,000 cards, 5 s runs x 2; full: 10,000 cards, 20 s runs x 3. Flags override."""
    q = args.quick
    cards = args.keys if args.keys is not None else (1_000 if q else 10_000)
    return Plan(
        quick=q,
        cards=cards,
        merchants=args.merchants if args.merchants is not None else max(10, cards // 10),
        hours=args.hours,
        warmup_s=args.warmup_s if args.warmup_s is not None else (2.0 if q else 5.0),
        duration_s=args.duration_s if args.duration_s is not None else (5.0 if q else 20.0),
        runs=args.runs if args.runs is not None else (2 if q else 3),
        connections=args.connections,
        batch_size=args.batch_size,
        inproc_iterations=300 if q else 2_000,
        workers=args.workers,
        wrk_threads=args.wrk_threads,
        seed=args.seed,
        py_spy=_find_py_spy(args.py_spy),
        paced_load=args.paced_load,
        profile_out=args.profile_out,
        resolutions_ms=args.resolutions_ms,
    )


def slices_read(plan: Plan, spec: DataSpec, window: str) -> int:
    """Slices one lookup of `window` merges (ending at the load time) with the served config."""
    return cover(spec.now_ms, WINDOW_MS[window], list(plan.resolutions_ms)).n_slices


def window_seconds(plan: Plan) -> float:
    """The length of each window-length run."""
    return 3.0 if plan.quick else 8.0


def _find_py_spy(arg: str) -> str | None:
    if arg == "off":
        return None
    if arg != "auto":
        return arg
    beside = Path(sys.executable).parent / "py-spy"  # the dev extra installs it in the venv
    return str(beside) if beside.exists() else shutil.which("py-spy")


@dataclass(frozen=True)
class Scenario:
    name: str
    mode: str  # "get" | "batch"
    connections: int
    lookups_per_request: int
    think_ms: float = 0.0  # mean think time of each client; 0 = closed loop, no pause


def scenarios(plan: Plan) -> list[Scenario]:
    return [
        Scenario("GET, 1 connection", "get", 1, 1),
        Scenario(f"GET, {plan.connections} connections", "get", plan.connections, 1),
        Scenario(
            f"POST batch of {plan.batch_size}, {plan.connections} connections",
            "batch",
            plan.connections,
            plan.batch_size,
        ),
    ]


def paced_scenario(plan: Plan, saturated_rate_per_s: float) -> Scenario:
    """GET at `plan.connections` clients that pause between requests (exponential think time)
    so they offer about `plan.paced_load` of the saturated rate: latency at a sustainable load."""
    rate = max(1.0, plan.paced_load * saturated_rate_per_s)
    think_ms = plan.connections / rate * 1000
    return Scenario(
        f"GET, {plan.connections} clients, {think_ms:,.0f} ms mean think time",
        "get",
        plan.connections,
        1,
        think_ms,
    )


# -- environment ----------------------------------------------------------------------------------


@dataclass
class Env:
    """What the run needs to reach: Redis, its client, the server, files."""

    tmp: Path
    redis_server: EmbeddedRedis
    client: Any
    spec: DataSpec
    cfg: Config
    config_path: Path
    serve: ServeProcess | None = None
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def redis_pid(self) -> int:
        assert self.redis_server.proc is not None
        return self.redis_server.proc.pid


def start_redis(tmp: Path) -> tuple[EmbeddedRedis, Any]:
    """Embedded Redis with AOF off: the benchmark only reads, and loading should not fork an AOF
    rewrite."""
    server = EmbeddedRedis(tmp / "redis").start()
    client = client_for(server.url, timeout_s=120)
    client.config_set("appendonly", "no")
    return server, client


def load_data(env: Env, seed: int) -> float:
    """Check the format against the writer, then load `env.spec`. Returns seconds taken."""
    check_writer_format(env.client, env.redis_server.url, env.spec.now_ms)
    log("slice format matches write_slices.lua byte for byte")
    t0 = time.monotonic()
    log(f"loading {env.spec.total_fields():,} fields ({env.spec.keys}) ...")
    fields = load_slices(env.redis_server.url, env.spec, seed)
    took_s = time.monotonic() - t0
    mem = env.client.info("memory").get("used_memory_human", "?")
    log(f"loaded {fields:,} fields in {took_s:.1f} s; redis uses {mem}")
    return took_s


def write_config(tmp: Path, url: str, resolutions_ms: Sequence[int]) -> tuple[Config, Path]:
    data = config_dict(url, tmp / "state", resolutions_ms)
    cfg = config_from_dict(data)
    path = tmp / "sluice.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return cfg, path


def write_request_files(env: Env, plan: Plan, rng: np.random.Generator) -> None:
    """GET paths and batch bodies for wrk, plus the Lua script."""
    gets = draw_lookups(env.spec, GET_REQUESTS, rng)
    env.files["get"] = env.tmp / "get.txt"
    write_request_file(env.files["get"], (get_path(lk) for lk in gets))
    env.files["batch"] = env.tmp / "batch.txt"
    bodies = (
        batch_body(draw_lookups(env.spec, plan.batch_size, rng)) for _ in range(BATCH_REQUESTS)
    )
    write_request_file(env.files["batch"], bodies)
    env.files["lua"] = env.tmp / "sluice_query.lua"
    env.files["lua"].write_text(WRK_LUA)


def verify_http(base_url: str, env: Env, rng: np.random.Generator, batch_size: int) -> None:
    """Answers over HTTP equal values merged in Python from the raw hashes; a batch answers
    every lookup. Raises RuntimeError otherwise."""
    end_ms = env.spec.now_ms
    hot = [LookupSpec(m, env.spec.key_name(m, 0), w) for m in env.spec.keys for w in WINDOWS]
    for lk in hot + draw_lookups(env.spec, 24, rng):
        status, body = http_json(base_url + get_path(lk, end_ms))
        want = expected_value(env.client, lk.metric, lk.key, lk.window, end_ms)
        if status != 200 or not math.isclose(body["value"], want, rel_tol=1e-12):
            raise RuntimeError(f"{get_path(lk, end_ms)} -> {status} {body}, expected {want}")
    status, body = http_json(
        base_url + "/v1/query", batch_body(draw_lookups(env.spec, batch_size, rng))
    )
    if status != 200 or len(body.get("results", [])) != batch_size:
        raise RuntimeError(f"POST /v1/query -> {status} {str(body)[:300]}")


# -- in-process cost ------------------------------------------------------------------------------


@dataclass
class InProcRow:
    label: str
    slices: str
    query_us: float
    query_p99_us: float
    lookup_us: float
    redis_us: float  # Redis' own time per lookup (INFO commandstats)


def _inproc_row(
    label: str, slices: str, engine: QueryEngine, client: Any, lks: Sequence[LookupSpec]
) -> InProcRow:
    args = [(lk.metric, [lk.key], lk.window) for lk in lks]
    time_calls_us(engine.query, args[:50])  # warm the script cache and the connection
    client.config_resetstat()
    query_us = time_calls_us(engine.query, args)
    redis_us = redis_read_stats(client)[1] / len(args)
    lookup_us = time_calls_us(engine.lookup, args)
    return InProcRow(
        label,
        slices,
        median(query_us),
        percentile(query_us, 0.99),
        median(lookup_us),
        redis_us,
    )


def measure_in_process(env: Env, plan: Plan, rng: np.random.Generator) -> dict[str, Any]:
    """Median cost of one lookup without HTTP, per window and for the request mix, a PING round
    trip, and a batch of `plan.batch_size` through `QueryEngine.run`."""
    engine = QueryEngine(env.cfg, env.client)
    n = plan.inproc_iterations
    ping_us = median(time_calls_us(env.client.ping, [()] * n))
    rows = []
    for w in WINDOWS:
        lks = [LookupSpec(lk.metric, lk.key, w) for lk in draw_lookups(env.spec, n, rng)]
        rows.append(_inproc_row(w, f"{slices_read(plan, env.spec, w):,}", engine, env.client, lks))
    rows.append(_inproc_row("mix", "-", engine, env.client, draw_lookups(env.spec, n, rng)))
    batches = [
        [engine.lookup(lk.metric, [lk.key], lk.window) for lk in draw_lookups(env.spec, k, rng)]
        for k in [plan.batch_size] * max(20, n // plan.batch_size)
    ]
    batch_us = time_calls_us(engine.run, [(b,) for b in batches])
    return {
        "ping_us": ping_us,
        "rows": rows,
        "batch_us": median(batch_us),
        "commands_per_query": commands_per_query(engine, env, rng),
    }


def commands_per_query(engine: QueryEngine, env: Env, rng: np.random.Generator) -> dict[str, float]:
    """Top-level Redis commands (SCRIPT ..., EVALSHA, HMGET) one `engine.query` sends, on
    average."""
    lks = draw_lookups(env.spec, 100, rng)
    env.client.config_resetstat()
    for lk in lks:
        engine.query(lk.metric, [lk.key], lk.window)
    stats = env.client.info("commandstats")
    return {
        name: stats.get(f"cmdstat_{name.lower().replace(' ', '_')}", {}).get("calls", 0) / len(lks)
        for name in ("SCRIPT", "EVALSHA", "HMGET")
    }


# -- HTTP scenarios -------------------------------------------------------------------------------


def _read_calls(client: Any) -> int:
    return redis_read_stats(client)[0]


def wait_drained(env: Env, max_s: float = DRAIN_MAX_S) -> float:
    """Wait until the server has finished the requests a wrk run left in flight (a client that
    closes its connection does not cancel work already queued): until Redis sees no lookup for
    DRAIN_QUIET_S. Returns the seconds waited (max_s if it never went quiet)."""
    t0 = time.monotonic()
    last = _read_calls(env.client)
    while time.monotonic() - t0 < max_s:
        time.sleep(DRAIN_QUIET_S)
        now = _read_calls(env.client)
        if now == last:
            return time.monotonic() - t0 - DRAIN_QUIET_S
        last = now
    log(f"warning: the server was still busy {max_s:g} s after the run")
    return max_s


def measure_run(env: Env, job: WrkJob) -> WrkResult:
    """One wrk run with the CPU used by each party and Redis' script stats over it, then the
    time the server needed to finish the requests left in flight (`extra["drain_s"]`)."""
    assert env.serve is not None
    env.client.config_resetstat()
    before = CpuSnapshot.take(env.serve.pids(), env.redis_pid)
    res = run_wrk(job)
    after = CpuSnapshot.take(env.serve.pids(), env.redis_pid)
    res.cpu = cpu_use(before, after)
    stats = env.client.info("commandstats")
    res.redis_calls, res.redis_usec = redis_read_stats(env.client)
    res.extra["script_exists"] = int(stats.get("cmdstat_script", {}).get("calls", 0))
    res.extra["drain_s"] = wait_drained(env)
    return res


def wrk_job(env: Env, plan: Plan, sc: Scenario, duration_s: float) -> WrkJob:
    assert env.serve is not None
    return WrkJob(
        base_url=env.serve.base_url,
        script=env.files["lua"],
        requests_file=env.files[sc.mode],
        mode=sc.mode,
        connections=sc.connections,
        threads=min(plan.wrk_threads, sc.connections),
        duration_s=duration_s,
        think_ms=sc.think_ms,
    )


@dataclass
class ScenarioResult:
    scenario: Scenario
    runs: list[WrkResult]

    def rates(self) -> list[float]:
        return [r.rate_per_s for r in self.runs]

    def med(self, fn: Any) -> float:
        return median([fn(r) for r in self.runs])

    def median_run(self) -> WrkResult:
        return sorted(self.runs, key=lambda r: r.rate_per_s)[len(self.runs) // 2]

    def cpu(self, name: str) -> float:
        return self.med(lambda r: getattr(r.cpu, name))


def run_scenario(env: Env, plan: Plan, sc: Scenario) -> ScenarioResult:
    log(f"{sc.name}: warm-up {plan.warmup_s:g} s")
    run_wrk(wrk_job(env, plan, sc, plan.warmup_s))
    wait_drained(env)
    runs = []
    for i in range(plan.runs):
        res = measure_run(env, wrk_job(env, plan, sc, plan.duration_s))
        cpu = res.cpu or CpuUse(0, 0, 0, 0, 0)
        log(
            f"{sc.name}: run {i + 1}/{plan.runs}: {res.rate_per_s:,.0f} req/s,"
            f" p50 {res.pct_ms[50.0]:.1f} ms, p99 {res.pct_ms[99.0]:.1f} ms,"
            f" errors {res.error_count}; cores: server {cpu.server:.2f} redis {cpu.redis:.2f}"
            f" wrk {cpu.loadgen:.2f}; drained {res.extra['drain_s']:.1f} s after"
        )
        runs.append(res)
        check_alive(env)
    return ScenarioResult(sc, runs)


def check_alive(env: Env) -> None:
    """Raise RuntimeError (with the server log's tail) if `sluice serve` has exited."""
    assert env.serve is not None and env.serve.proc is not None
    if env.serve.proc.poll() is not None:
        raise RuntimeError(f"sluice serve exited ({env.serve.proc.returncode}): {env.serve.tail()}")


# -- profile --------------------------------------------------------------------------------------


def profile_server(env: Env, plan: Plan, sc: Scenario) -> dict[str, Any] | None:
    """py-spy (sampling, non-blocking) on the server during one extra run of `sc`. Returns
    self-time shares by package and by function, or None if py-spy is missing or fails."""
    if plan.py_spy is None or env.serve is None:
        return None
    out = env.tmp / "profile.txt"
    pid = max(env.serve.pids(), key=proc_cpu_s)  # with several workers: the busiest one
    cmd = [plan.py_spy, "record", "-p", str(pid), "-d", f"{plan.duration_s:.0f}"]
    cmd += ["-r", str(PROFILE_RATE_HZ), "-f", "raw", "-o", str(out), "--nonblocking", "--gil"]
    log(f"profiling the server with py-spy during a {plan.duration_s:g} s run of {sc.name}")
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # let py-spy attach
        run = run_wrk(wrk_job(env, plan, sc, plan.duration_s - 1.0))
        spy.wait(timeout=plan.duration_s + 30)
        wait_drained(env)
    finally:
        if spy.poll() is None:
            spy.kill()
            spy.wait(timeout=5)
    if spy.returncode != 0 or not out.exists():
        err = spy.stderr.read().decode(errors="replace") if spy.stderr else ""
        log(f"py-spy failed ({spy.returncode}): {err[-300:]}")
        return None
    if plan.profile_out is not None:
        shutil.copyfile(out, plan.profile_out)
        log(f"raw py-spy stacks (collapsed, flamegraph input) in {plan.profile_out}")
    summary = summarize_profile(out.read_text())
    return {**summary, "rate_per_s": run.rate_per_s, "scenario": sc.name}


PACKAGES = (
    "sluice", "redis", "starlette", "fastapi", "anyio", "uvicorn", "httptools", "uvloop",
    "pydantic", "orjson", "asyncio", "concurrent", "threading", "socket", "selectors",
)  # fmt: skip


def _package_of(frame: str) -> str:
    """`func (path/to/file.py:12)` -> the package-ish name of the file."""
    path = "/" + frame[frame.rfind("(") + 1 :]
    for pkg in PACKAGES:
        if f"/{pkg}/" in path or f"/{pkg}.py" in path:
            return pkg
    return "other"


THREADPOOL_MARK = "Thread._bootstrap (threading.py"  # the anyio worker threads' root frame
INCLUSIVE = (
    ("event-loop thread (HTTP parsing, middleware, routing, responses)", None),
    ("threadpool threads (sync endpoints; lookups never run there)", THREADPOOL_MARK),
    ("the lookup fast paths (`sluice/query/fast.py`)", "(sluice/query/fast.py"),
    ("`QueryEngine` (validation, the Redis calls, the answer)", "(sluice/query/engine.py"),
    ("client side of the Redis calls (`sluice/redis/mux.py`)", "(sluice/redis/mux.py"),
    ("redis-py (TLS and clusters only)", "(redis/"),
)


def summarize_profile(raw: str) -> dict[str, Any]:
    """Shares of py-spy's collapsed stacks: self time by package and by function, and the
    inclusive share of the INCLUSIVE markers (samples with the marker anywhere in the stack;
    None = on the event loop, i.e. not in a threadpool thread)."""
    by_pkg: collections.Counter[str] = collections.Counter()
    by_fn: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        by_pkg[_package_of(leaf)] += int(count)
        by_fn[leaf] += int(count)
        for label, marker in INCLUSIVE:
            hit = THREADPOOL_MARK not in stack if marker is None else marker in stack
            incl[label] += int(count) if hit else 0
        total += int(count)
    if total == 0:
        return {"samples": 0, "packages": [], "functions": [], "inclusive": []}
    return {
        "samples": total,
        "packages": [(k, v / total) for k, v in by_pkg.most_common(10)],
        "functions": [(_short_frame(k), v / total) for k, v in by_fn.most_common(12)],
        "inclusive": [(label, incl[label] / total) for label, _ in INCLUSIVE],
    }


def _short_frame(frame: str) -> str:
    """`func (/long/path/site-packages/pkg/mod.py:12)` -> `func (pkg/mod.py:12)`."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
            break
    return f"{name} ({where})"


# -- report ---------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return f"{x:,.1f}" if x < 100 else f"{x:,.0f}"


def results_table(results: Sequence[ScenarioResult]) -> str:
    rows = [
        "| scenario | requests/s (range) | lookups/s | p50 ms | p99 ms | max ms | errors |"
        " Redis µs/lookup | busy after run, s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rates = r.rates()
        rate = median(rates)
        per = r.scenario.lookups_per_request
        rows.append(
            f"| {r.scenario.name} | {rate:,.0f} ({min(rates):,.0f}–{max(rates):,.0f}) |"
            f" {rate * r.scenario.lookups_per_request:,.0f} |"
            f" {_ms(r.med(lambda x: x.pct_ms[50.0]))} | {_ms(r.med(lambda x: x.pct_ms[99.0]))} |"
            f" {_ms(max(x.max_ms for x in r.runs))} | {sum(x.error_count for x in r.runs)} |"
            f" {r.med(lambda x, k=per: x.redis_us_per_lookup(k)):,.0f} |"
            f" {max(x.extra['drain_s'] for x in r.runs):.1f} |"
        )
    return "\n".join(rows)


def cpu_table(results: Sequence[ScenarioResult]) -> str:
    rows = [
        "| scenario | server | Redis | wrk | rest of machine | idle |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cells = [f"{r.cpu(n):.2f}" for n in ("server", "redis", "loadgen", "other", "idle")]
        rows.append(f"| {r.scenario.name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def inproc_table(inproc: dict[str, Any], batch_size: int) -> str:
    rows = [
        "| window | slices merged | `engine.query` median µs | p99 µs | of which `lookup()`"
        " (validation) µs | Redis µs (server side) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in inproc["rows"]:
        rows.append(
            f"| {row.label} | {row.slices} | {row.query_us:,.0f} | {row.query_p99_us:,.0f} |"
            f" {row.lookup_us:,.1f} | {row.redis_us:,.0f} |"
        )
    per = inproc["batch_us"] / batch_size
    rows.append(
        f"| mix, `engine.run` of {batch_size} | - | {inproc['batch_us']:,.0f} per batch"
        f" ({per:,.0f} per lookup) | | | |"
    )
    return "\n".join(rows)


def round_trips_text(inproc: dict[str, Any]) -> str:
    cmds = inproc["commands_per_query"]
    text = (
        f"Commands per `engine.query` (INFO commandstats): {cmds['SCRIPT']:.2f} SCRIPT (EXISTS),"
        f" {cmds['EVALSHA']:.2f} EVALSHA and {cmds['HMGET']:.2f} HMGET (one per resolution the"
        " window's cover reads)."
    )
    if cmds["SCRIPT"] >= 0.99:
        text += (
            " redis-py checks a pipeline's scripts with SCRIPT EXISTS before every execute, and"
            " the engine sends even a single lookup as a pipeline, so each lookup (and each"
            " batch) costs two round trips to Redis instead of one."
        )
    return text


def profile_text(profile: dict[str, Any] | None) -> str:
    if profile is None:
        return (
            "No profile: py-spy was not found (`make setup` installs it in .venv; or pass"
            " `--py-spy PATH`)."
        )
    pkgs = ", ".join(f"{k} {v:.0%}" for k, v in profile["packages"])
    fns = "\n".join(f"| {name} | {share:.1%} |" for name, share in profile["functions"])
    incl = "\n".join(f"| {name} | {share:.0%} |" for name, share in profile["inclusive"])
    return (
        f"py-spy ({PROFILE_RATE_HZ} Hz, non-blocking, `--gil`: only the thread holding the GIL"
        " is sampled, so this is where the server's Python CPU goes, not where it waits) on the"
        f" server during one extra {profile['scenario']} run at {profile['rate_per_s']:,.0f}"
        f" requests/s; {profile['samples']:,} samples. Self time by package: {pkgs}.\n\n"
        "| inclusive (stack contains) | share of samples |\n|---|---:|\n"
        + incl
        + "\n\n| function (self time) | share of samples |\n|---|---:|\n"
        + fns
    )


@dataclass
class RunInfo:
    command: str
    started: dt.datetime
    took_s: float
    load_before: float
    load_after: float
    load_s: float
    redis_version: str
    redis_memory: str
    workers_supported: bool


def machine_text() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores ({model}), {platform.system()} {platform.release()}"


def _met(p99_ms: float) -> str:
    return "**met**" if p99_ms <= TARGET_P99_MS else "**not met**"


def verdict(results: Sequence[ScenarioResult], plan: Plan) -> str:
    """The targets: p99 on the closed-loop 100-connection GET run (and at paced load), and
    lookups/s in batches."""
    get100, paced = results[1], results[-1]
    p99 = get100.med(lambda x: x.pct_ms[99.0])
    rate = median(get100.rates())
    paced_p99 = paced.med(lambda x: x.pct_ms[99.0])
    batch = median(results[2].rates()) * plan.batch_size
    need = plan.connections / (TARGET_P99_MS / 1000)
    return (
        f"Target: p99 ≤ {TARGET_P99_MS:g} ms for single GET lookups at {plan.connections}"
        f" concurrent clients: {_met(p99)} (p99 {_ms(p99)} ms at {rate:,.0f} requests/s). With"
        " clients that never pause (closed loop), Little's law gives mean latency = clients /"
        f" throughput, so {plan.connections} clients with every answer under"
        f" {TARGET_P99_MS:g} ms need at least {need:,.0f} requests/s; below that rate the latency"
        f" is mostly queueing in the server, not work. With the same {plan.connections} clients"
        f" pausing between requests so that they offer about {plan.paced_load:.0%} of the"
        f" saturated rate ({median(paced.rates()):,.0f} requests/s achieved), p99 was"
        f" {_ms(paced_p99)} ms: {_met(paced_p99)}.\n\n"
        f"Target: ≥ {TARGET_BATCH_LOOKUPS_PER_S:,} lookups/s inside `POST /v1/query` batches:"
        f" {'**met**' if batch >= TARGET_BATCH_LOOKUPS_PER_S else '**not met**'}"
        f" ({batch:,.0f} lookups/s in batches of {plan.batch_size}). The seed system's figure"
        " was measured on 2 server and 4 compute/storage machines; here the server, Redis and"
        " the load generator share 2 cores, and the CPU table shows them all busy."
    )


def section_body(
    plan: Plan,
    info: RunInfo,
    spec: DataSpec,
    results: Sequence[ScenarioResult],
    inproc: dict[str, Any],
    windows: Sequence[WindowRow],
    profile: dict[str, Any] | None,
    png_name: str | None,
) -> str:
    mode = "quick smoke mode (small data, short runs)" if plan.quick else "full mode"
    workers = (
        f"{plan.workers} worker{'s' if plan.workers > 1 else ''}"
        if info.workers_supported
        else "1 worker: `sluice serve` has no workers option"
    )
    load = (
        f"{spec.keys['txn_count']:,} cards (`txn_count`, count by card) and"
        f" {spec.keys['amount_sum']:,} merchants (`amount_sum`, sum of amount by merchant)"
    )
    res = plan.resolutions_ms
    slicing = (
        "1 m slices"
        if len(res) == 1
        else f"`resolutions: [{', '.join(format_duration_ms(r) for r in res)}]` (a hash per"
        " resolution, coarser slices = sums of the 1 m ones they hold)"
    )
    n_read = ", ".join(f"{slices_read(plan, spec, w):,}" for w in WINDOWS)
    parts = [
        f"Command: `{info.command}` (from the repository root), {mode}; took"
        f" {info.took_s / 60:.1f} min.",
        f"Date: {info.started:%Y-%m-%d %H:%M} UTC. Machine: {machine_text()}. **The 2 cores are"
        f" shared** by the load generator (wrk, {plan.wrk_threads} thread), the server"
        f" (`sluice serve`, {workers}), Redis, and whatever else runs on the machine (1-min load"
        f" average {info.load_before:.2f} at start, {info.load_after:.2f} at end); the CPU table"
        " shows who used what. Numbers are medians over runs; treat them as indicative.",
        f"Setup: embedded redis-server {info.redis_version} (AOF off: the benchmark only reads),"
        f" loaded directly in the writer's slice format (checked byte for byte against"
        f" `write_slices.lua`) with {load}; {slicing}, 7 d retention; every key has a value in"
        f" every 1 m slice from {spec.hours:g} h before the start to {spec.ahead_min} min after"
        f" it (dense: every slice a lookup reads holds data): {spec.total_fields():,} hash fields,"
        f" {info.redis_memory} in Redis, loaded in {info.load_s:.0f} s. Answers over HTTP were"
        " checked against values merged in Python from the raw hashes before the runs."
        f" Requests: metric uniform over the two, key Zipf(1.3) over the metric's keys (as"
        f" `sluice.source.loadgen`), window uniform over {', '.join(WINDOWS)} ({n_read} slices"
        " merged). wrk keeps its connections alive; each scenario is a"
        f" {plan.warmup_s:g} s warm-up, then {plan.runs} runs of {plan.duration_s:g} s.",
        "### HTTP, through `sluice serve`",
        results_table(results),
        "Latency is wrk's, per request, from send to full response (not corrected for"
        " coordinated omission). Errors = connect/read/write errors, timeouts (10 s) and non-2xx"
        " answers, summed over the runs. Redis µs/lookup = Redis' own time in the commands"
        " lookups send (HMGET for raw slices, EVALSHA of `read_slices.lua` for ranges over"
        " 2,000 slices; INFO commandstats) per lookup, which is the time Redis is busy per lookup"
        " (wall time inside Redis, so it grows when Redis waits for a core). Busy after run ="
        " how long the server kept working after wrk closed its connections, on requests"
        " already queued (the server does not cancel work for clients that have gone); the next"
        f" run started only after Redis had seen no lookup for {DRAIN_QUIET_S:g} s (max of the"
        " runs).",
        verdict(results, plan),
        "CPU used during the runs, in cores (CPU seconds / wall seconds, medians over runs; the"
        " machine has 2):",
        cpu_table(results),
        "### Window length",
        windows_text(windows, plan.connections, window_seconds(plan)),
        "### In-process cost of one lookup (no HTTP)",
        f"`QueryEngine.query` from the benchmark process against the same Redis, sequentially,"
        f" {plan.inproc_iterations:,} lookups per row, idle server. A PING round trip costs"
        f" {inproc['ping_us']:,.0f} µs median.",
        inproc_table(inproc, plan.batch_size),
        round_trips_text(inproc),
        "### Where the time goes",
        profile_text(profile),
    ]
    if png_name:
        parts.append(f"![query latency distribution]({png_name})")
    return "\n\n".join(parts)


def plot(results: Sequence[ScenarioResult], path: Path) -> bool:
    """Latency percentiles of each scenario's median run. Returns False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is missing; no plot")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        run = r.median_run()
        qs = sorted(run.pct_ms)
        ax.plot([run.pct_ms[q] for q in qs], qs, marker="o", label=r.scenario.name)
    ax.axvline(
        TARGET_P99_MS, color="grey", linestyle="--", label=f"target p99 {TARGET_P99_MS:g} ms"
    )
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("percentile")
    ax.set_title("sluice serve: request latency (median run per scenario)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="1-2 minute smoke run, small data")
    p.add_argument("--keys", type=int, default=None, help="cards (txn_count keys); full 10000")
    p.add_argument("--merchants", type=int, default=None, help="amount_sum keys; keys/10")
    p.add_argument("--hours", type=float, default=24.0, help="hours of 1 m slices per key")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up run; 2 quick, 5 full")
    p.add_argument("--duration-s", type=float, default=None, help="per run; 5 quick, 20 full")
    p.add_argument("--runs", type=int, default=None, help="timed runs per scenario; 2 / 3")
    p.add_argument("--connections", type=int, default=100, help="concurrent clients")
    p.add_argument("--batch-size", type=int, default=50, help="lookups per POST /v1/query")
    p.add_argument("--workers", type=int, default=2, help="server worker processes")
    p.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (CPU it takes)")
    p.add_argument(
        "--paced-load",
        type=float,
        default=0.5,
        help="think-time scenario's offered load, fraction of the saturated GET rate",
    )
    p.add_argument(
        "--resolutions",
        default="1m",
        help="slice lengths kept per metric, finest first, e.g. 1m,1h (config `resolutions`)",
    )
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--py-spy", default="auto", help="py-spy binary, 'auto' (PATH) or 'off'")
    p.add_argument("--profile-out", type=Path, default=None, help="keep py-spy's raw stacks")
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "query_latency.png")
    p.add_argument("--no-docs", action="store_true", help="print the section, do not write it")
    args = p.parse_args(argv)
    for name in ("keys", "merchants", "runs", "warmup_s", "duration_s"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    args.resolutions_ms = parse_resolutions(p, args.resolutions)
    if not 0 < args.paced_load <= 1:
        p.error("--paced-load must be in (0, 1]")
    if args.connections < 1 or args.batch_size < 1 or args.workers < 1 or args.wrk_threads < 1:
        p.error("--connections, --batch-size, --workers and --wrk-threads must be >= 1")
    return args


def parse_resolutions(p: argparse.ArgumentParser, text: str) -> tuple[int, ...]:
    """`1m,1h` -> (60000, 3600000): starts at 1m, each a multiple of the one before."""
    try:
        res = tuple(parse_duration_ms(x.strip()) for x in text.split(","))
    except ValueError as e:
        p.error(f"--resolutions: {e}")
    if res[0] != SLICE_MS or any(b <= a or b % a for a, b in itertools.pairwise(res)):
        p.error("--resolutions must start at 1m, each a multiple of the one before")
    return res


def preflight(plan: Plan) -> bool:
    """Exit early with a clear message if wrk is missing or --workers is unsupported. Returns
    whether `serve` supports workers."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is required: apt-get install -y wrk (Debian/Ubuntu)")
    supported = serve_supports_workers()
    if plan.workers > 1 and not supported:
        raise SystemExit("`sluice serve` has no --workers option; run with --workers 1")
    if not supported:
        log("note: `sluice serve` has no workers option; benchmarking its single worker")
    return supported


def _on_sigterm(signum: int, _: Any) -> None:
    raise SystemExit(128 + signum)


def run(plan: Plan, args: argparse.Namespace, argv: Sequence[str]) -> int:
    workers_supported = preflight(plan)
    started = dt.datetime.now(dt.UTC)
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]
    rng = np.random.default_rng(plan.seed)
    tmp = Path(tempfile.mkdtemp(prefix="sluice-query-bench-"))
    env: Env | None = None
    redis_server: EmbeddedRedis | None = None
    try:
        redis_server, client = start_redis(tmp)
        cfg, config_path = write_config(tmp, redis_server.url, plan.resolutions_ms)
        coarse = plan.resolutions_ms if len(plan.resolutions_ms) > 1 else (SLICE_MS, 3_600_000)
        spec = DataSpec(
            keys={"txn_count": plan.cards, "amount_sum": plan.merchants},
            hours=plan.hours,
            ahead_min=AHEAD_MIN,
            now_ms=int(time.time() * 1000),
            resolutions_ms=tuple(sorted({*plan.resolutions_ms, *coarse})),  # what both serve
        )
        env = Env(tmp, redis_server, client, spec, cfg, config_path)
        load_s = load_data(env, plan.seed)
        log("measuring the in-process cost of one lookup")
        inproc = measure_in_process(env, plan, rng)
        write_request_files(env, plan, rng)
        env.serve = ServeProcess(config_path, free_port(), plan.workers, tmp / "serve.log")
        env.serve.start()
        log(f"sluice serve is up at {env.serve.base_url} (pids {env.serve.pids()})")
        verify_http(env.serve.base_url, env, rng, plan.batch_size)
        log("HTTP answers match values merged from the raw hashes")
        results = [run_scenario(env, plan, sc) for sc in scenarios(plan)]
        paced = paced_scenario(plan, median(results[1].rates()))
        results.append(run_scenario(env, plan, paced))
        windows = compare_windows(env, plan, rng, coarse, measure_run, window_seconds(plan))
        profile = profile_server(env, plan, scenarios(plan)[1])
        info = RunInfo(
            command=".venv/bin/python bench/query.py" + "".join(f" {shlex.quote(a)}" for a in argv),
            started=started,
            took_s=time.monotonic() - t0,
            load_before=load_before,
            load_after=os.getloadavg()[0],
            load_s=load_s,
            redis_version=client.info("server").get("redis_version", "?"),
            redis_memory=client.info("memory").get("used_memory_human", "?"),
            workers_supported=workers_supported,
        )
        publish(plan, args, info, spec, results, inproc, windows, profile)
    finally:
        if env is not None and env.serve is not None:
            env.serve.stop()
        if redis_server is not None:
            redis_server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def publish(
    plan: Plan,
    args: argparse.Namespace,
    info: RunInfo,
    spec: DataSpec,
    results: Sequence[ScenarioResult],
    inproc: dict[str, Any],
    windows: Sequence[WindowRow],
    profile: dict[str, Any] | None,
) -> None:
    """Summary to stdout; the docs section and plot unless --no-docs."""
    png_name = None
    if not args.no_docs and plot(results, args.png):
        png_name = os.path.relpath(args.png, args.md.parent)
    body = section_body(plan, info, spec, results, inproc, windows, profile, png_name)
    print(results_table(results))
    print()
    print(verdict(results, plan))
    if args.no_docs:
        print(f"\n{HEADING}\n\n{body}")
        return
    replace_section(args.md, HEADING, body)
    log(f"wrote {args.md} ({HEADING}) and {args.png}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    return run(make_plan(args), args, argv)


if __name__ == "__main__":
    sys.exit(main())
