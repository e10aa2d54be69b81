"""Durability benchmark: what `appendfsync everysec` (`durability: default`) and `always`
(`durability: strict`) cost a producer, and what a `kill -9` of Redis loses under each.

    .venv/bin/python bench/durability.py            # full run, about 4 minutes
    .venv/bin/python bench/durability.py --quick    # smoke run, under a minute

Both settings side by side in one run, each on a fresh embedded Redis (its AOF on this machine's
disk) per measurement:

1. throughput: 1 and 4 producer connections send pre-encoded XADD pipelines the way the
   Producer SDK's `flush` does (about 2,000 events per pipeline: 2,000 entries in `fields`, 4
   entries of 500 events in `jsonl`, over 2 shards) and wait for each pipeline's replies before
   sending the next. Events/s acknowledged, and the time from sending a pipeline to its last
   reply.
2. kill -9: two producers (one per format) load the server; SIGKILL it at a random time 0.5 to
   1.5 s in (`random`), or, for everysec, as soon as after that INFO shows a background AOF
   fsync in flight (`during fsync`, the worst moment for everysec); restart it from its AOF and
   count the acknowledged events that are gone, and how long before the kill the oldest of them
   was acknowledged.

Results go to the `## Durability (bench/durability.py)` section of docs/benchmarks.md and the
`## Measured (bench/durability.py)` section of docs/durability.md, a summary to stdout,
progress to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from _util import (
    METRICS,
    SCHEMA,
    LoadPool,
    RespWriter,
    build_pool,
    log,
    machine_note,
    percentile,
    replace_section,
    resp_command,
)
from sluice.config import config_from_dict
from sluice.redis.embedded import EmbeddedRedis, find_server_binary

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Durability (bench/durability.py)"
DOC_HEADING = "## Measured (bench/durability.py)"
MODES = ("everysec", "always")
FORMATS = ("fields", "jsonl")
PIPELINE_EVENTS = 2000  # the Producer flushes a shard's buffer at 4 x batch_events (500)
POOL_EVENTS = 200_000


@dataclass(frozen=True)
class Plan:
    quick: bool
    throughput_s: float
    reps: int  # throughput runs per case, interleaved; the table shows the median
    producers: tuple[int, ...]
    kills: int
    seed: int


def make_plan(quick: bool, kills: int | None, seed: int) -> Plan:
    if quick:
        return Plan(True, 2.0, 1, (1,), kills or 2, seed)
    return Plan(False, 5.0, 3, (1, 4), kills or 5, seed)


# -- load -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pipeline:
    commands: list[bytes]
    keys: list[bytes]  # the stream key of each command
    events: list[int]  # the events of each command

    @property
    def total_events(self) -> int:
        return sum(self.events)


def _xadd_key(cmd: bytes) -> bytes:
    """The key of a RESP-encoded `XADD key ...`: `*N`, `$4`, `XADD`, `$L`, key, ... (CRLF)."""
    rest = cmd.split(b"\r\n", 4)
    return rest[4][: int(rest[3][1:])]


def pipelines(fmt: str, seed: int) -> list[Pipeline]:
    """`POOL_EVENTS` events of stream `ev-<fmt>` (2 shards) as pipelines of about
    `PIPELINE_EVENTS` events."""
    cfg = config_from_dict(
        {
            "source": {"stream": f"ev-{fmt}", "shards": 2, "format": fmt, "schema": SCHEMA},
            "metrics": METRICS,
        }
    )
    pool: LoadPool = build_pool(cfg, POOL_EVENTS, seed, int(time.time() * 1000))
    out: list[Pipeline] = []
    cur = Pipeline([], [], [])
    for cmd, n in zip(pool.commands, pool.events, strict=True):
        cur.commands.append(cmd)
        cur.keys.append(_xadd_key(cmd))
        cur.events.append(n)
        if cur.total_events >= PIPELINE_EVENTS:
            out.append(cur)
            cur = Pipeline([], [], [])
    return out


@dataclass
class Acked:
    """What one producer was told: per pipeline, (ack time, [(key, entry id, events)])."""

    pipelines: list[tuple[float, list[tuple[bytes, bytes, int]]]] = field(default_factory=list)
    events: int = 0
    latencies_s: list[float] = field(default_factory=list)
    error: BaseException | None = None


def produce(
    url: str, load: Sequence[Pipeline], stop: threading.Event, start: int, keep_ids: bool
) -> Acked:
    """Send `load` (cycling, from index `start`) one pipeline at a time until `stop` or the
    server goes away. Runs in a thread."""
    out = Acked()
    try:
        writer = RespWriter(url, timeout_s=30)
    except OSError as e:
        out.error = e
        return out
    i = start
    try:
        while not stop.is_set():
            p = load[i % len(load)]
            t_send = time.monotonic()
            ids = writer.call_many(p.commands)
            now = time.monotonic()
            out.events += p.total_events
            out.latencies_s.append(now - t_send)
            if keep_ids:
                out.pipelines.append((now, list(zip(p.keys, ids, p.events, strict=True))))
            i += 1
    except (OSError, RuntimeError) as e:  # ConnectionError is an OSError
        out.error = e
    finally:
        writer.close()
    return out


def run_producers(
    url: str, loads: Sequence[Sequence[Pipeline]], stop: threading.Event, keep_ids: bool
) -> tuple[list[threading.Thread], list[Acked]]:
    results: list[Acked] = [Acked() for _ in loads]

    def body(k: int) -> None:
        results[k] = produce(url, loads[k], stop, k * 997, keep_ids)

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(len(loads))]
    for t in threads:
        t.start()
    return threads, results


# -- throughput ------------------------------------------------------------------------------


@dataclass
class ThroughputResult:
    mode: str
    fmt: str
    producers: int
    events_per_s: float
    latencies_s: list[float]


@dataclass
class ThroughputCase:
    """The runs of one (appendfsync, format, producers) case."""

    runs: list[ThroughputResult]

    @property
    def median(self) -> float:
        return statistics.median(r.events_per_s for r in self.runs)

    @property
    def spread(self) -> str:
        rates = [r.events_per_s for r in self.runs]
        return f" ({min(rates):,.0f}–{max(rates):,.0f})" if len(rates) > 1 else ""

    def latency_ms(self, q: float) -> float:
        return (percentile([x for r in self.runs for x in r.latencies_s], q) or 0.0) * 1000


def measure_throughput(
    tmp: Path, mode: str, fmt: str, n_producers: int, load: Sequence[Pipeline], seconds: float
) -> ThroughputResult:
    data_dir = tmp / f"tp-{mode}-{fmt}-{n_producers}"
    with EmbeddedRedis(data_dir, appendfsync=mode) as server:
        stop = threading.Event()
        t0 = time.monotonic()
        threads, results = run_producers(server.url, [load] * n_producers, stop, False)
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        elapsed = time.monotonic() - t0
    shutil.rmtree(data_dir, ignore_errors=True)
    for r in results:
        if r.error is not None:
            raise RuntimeError(f"producer failed during the throughput run: {r.error}")
    return ThroughputResult(
        mode=mode,
        fmt=fmt,
        producers=n_producers,
        events_per_s=sum(r.events for r in results) / elapsed,
        latencies_s=[x for r in results for x in r.latencies_s],
    )


# -- kill -9 ---------------------------------------------------------------------------------


@dataclass
class KillResult:
    mode: str
    timing: str
    acked_events: int
    lost_events: int
    lost_window_ms: float  # kill time - ack time of the oldest lost event; 0 if none lost
    fsync_seen: bool  # `during fsync`: a background fsync was in flight when the kill was sent
    restart_s: float  # restarting from the AOF until the server answered
    aof_mb: float


def wait_for_background_fsync(url: str, timeout_s: float) -> bool:
    """Poll INFO until a background AOF fsync is in flight (everysec only). False on timeout.
    A raw connection and a substring test, so the kill follows the sighting quickly."""
    writer = RespWriter(url, timeout_s=5)
    info = resp_command(b"INFO", b"persistence")
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if b"aof_pending_bio_fsync:0" not in writer.call_many([info])[0]:
                return True
    finally:
        writer.close()
    return False


def _id(entry_id: bytes) -> tuple[int, int]:
    ms, seq = entry_id.split(b"-")
    return int(ms), int(seq)


def kill_once(
    tmp: Path, mode: str, timing: str, loads: Sequence[Sequence[Pipeline]], rng: random.Random
) -> KillResult:
    data_dir = tmp / f"kill-{mode}-{timing}"
    shutil.rmtree(data_dir, ignore_errors=True)
    server = EmbeddedRedis(data_dir, appendfsync=mode).start()
    assert server.proc is not None
    stop = threading.Event()
    threads, results = run_producers(server.url, loads, stop, True)
    time.sleep(rng.uniform(0.5, 1.5))
    fsync_seen = timing == "during fsync" and wait_for_background_fsync(server.url, 3.0)
    os.kill(server.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()  # after: replies already on their way still count as acks
    server.proc.wait(timeout=10)
    for t in threads:
        t.join(timeout=60)
    stop.set()
    server.stop()  # the process is gone; this only removes its port file
    aof = data_dir / "appendonly.aof"
    aof_mb = aof.stat().st_size / 1e6 if aof.exists() else 0.0
    t_restart = time.monotonic()
    with EmbeddedRedis(data_dir, appendfsync=mode) as again:
        restart_s = time.monotonic() - t_restart
        acked = lost = 0
        oldest_lost: float | None = None
        with redis.Redis.from_url(again.url, socket_timeout=30) as c:
            keys = {k for r in results for _, entries in r.pipelines for k, _, _ in entries}
            last = {}
            for k in keys:
                top = c.xrevrange(k, "+", "-", count=1)
                last[k] = _id(top[0][0]) if top else (-1, -1)
            kept_entries = dict.fromkeys(keys, 0)
            for r in results:
                for at, entries in r.pipelines:
                    for k, eid, n in entries:
                        acked += n
                        if _id(eid) > last[k]:
                            lost += n
                            oldest_lost = at if oldest_lost is None else min(oldest_lost, at)
                        else:
                            kept_entries[k] += 1
            # The AOF is replayed in order, so a loss is a suffix: no acknowledged entry up to
            # a stream's last stored one may be missing.
            for k in keys:
                if c.xlen(k) < kept_entries[k]:
                    raise RuntimeError(f"{k!r}: acknowledged entries missing before its last one")
    shutil.rmtree(data_dir, ignore_errors=True)
    return KillResult(
        mode=mode,
        timing=timing,
        acked_events=acked,
        lost_events=lost,
        lost_window_ms=max(0.0, killed_at - oldest_lost) * 1000 if oldest_lost is not None else 0.0,
        fsync_seen=fsync_seen,
        restart_s=restart_s,
        aof_mb=aof_mb,
    )


# -- report ----------------------------------------------------------------------------------


@dataclass
class RunInfo:
    command: str
    started: str
    load_start: float | None
    load_end: float | None = None
    duration_s: float = 0.0


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def display_path(p: str) -> str:
    try:
        return str(Path(os.path.abspath(p)).relative_to(ROOT))
    except ValueError:
        return p


def redis_version() -> str:
    with tempfile.TemporaryDirectory() as d, EmbeddedRedis(Path(d)) as s:
        info: dict[str, Any] = redis.Redis.from_url(s.url).info("server")
        return str(info.get("redis_version", "?"))


def disk_note(path: Path) -> str:
    """The filesystem and device the AOFs were on."""
    best = ("?", "?")
    with contextlib.suppress(OSError):
        target = str(path.resolve())
        mounts = [ln.split() for ln in Path("/proc/mounts").read_text().splitlines()]
        for dev, mnt, fstype, *_ in mounts:
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                best[0]
            ):
                best = (mnt, f"{fstype} on {dev}")
    return best[1]


def render(
    plan: Plan, run: RunInfo, tput: dict[tuple[str, str, int], ThroughputCase],
    kills: Sequence[KillResult],
    version: str, disk: str, sizes: dict[str, float],
) -> str:  # fmt: skip
    mode = "quick smoke mode" if plan.quick else "full mode"
    lines = [
        f"Command: `{run.command}` (from the repository root), {mode}; took"
        f" {run.duration_s / 60:.1f} min.",
        "",
        f"Date: {run.started}. Machine: {machine_note(run.load_start, run.load_end)}. Redis:"
        f' embedded redis-server {version}, AOF on {disk} (`appendonly yes`, `save ""`), a'
        " fresh data dir per measurement. Throughput is the median of interleaved runs, each"
        " kill a single run; the disk is shared too, so fsync times vary from run to run."
        " Treat the numbers as indicative.",
        "",
        "### What acknowledged writes cost",
        "",
        "Each producer connection sends a pipeline of pre-encoded XADDs, like the Producer SDK's"
        f" `flush` (about {PIPELINE_EVENTS:,} events: {PIPELINE_EVENTS:,} entries in `fields`,"
        " 4 entries of 500 events in `jsonl`, over 2 shards), and waits for all its replies"
        f" before the next; {plan.reps} run(s) of {plan.throughput_s:.0f} s per case, the"
        " cases interleaved. Events/s = events whose pipeline was acknowledged, per second:"
        " the median run, and the range; latency = send to last reply of a pipeline, over all"
        f" runs. A `fields` pipeline is about {sizes['fields'] / 1000:.0f} KB of small"
        " commands, which Redis 6.2 reads 16 KB per event-loop turn (so under `always` about"
        f" {sizes['fields'] / 16384:.0f} fsyncs per pipeline); a `jsonl` one is 4 commands of"
        f" about {sizes['jsonl'] / 4000:.0f} KB, whose large arguments are read in larger"
        " pieces.",
        "",
        "| format | producers | everysec events/s | always events/s | always / everysec"
        " | everysec p50 / p99 ms | always p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fmt in FORMATS:
        for n in plan.producers:
            e, a = tput.get(("everysec", fmt, n)), tput.get(("always", fmt, n))
            if e is None or a is None:
                continue
            lines.append(
                f"| `{fmt}` | {n} | {e.median:,.0f}{e.spread} | {a.median:,.0f}{a.spread} |"
                f" {a.median / e.median:.2f} |"
                f" {e.latency_ms(0.5):.1f} / {e.latency_ms(0.99):.1f} |"
                f" {a.latency_ms(0.5):.1f} / {a.latency_ms(0.99):.1f} |"
            )
    lines += [
        "",
        "### What `kill -9` loses",
        "",
        "Two producers (one per format, pipelines as above) load the server; SIGKILL at a"
        " random time 0.5–1.5 s in (`random`) or, for everysec, as soon as INFO then shows a"
        " background AOF fsync in flight (`during fsync`: Redis postpones writing its AOF"
        " buffer while that fsync runs but still replies, so this is everysec's worst moment);"
        " then a restart from the AOF. Lost = acknowledged events missing after the restart;"
        " window = how long before the kill the oldest lost event was acknowledged.",
        "",
        "| appendfsync | kill | kills | acked events per kill (median) | lost events median"
        " / max | lost window ms median / max | restart from AOF s (median, AOF MB) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in MODES:
        for timing in ("random", "during fsync"):
            ks = [k for k in kills if k.mode == m and k.timing == timing]
            if not ks:
                continue
            seen = sum(k.fsync_seen for k in ks)
            note = f" ({seen} of {len(ks)} caught one)" if timing == "during fsync" else ""
            lost = [k.lost_events for k in ks]
            win = [k.lost_window_ms for k in ks]
            lines.append(
                f"| {m} | {timing}{note} | {len(ks)} |"
                f" {statistics.median(k.acked_events for k in ks):,.0f} |"
                f" {statistics.median(lost):,.0f} / {max(lost):,} |"
                f" {statistics.median(win):,.1f} / {max(win):,.1f} |"
                f" {statistics.median(k.restart_s for k in ks):.2f}"
                f" ({statistics.median(k.aof_mb for k in ks):,.0f}) |"
            )
    lines += [
        "",
        "`always` has no background fsync to aim at: it fsyncs in the main thread before"
        " replying, so only random kills apply. `kill -9` stops the process, not the machine:"
        " what Redis had written to the AOF is in the kernel's page cache and survives it."
        " A power cut or kernel crash can also lose what was written but not yet fsynced, up"
        " to about 1 s more under everysec; this benchmark cannot cut the power.",
    ]
    return "\n".join(lines)


def print_summary(
    tput: dict[tuple[str, str, int], ThroughputCase], kills: Sequence[KillResult]
) -> None:
    print("Sluice durability benchmark (events/s: median run)")
    for (m, fmt, n), c in tput.items():
        print(f"{m:<9} {fmt:<7} producers={n}  {c.median:>11,.0f} ev/s"
              f"  p50 {c.latency_ms(0.5):6.1f} ms  p99 {c.latency_ms(0.99):6.1f} ms")  # fmt: skip
    for k in kills:
        print(f"{k.mode:<9} kill {k.timing:<13} acked {k.acked_events:>9,}"
              f"  lost {k.lost_events:>7,}  window {k.lost_window_ms:7.1f} ms")  # fmt: skip
    bad = [k for k in kills if k.mode == "always" and k.lost_events]
    if bad:
        print(f"WARNING: appendfsync always lost acknowledged events in {len(bad)} kills")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="under a minute, fewer and shorter runs")
    p.add_argument("--kills", type=int, default=None, help="kills per case (default 5, quick 2)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--md", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "durability.md")
    p.add_argument("--tmp", type=Path, default=None,
                   help="where the AOFs go (default: a new temporary dir)")  # fmt: skip
    args = p.parse_args(argv)
    if args.kills is not None and args.kills < 1:
        p.error(f"--kills must be at least 1, got {args.kills}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args.quick, args.kills, args.seed)
    run = RunInfo(
        command=shlex.join(
            [display_path(sys.executable), display_path(sys.argv[0]), *sys.argv[1:]]
        ),
        started=dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        load_start=load_average(),
    )
    find_server_binary()  # fail early with the install hint
    t0 = time.monotonic()
    rng = random.Random(plan.seed)
    log(f"building {POOL_EVENTS:,}-event pools per format")
    loads = {fmt: pipelines(fmt, plan.seed) for fmt in FORMATS}
    tput: dict[tuple[str, str, int], ThroughputCase] = {}
    kills: list[KillResult] = []
    with tempfile.TemporaryDirectory(prefix="sluice-durability-", dir=args.tmp) as tmp_s:
        tmp = Path(tmp_s)
        disk = disk_note(tmp)
        for rep in range(plan.reps):  # interleaved, so machine noise spreads over all cases
            for fmt in FORMATS:
                for n in plan.producers:
                    for m in MODES:
                        res = measure_throughput(tmp, m, fmt, n, loads[fmt], plan.throughput_s)
                        log(f"throughput {rep + 1}/{plan.reps} {m} {fmt} x{n}:"
                            f" {res.events_per_s:,.0f} events/s")  # fmt: skip
                        tput.setdefault((m, fmt, n), ThroughputCase([])).runs.append(res)
        cases = [("everysec", "random"), ("everysec", "during fsync"), ("always", "random")]
        for i in range(plan.kills):
            for m, timing in cases:  # interleaved, so machine noise spreads over all cases
                k = kill_once(tmp, m, timing, [loads["fields"], loads["jsonl"]], rng)
                missed = timing == "during fsync" and not k.fsync_seen
                log(f"kill {i + 1}/{plan.kills} {m} {timing}: lost {k.lost_events:,} of"
                    f" {k.acked_events:,} acked, window {k.lost_window_ms:.1f} ms"
                    f"{' (no fsync seen)' if missed else ''}")  # fmt: skip
                kills.append(k)
    version = redis_version()
    run.load_end = load_average()
    run.duration_s = time.monotonic() - t0
    sizes = {  # median bytes per pipeline
        fmt: statistics.median(sum(len(c) for c in p.commands) for p in load)
        for fmt, load in loads.items()
    }
    body = render(plan, run, tput, kills, version, disk, sizes)
    replace_section(args.md, HEADING, body)
    replace_section(args.doc, DOC_HEADING, body)
    log(f"wrote {display_path(str(args.md))} and {display_path(str(args.doc))}"
        f" in {run.duration_s:.0f} s")  # fmt: skip
    print_summary(tput, kills)
    return 0


if __name__ == "__main__":
    sys.exit(main())
