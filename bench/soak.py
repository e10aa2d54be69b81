"""Soak: `sluice run` (a leader and a standby) and `sluice serve` for `--minutes` under steady
load with bursts, late events and bad records, through repeated `kill -9`s and a Redis restart;
then exact counts, audits, dead letters, logs and leaks checked.

    .venv/bin/python bench/soak.py                                # 30 minutes, a kill every 5
    .venv/bin/python bench/soak.py --quick --minutes 4 --kill-every 1.5

The log is Redis Streams (jsonl, 2 shards, the bench metrics). Kafka is not soaked: the test
broker (`tansu`, `sluice.testing.kafka`) keeps its topics in memory only, so a broker restart
loses every record and committed offset, and no count could be exact across it.

Load: a paced producer at `--rate` events/s (Zipf keys, 1% up to 5 min late), BURST_X times that
for BURST_S every BURST_EVERY_S; beside it a trickle (EXTRA_PER_S events/s) of entries holding
late events (1 to 15 min old, cards `late-*`) and one bad line each (not JSON, not an object, a
text amount), mixed in the same jsonl entries. Both pools are rebuilt every POOL_S so event
times follow the clock. What Redis acknowledged is counted per card.

Faults: every `--kill-every` minutes the leader's whole process group is killed (`kill -9`); the
standby takes over and the killed one is started again as the new standby (warm before the run
goes on). Once, between two kills, the embedded Redis (AOF on) is shut down for REDIS_DOWN_S and
started again on its port; the load pauses meanwhile (a producer cut off mid-write cannot know
what Redis applied). A `sluice` process that exits without being killed is started again and
reported. `serve` answers a lookup every QUERY_EVERY_S throughout.

Every SAMPLE_S: RSS (driver, JVM, whole process group), open fds and threads of every process,
and Redis's used_memory. At the end: events_in = events acknowledged (good + bad), txn_count per
card summed over the slices = the good events acknowledged per card, dead letters = bad lines
sent, every batch audited, error lines in the logs outside the fault windows, and each
long-lived process's growth from the first quarter of its life to the last. Writes
bench/results/soak[.quick].json; the state dir and logs are kept when a check fails.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import redis
import yaml

from lib.load import (
    METRICS,
    SHARDS,
    LoadPool,
    PacedProducer,
    bench_config_data,
    build_pool,
    now_ms,
    resp_command,
)
from lib.procs import ServeProcess, SluiceProcess, Workspace, http_json, stat_counter, wait_until
from lib.results import Run, log, parser
from sluice.config import Config, config_from_dict
from sluice.redis.embedded import EmbeddedRedis
from sluice.redis.keys import STATS_KEY
from sluice.source.producer import shard_of
from sluice.status.ledger import Ledger
from sluice.status.roles import read_roles

BATCH_CAP = 200_000
POOL_S = 60.0  # pools rebuilt this often, stamped with the clock
POOL_EVENTS = 20_000
BURST_X, BURST_S, BURST_EVERY_S = 3.0, 10.0, 120.0
EXTRA_PER_S = 10.0  # late + bad events/s; each entry: LATE_PER_ENTRY late lines and a bad one
LATE_PER_ENTRY, LATE_CARDS, LATE_MS = 4, 100, (60_000, 900_000)
BAD_LINES = (b"{not json", b"[1, 2, 3]", b'{"ts": %d, "card": "bad", "merchant": "m", '
             b'"amount": "lots"}')  # fmt: skip
REDIS_DOWN_S = 5.0
SAMPLE_S = 10.0
QUERY_EVERY_S = 0.5
POLL_S = 0.1
WAIT_S = 300.0
FAULT_TAIL_S = 20.0  # errors up to this long after a fault's recovery are the fault's
ERROR_LINE = re.compile(rb"level=ERROR|Traceback|Exception in thread| ERROR ")
TS_LINE = re.compile(rb"^ts=(\S+) ")


def wait(ok: Any, what: str, timeout_s: float = WAIT_S) -> None:
    wait_until(ok, what, timeout_s, POLL_S)


# -- load ---------------------------------------------------------------------------------------


def entry_books(pool: LoadPool) -> list[tuple[Counter[str], int]]:
    """Per jsonl XADD of `pool`: (good events per card, bad lines). The payload is RESP element
    10 (`XADD key * d <payload> n <count>`); JSON lines hold no CR LF."""
    out = []
    for cmd in pool.commands:
        cards: Counter[str] = Counter()
        bad = 0
        for line in cmd.split(b"\r\n")[10].split(b"\n"):
            try:
                ev = orjson.loads(line)
            except orjson.JSONDecodeError:
                ev = None
            if isinstance(ev, dict) and isinstance(ev.get("amount"), int | float):
                cards[ev["card"]] += 1
            else:
                bad += 1
        out.append((cards, bad))
    return out


def extra_pool(cfg: Config, at_ms: int, n_entries: int) -> LoadPool:
    """Entries of LATE_PER_ENTRY late events (cards `late-*`, on their shard) and one bad line,
    alternating shards."""
    keys = [k.encode() for k in cfg.source.shard_keys()]
    cards = [[c for c in (f"late-{i}" for i in range(LATE_CARDS)) if shard_of(c, SHARDS) == s]
             for s in range(SHARDS)]  # fmt: skip
    commands, events = [], []
    for i in range(n_entries):
        s = i % SHARDS
        lines = []
        for j in range(LATE_PER_ENTRY):
            late = LATE_MS[0] + (i * 7919 + j * 104729) % (LATE_MS[1] - LATE_MS[0])
            card = cards[s][(i * LATE_PER_ENTRY + j) % len(cards[s])]
            lines.append(orjson.dumps({"ts": at_ms - late, "card": card, "merchant": "late",
                                       "amount": 1.0}))  # fmt: skip
        bad = BAD_LINES[i % len(BAD_LINES)]
        lines.insert(i % (LATE_PER_ENTRY + 1), bad % at_ms if b"%d" in bad else bad)
        payload = b"\n".join(lines)
        commands.append(
            resp_command(b"XADD", keys[s], b"*", b"d", payload, b"n", b"%d" % len(lines))
        )
        events.append(len(lines))
    return LoadPool(commands, events, (sum(events),))


class Load:
    """The soak's producers: the main pool paced at `rate` (times `factor` in a burst) and the
    late-and-bad trickle, both replaced by fresh pools on `rotate()`. `acked` counts per card the
    good events Redis acknowledged, `bad` the bad lines; a producer's error is kept in `errors`."""

    def __init__(self, url: str, cfg: Config, rate: float) -> None:
        self.url, self.cfg, self.rate, self.factor = url, cfg, rate, 1.0
        self.acked: Counter[str] = Counter()
        self.bad, self.events, self.seed = 0, 0, 0
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.running: list[tuple[PacedProducer, list[tuple[Counter[str], int]]]] = []

    def start(self) -> None:
        at, self.seed = now_ms(), self.seed + 1
        main = build_pool(self.cfg, POOL_EVENTS, self.seed, at)
        extra = extra_pool(self.cfg, at, math.ceil(EXTRA_PER_S * POOL_S / (LATE_PER_ENTRY + 1)))
        with self.lock:
            for pool, rate in ((main, self.rate * self.factor), (extra, EXTRA_PER_S)):
                producer = PacedProducer(self.url, pool, rate, retry_busy=True)
                producer.start()
                self.running.append((producer, entry_books(pool)))

    def stop(self) -> None:
        """Stop the producers (each finishes its retries) and book what Redis acknowledged."""
        with self.lock:
            running, self.running = self.running, []
        for producer, _ in running:
            producer.stop()
        for producer, books in running:
            producer.join(60)
            if producer.error is not None:
                self.errors.append(f"{now_ms()}: {producer.error!r}")
            self._book(producer, books)

    def _book(self, producer: PacedProducer, books: list[tuple[Counter[str], int]]) -> None:
        """The acknowledged entries are a prefix of the pool's cycle (BUSY retries are sent
        before the producer stops)."""
        pool, left = producer.pool, producer.sent_events
        cycles, left = divmod(left, pool.total_events)
        for cards, bad in books:
            for c, k in cards.items():
                self.acked[c] += k * cycles
            self.bad += bad * cycles
        for (cards, bad), n in zip(books, pool.events, strict=True):
            if left <= 0:
                break
            self.acked.update(cards)
            self.bad, left = self.bad + bad, left - n
        if left != 0:
            self.errors.append(f"{now_ms()}: acknowledged events end mid-entry ({left})")
        self.events += producer.sent_events

    def rotate(self) -> None:
        self.stop()
        self.start()

    def set_factor(self, factor: float) -> None:
        with self.lock:
            self.factor = factor
            if self.running:
                self.running[0][0].rate_per_s = self.rate * factor  # read on every tick


class Bursts(threading.Thread):
    """`load` at BURST_X its rate for BURST_S every BURST_EVERY_S; `spans` (start, end) ms."""

    def __init__(self, load: Load) -> None:
        super().__init__(name="soak-bursts", daemon=True)
        self.load = load
        self.spans: list[list[int]] = []
        self.stop_evt = threading.Event()

    def run(self) -> None:
        while not self.stop_evt.wait(BURST_EVERY_S - BURST_S):
            self.load.set_factor(BURST_X)
            self.spans.append([now_ms(), 0])
            self.stop_evt.wait(BURST_S)
            self.load.set_factor(1.0)
            self.spans[-1][1] = now_ms()


class Queries(threading.Thread):
    """A lookup on `serve` every QUERY_EVERY_S; `failed` holds (ms, status or error)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(name="soak-queries", daemon=True)
        self.path = base_url + "/v1/metrics/txn_count?key=card-1&window=5m"
        self.ok = 0
        self.failed: list[tuple[int, str]] = []
        self.stop_evt = threading.Event()

    def run(self) -> None:
        while not self.stop_evt.wait(QUERY_EVERY_S):
            try:
                status, _ = http_json(self.path, timeout_s=5.0)
            except OSError as e:
                self.failed.append((now_ms(), repr(e)))
                continue
            if status == 200:
                self.ok += 1
            else:
                self.failed.append((now_ms(), str(status)))


# -- resources ----------------------------------------------------------------------------------


def proc_usage(pid: int) -> tuple[str, int, int, int] | None:
    """(name, RSS kB, threads, open fds) of one process, None if it is gone."""
    try:
        fields = dict(
            ln.split(":", 1) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    rss = int(fields.get("VmRSS", "0 kB").split()[0])
    return fields["Name"].strip(), rss, int(fields["Threads"]), fds


class Sampler(threading.Thread):
    """Every SAMPLE_S, per process in `procs` (name -> SluiceProcess, or a callable giving a
    pid): [ms, name, RSS MB of the group, of the driver, of the JVM, fds, threads]; and
    [ms, Redis used_memory MB] in `redis_rows` (None while it is down)."""

    def __init__(self, procs: dict[str, Any], client: Any) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.procs, self.client = procs, client
        self.rows: list[list[Any]] = []
        self.redis_rows: list[list[Any]] = []
        self.stop_evt = threading.Event()

    def run(self) -> None:
        while True:
            t = now_ms()
            for name, p in list(self.procs.items()):
                if isinstance(p, SluiceProcess) and not p.alive():
                    continue
                pids = p.pids() if isinstance(p, SluiceProcess) else [x for x in [p()] if x]
                used = [(pid, u) for pid in pids if (u := proc_usage(pid))]
                if not used:
                    continue
                driver = next((u[1] for pid, u in used if pid == pids[0]), 0)
                jvm = sum(u[1] for _, u in used if u[0] == "java")
                self.rows.append([t, name, sum(u[1] for _, u in used) / 1024, driver / 1024,
                                  jvm / 1024, sum(u[3] for _, u in used),
                                  sum(u[2] for _, u in used)])  # fmt: skip
            try:
                mem = int(self.client.info("memory")["used_memory"]) / 1e6
            except (redis.RedisError, OSError):
                mem = None
            self.redis_rows.append([t, mem])
            if self.stop_evt.wait(SAMPLE_S):
                return


def growth(rows: list[list[Any]], col: int, lo_ms: int = 0) -> dict[str, Any] | None:
    """Column `col` of `rows` (from `lo_ms` on): the median of the first and of the last quarter
    of the samples, and the change between them per hour (None under 8 samples)."""
    rows = [r for r in rows if r[0] >= lo_ms]
    if len(rows) < 8:
        return None
    q = len(rows) // 4

    def med(part: list[list[Any]]) -> tuple[float, float]:
        vals, times = sorted(r[col] for r in part), sorted(r[0] for r in part)
        return vals[len(vals) // 2], times[len(times) // 2]

    (first, t0), (last, t1) = med(rows[:q]), med(rows[-q:])
    return {"first": first, "last": last, "max_first": max(r[col] for r in rows[:q]),
            "max_last": max(r[col] for r in rows[-q:]),
            "span_min": (rows[-1][0] - rows[0][0]) / 6e4,
            "per_hour": (last - first) / max(t1 - t0, 1) * 3.6e6}  # fmt: skip


def leaks(rows: list[list[Any]], since: dict[str, int]) -> list[dict[str, Any]]:
    """Per process, RSS, fds and threads from the first quarter of its samples to the last
    (a run process that led: from `since[name]`, when it last became the leader, plus a
    minute). Flat: RSS within 5% (or 20 MB) and no more fds or threads at the end than at the
    start."""
    out = []
    for name in dict.fromkeys(r[1] for r in rows):
        if name.startswith("run-") and name not in since:  # never led: a start, then a kill
            continue
        mine = [r for r in rows if r[1] == name]
        lo = since.get(name, 0) + (60_000 if name in since else 0)
        rss, fds, threads = (growth(mine, c, lo) for c in (2, 5, 6))
        if rss is None or fds is None or threads is None:
            continue
        flat = (abs(rss["last"] - rss["first"]) <= max(20.0, 0.05 * rss["first"])
                and fds["max_last"] <= fds["max_first"] + 2
                and threads["max_last"] <= threads["max_first"] + 2)  # fmt: skip
        out.append({"process": name, "rss_mb": rss, "fds": fds, "threads": threads,
                    "flat": flat})  # fmt: skip
    return out


# -- logs ---------------------------------------------------------------------------------------


def _ts_ms(raw: bytes) -> int:
    return int(dt.datetime.fromisoformat(raw.decode().replace("Z", "+00:00")).timestamp() * 1000)


def scan_logs(paths: list[Path], windows: list[tuple[int, int, str]]) -> dict[str, Any]:
    """Error lines (level=ERROR, tracebacks, JVM ERRORs) in `paths`, each placed at the last
    `ts=` stamp before it and explained by the fault whose window (lo ms, hi ms, what) holds it."""
    explained: Counter[str] = Counter()
    unexplained: list[str] = []
    for path in paths:
        at = 0
        for line in path.read_bytes().splitlines():
            if m := TS_LINE.match(line):
                at = _ts_ms(m.group(1))
            if not ERROR_LINE.search(line):
                continue
            fault = next((w for lo, hi, w in windows if lo <= at <= hi), None)
            if fault is not None:
                explained[fault] += 1
            else:
                unexplained.append(f"{path.name}: {line.decode(errors='replace')[:300]}")
    return {"explained": dict(explained), "unexplained": len(unexplained),
            "unexplained_examples": unexplained[:8]}  # fmt: skip


# -- the run ------------------------------------------------------------------------------------


def store_per_card(client: Any) -> Counter[str]:
    """txn_count summed over its slices, per card (`<writer token>:<count>` per slice field)."""
    out: Counter[str] = Counter()
    for key in client.scan_iter(match="sluice:s:{txn_count|*", count=5000):
        name = key.decode()
        if ":r" in name.rsplit("}", 1)[1]:  # a coarser resolution
            continue
        fields = client.hgetall(key)
        out[name.split("|", 1)[1].split("}", 1)[0]] += sum(
            int(v.split(b":")[1]) for f, v in fields.items() if f != b"_m"
        )
    return out


def fault_plan(minutes: float, kill_every: float) -> tuple[list[float], float]:
    """(kill times, the Redis restart time), in s from the start of the load: kills every
    `kill_every` minutes up to a minute before the end; the restart halfway between two kills
    near the middle."""
    kills = [k * kill_every * 60 for k in range(1, int(minutes / kill_every) + 1)]
    kills = [t for t in kills if t <= minutes * 60 - 60]
    restart = (math.floor(minutes / 2 / kill_every) + 0.5) * kill_every * 60
    return kills, restart if restart < minutes * 60 - 60 else minutes * 30


def soak(ws: Workspace, minutes: float, kill_every: float, rate: float) -> dict[str, Any]:
    root = ws.state_dir("soak")
    server = EmbeddedRedis(root / "redis").start()
    hours = math.ceil((minutes + 30) / 60)  # retention past the run: every slice still counts
    data = bench_config_data("jsonl", root / "state", BATCH_CAP) | {"redis": server.url}
    data["metrics"] = [m | {"retention": f"{hours}h"} for m in METRICS]
    cfg_path = root / "sluice.yaml"
    cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = config_from_dict(data)
    client = redis.Redis.from_url(server.url, socket_timeout=10)
    n, since = 0, dict[str, int]()
    procs: dict[str, Any] = {"redis": lambda: server.pid}
    faults: list[dict[str, Any]] = []
    exits: list[dict[str, Any]] = []

    def spawn() -> SluiceProcess:
        nonlocal n
        n += 1
        procs[f"run-{n}"] = p = SluiceProcess(["run", "-c", str(cfg_path)], root / f"run-{n}.log")
        return p.start()

    def name(p: SluiceProcess) -> str:
        return next(k for k, v in procs.items() if v is p)

    def roles() -> dict[str, Any]:
        try:
            return read_roles(client, cfg, now_ms())
        except (redis.RedisError, OSError):
            return {"leader": None, "processes": []}

    def leads(p: SluiceProcess) -> bool:
        leader = roles()["leader"]
        return leader is not None and p.proc is not None and leader["pid"] == p.proc.pid

    def warm(p: SluiceProcess) -> bool:
        pid = p.proc.pid if p.proc else None
        return any(x["pid"] == pid and x["role"] == "standby" and x["warm"]
                   for x in roles()["processes"])  # fmt: skip

    def last_done() -> int:
        try:
            raw = client.hget(STATS_KEY, "last_batch")
        except (redis.RedisError, OSError):
            return 0
        return int(orjson.loads(raw)["done_ms"]) if raw else 0

    def supervise(runs: list[SluiceProcess]) -> list[SluiceProcess]:
        """Start again (and report) a process that exited without being killed."""
        for i, p in enumerate(runs):
            if not p.alive():
                rc = p.proc.returncode if p.proc else None
                exits.append({"process": name(p), "at_ms": now_ms(), "code": rc,
                              "tail": p.tail(600)})  # fmt: skip
                log(f"{name(p)} exited on its own (code {rc}); starting another")
                runs[i] = spawn()
        return runs

    runs = [spawn(), spawn()]
    serve = ServeProcess(cfg_path, 1, root / "serve.log").start()
    procs["serve"] = serve
    sampler = Sampler(procs, client)
    sampler.start()
    load = Load(server.url, cfg, rate)
    load.start()
    wait(lambda: any(leads(p) for p in runs) and last_done() > 0, "the first batch")
    leader = next(p for p in runs if leads(p))
    since[name(leader)] = now_ms()
    wait(lambda: warm(next(p for p in runs if p is not leader)), "a warm standby")
    bursts, queries = Bursts(load), Queries(serve.base_url)
    bursts.start()
    queries.start()
    kills, restart_at = fault_plan(minutes, kill_every)
    t0 = time.monotonic()
    start_ms, next_pool, restarted = now_ms(), POOL_S, False
    log(f"soak: {minutes} min; kills at {[round(k) for k in kills]} s, Redis restart at "
        f"{restart_at:.0f} s; state under {root}")  # fmt: skip
    try:
        while (t := time.monotonic() - t0) < minutes * 60:
            runs = supervise(runs)
            if not serve.alive():
                exits.append({"process": "serve", "at_ms": now_ms(), "tail": serve.tail(600)})
                serve.start()
            if t >= next_pool:
                load.rotate()
                next_pool += POOL_S
            if kills and t >= kills[0]:
                kills.pop(0)
                leader = next((p for p in runs if leads(p)), runs[0])
                standby = next(p for p in runs if p is not leader)
                at = now_ms()
                leader.kill9()
                log(f"soak: killed the leader {name(leader)} at {t:.0f} s")
                wait(lambda s=standby, a=at: leads(s) and last_done() > a, "the new leader")
                took = now_ms()
                since[name(standby)] = took
                runs = [standby, spawn()]
                wait(lambda p=runs[1]: warm(p), "the new standby to warm up")
                faults.append({"kind": "kill -9 of the leader", "process": name(leader),
                               "at_ms": at, "at_s": (at - start_ms) / 1000,
                               "recovered_s": (took - at) / 1000,
                               "standby_warm_s": (now_ms() - at) / 1000})  # fmt: skip
                log(f"soak: {faults[-1]}")
            if not restarted and t >= restart_at:
                restarted = True
                load.stop()
                at = now_ms()
                server.stop()
                time.sleep(REDIS_DOWN_S)
                server.start()
                up = now_ms()
                load.start()
                wait(lambda u=up: last_done() > u, "a batch after the Redis restart")
                # The outage cost the leader its lease: whoever leads now began a new term
                # (queries stopped, armed again and let go), so its figures start here.
                for p in runs:
                    if leads(p):
                        since[name(p)] = now_ms()
                faults.append({"kind": "Redis restart", "at_ms": at, "at_s": (at - start_ms) / 1000,
                               "down_s": (up - at) / 1000,
                               "recovered_s": (now_ms() - at) / 1000})  # fmt: skip
                log(f"soak: {faults[-1]}")
            time.sleep(1.0)
    finally:
        bursts.stop_evt.set()
        load.set_factor(1.0)
        load.stop()
        end_ms = now_ms()
    log(f"soak: load stopped; {load.events:,} events acknowledged, {load.bad:,} bad; draining")
    try:
        wait(lambda: stat_counter(client, "events_in") >= load.events, "the final drain")
    except RuntimeError as e:  # reported by the checks below
        log(f"soak: {e}")
    time.sleep(2.0)
    queries.stop_evt.set()
    sampler.stop_evt.set()
    sampler.join()
    raw: Any = client.hgetall(STATS_KEY)
    stats = {k.decode(): v.decode() for k, v in raw.items()}
    counters = {k: int(v) for k, v in stats.items() if v.isdigit()}
    per_card = store_per_card(client)
    wrong = {c for c in set(per_card) | set(load.acked) if per_card[c] != load.acked[c]}
    batches = counters.get("batches", 0)
    last_batch = int(orjson.loads(stats["last_batch"])["batch"])
    records = Ledger(client, cfg.source.stream, cfg.audit.ledger_shards).recent(
        last_batch, last_batch + 1
    )
    for p in [*runs, serve]:
        p.stop()
    server.stop()
    windows = [(f["at_ms"] - 1000, f["at_ms"] + int((f["recovered_s"] + FAULT_TAIL_S) * 1000),
                f["kind"]) for f in faults]  # fmt: skip
    logs = scan_logs([*sorted(root.glob("run-*.log")), root / "serve.log"], windows)
    failed_q = [
        (t, e) for t, e in queries.failed if not any(lo <= t <= hi for lo, hi, _ in windows)
    ]
    good = sum(load.acked.values())
    checks = {
        "events_in = acknowledged": counters.get("events_in") == load.events,
        "aggregated = good acknowledged": counters.get("events_aggregated") == good,
        "txn_count per card = acknowledged per card": not wrong,
        "dead letters = bad lines sent": counters.get("dead_letters") == load.bad,
        "no event expired": counters.get("dead_expired", 0) == 0,
        "every batch audited": counters.get("audit_ok") == batches
        and all(r["ok"] for r in records),
        "no error outside the fault windows": logs["unexplained"] == 0,
        "no unplanned exit": not exits,
        "no failed lookup outside the fault windows": not failed_q,
        "no producer error": not load.errors,
    }
    rows = sampler.rows
    return {
        "checks": checks, "all_ok": all(checks.values()), "started_ms": start_ms,
        "ended_ms": end_ms, "events_acked": load.events, "good_acked": good,
        "bad_sent": load.bad,
        "late_acked": sum(v for c, v in load.acked.items() if c.startswith("late-")),
        "cards": len(load.acked), "cards_wrong": len(wrong), "stats": counters,
        "batches": batches, "ledger_records": len(records),
        "bursts": [[(a - start_ms) / 1000, (b - start_ms) / 1000] for a, b in bursts.spans],
        "faults": faults, "exits": exits, "logs": logs, "producer_errors": load.errors,
        "lookups_ok": queries.ok, "lookups_failed": len(queries.failed),
        "lookups_failed_outside": failed_q[:8], "leaks": leaks(rows, since),
        "redis_used_mb": growth(sampler.redis_rows and [r for r in sampler.redis_rows
                                                        if r[1] is not None], 1),
        "series": {"t0_ms": start_ms, "procs": rows, "redis": sampler.redis_rows,
                   "faults": [[f["at_s"], f["kind"]] for f in faults]},
    }  # fmt: skip


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=30.0, help="length of the load")
    p.add_argument("--rate", type=float, default=1_500.0, help="steady producer events/s")
    p.add_argument("--kill-every", type=float, default=5.0, help="minutes between leader kills")
    p.add_argument("--keep", action="store_true", help="keep the state dir and logs (kept"
                   " anyway when a check fails)")  # fmt: skip
    a = p.parse_args()
    if a.kill_every * 60 < 60 or a.minutes < 2:
        p.error("`--kill-every` must be at least 1 minute and `--minutes` at least 2")
    run = Run("soak", a)
    ws = Workspace(keep=a.keep)
    r: dict[str, Any] = {}
    try:
        r = soak(ws, a.minutes, a.kill_every, a.rate)
    finally:
        ws.keep = ws.keep or not r.get("all_ok", False)  # a failed check's logs are evidence
        ws.cleanup()
    series = r.pop("series")
    log(f"soak: checks {r['checks']}")
    params = {"minutes": a.minutes, "rate_per_s": a.rate, "kill_every_min": a.kill_every,
              "burst_x": BURST_X, "burst_s": BURST_S, "burst_every_s": BURST_EVERY_S,
              "extra_per_s": EXTRA_PER_S, "late_per_entry": LATE_PER_ENTRY,
              "late_min": [x / 60_000 for x in LATE_MS], "redis_down_s": REDIS_DOWN_S,
              "sample_s": SAMPLE_S, "query_every_s": QUERY_EVERY_S, "pool_s": POOL_S,
              "batch_cap": BATCH_CAP, "fault_tail_s": FAULT_TAIL_S}  # fmt: skip
    run.write(params, r, series)


if __name__ == "__main__":
    main()
