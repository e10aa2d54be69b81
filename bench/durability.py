"""Durability: what `appendfsync everysec` (`durability: default`) and `always` (`strict`) cost a
producer, and what a `kill -9` of Redis loses under each.

    .venv/bin/python bench/durability.py            # full run, about 4 minutes
    .venv/bin/python bench/durability.py --quick    # smoke run, under a minute

Pipelined XADDs as the Producer SDK sends them, on a fresh Redis per measurement; then SIGKILLs
under load, a restart from the AOF, and the acknowledged events that are gone.
bench/templates/durability.md says what each number means. Writes bench/results/durability.json.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from lib.load import RespWriter, bench_config, build_pool, now_ms, resp_command
from lib.results import Run, log, parser
from lib.stats import percentile
from sluice.redis.embedded import EmbeddedRedis, find_server_binary

MODES, FORMATS = ("everysec", "always"), ("fields", "jsonl")
KILL_CASES = (("everysec", "random"), ("everysec", "during fsync"), ("always", "random"))
PIPELINE_EVENTS = 2000  # the Producer flushes a shard's buffer at 4 x batch_events (500)
POOL_EVENTS = 200_000
Pipeline = list[tuple[bytes, bytes, int]]  # (XADD command, its stream key, its events)


def pipelines(fmt: str, seed: int) -> list[Pipeline]:
    """POOL_EVENTS events of stream `ev-<fmt>` (2 shards), in pipelines of PIPELINE_EVENTS."""
    cfg = bench_config(fmt, Path("."), PIPELINE_EVENTS, stream=f"ev-{fmt}")
    pool = build_pool(cfg, POOL_EVENTS, seed, now_ms())
    out: list[Pipeline] = [[]]
    for cmd, n in zip(pool.commands, pool.events, strict=True):
        parts = cmd.split(b"\r\n", 4)  # `*N`, `$4`, `XADD`, `$L`, key...
        out[-1].append((cmd, parts[4][: int(parts[3][1:])], n))
        if sum(x[2] for x in out[-1]) >= PIPELINE_EVENTS:
            out.append([])
    return out[:-1]


class Producer(threading.Thread):
    """Sends `load` (cycling, from index `start`) one pipeline at a time, each after the last's
    replies, until `stop` is set or the server goes away. Keeps the events acknowledged, each
    pipeline's latency and, with `keep_ids`, (ack time, [(key, entry id, events)]) per one."""

    def __init__(self, url: str, load: Sequence[Pipeline], stop: threading.Event, start: int,
                 keep_ids: bool) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.url, self.load, self.halt, self.i, self.keep_ids = url, load, stop, start, keep_ids
        self.events = 0
        self.latencies_s: list[float] = []
        self.acked: list[tuple[float, list[tuple[bytes, bytes, int]]]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            writer = RespWriter(self.url, timeout_s=30)
            try:
                while not self.halt.is_set():
                    p, t_send = self.load[self.i % len(self.load)], time.monotonic()
                    ids = writer.call_many([c for c, _, _ in p])
                    now, self.i = time.monotonic(), self.i + 1
                    self.events += sum(n for _, _, n in p)
                    self.latencies_s.append(now - t_send)
                    if self.keep_ids:
                        self.acked.append(
                            (now, [(k, e, n) for (_, k, n), e in zip(p, ids, strict=True)])
                        )
            finally:
                writer.close()
        except (OSError, RuntimeError) as e:  # ConnectionError is an OSError
            self.error = e


def producers(url: str, loads: Sequence[Sequence[Pipeline]], keep_ids: bool
              ) -> tuple[threading.Event, list[Producer]]:  # fmt: skip
    stop = threading.Event()
    started = [Producer(url, load, stop, k * 997, keep_ids) for k, load in enumerate(loads)]
    for t in started:
        t.start()
    return stop, started


def throughput(tmp: Path, mode: str, load: Sequence[Pipeline], n: int, seconds: float
               ) -> tuple[float, list[float]]:  # fmt: skip
    """(events/s acknowledged, per-pipeline latencies in s) of `n` producer connections."""
    with EmbeddedRedis(tmp / f"tp-{mode}", appendfsync=mode) as server:
        t0 = time.monotonic()
        stop, results = producers(server.url, [load] * n, False)
        time.sleep(seconds)
        stop.set()
        for t in results:
            t.join(timeout=60)
        elapsed = time.monotonic() - t0
    shutil.rmtree(tmp / f"tp-{mode}", ignore_errors=True)
    if errors := [r.error for r in results if r.error is not None]:
        raise RuntimeError(f"a producer failed during the throughput run: {errors[0]}")
    return sum(r.events for r in results) / elapsed, [x for r in results for x in r.latencies_s]


def background_fsync(url: str, timeout_s: float) -> bool:
    """Poll INFO until a background AOF fsync is in flight (everysec only); False on timeout. A
    raw connection and a substring test, so the kill follows the sighting quickly."""
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


def kill_once(tmp: Path, mode: str, timing: str, loads: Sequence[Sequence[Pipeline]],
              rng: random.Random) -> dict[str, Any]:  # fmt: skip
    """Load a fresh server, SIGKILL it, restart it from its AOF and count what is gone."""
    data_dir = tmp / f"kill-{mode}"
    shutil.rmtree(data_dir, ignore_errors=True)
    server = EmbeddedRedis(data_dir, appendfsync=mode).start()
    assert server.proc is not None
    stop, results = producers(server.url, loads, True)
    time.sleep(rng.uniform(0.5, 1.5))
    fsync_seen = timing == "during fsync" and background_fsync(server.url, 3.0)
    os.kill(server.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()  # after: replies already on their way still count as acks
    server.proc.wait(timeout=10)
    for t in results:
        t.join(timeout=60)
    stop.set()
    server.stop()  # the process is gone; this only removes its port file
    aof = data_dir / "appendonly.aof"
    aof_mb = aof.stat().st_size / 1e6 if aof.exists() else 0.0
    t_restart = time.monotonic()
    with EmbeddedRedis(data_dir, appendfsync=mode) as again:
        restart_s = time.monotonic() - t_restart
        with redis.Redis.from_url(again.url, socket_timeout=30) as c:
            acked, lost, oldest = count_lost(c, results)
    shutil.rmtree(data_dir, ignore_errors=True)
    return {"mode": mode, "timing": timing, "acked": acked, "lost": lost, "fsync_seen": fsync_seen,
            "window_ms": max(0.0, killed_at - oldest) * 1000 if oldest is not None else 0.0,
            "restart_s": restart_s, "aof_mb": aof_mb}  # fmt: skip


def count_lost(c: Any, results: Sequence[Producer]) -> tuple[int, int, float | None]:
    """(acked events, lost events, ack time of the oldest lost one) after the restart. The AOF
    is replayed in order, so a loss is a suffix of each stream: raises RuntimeError if an
    acknowledged entry before a stream's last stored one is missing."""

    def entry_id(raw: bytes) -> tuple[int, int]:
        ms, seq = raw.split(b"-")
        return int(ms), int(seq)

    keys = {k for r in results for _, entries in r.acked for k, _, _ in entries}
    last = {k: entry_id(top[0][0]) if (top := c.xrevrange(k, "+", "-", count=1)) else (-1, -1)
            for k in keys}  # fmt: skip
    kept = dict.fromkeys(keys, 0)
    acked = lost = 0
    oldest: float | None = None
    for at, entries in (x for r in results for x in r.acked):
        for k, eid, n in entries:
            acked += n
            if entry_id(eid) > last[k]:
                lost += n
                oldest = at if oldest is None else min(oldest, at)
            else:
                kept[k] += 1
    if any(c.xlen(k) < kept[k] for k in keys):
        raise RuntimeError("acknowledged entries are missing before a stream's last one")
    return acked, lost, oldest


def disk_note(path: Path) -> str:
    """The filesystem and device `path` is on."""
    best = ("", "?")
    with contextlib.suppress(OSError):
        target = str(path.resolve())
        for dev, mnt, fstype, *_ in (
            x.split() for x in Path("/proc/mounts").read_text().splitlines()
        ):
            inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[0]):
                best = (mnt, f"{fstype} on {dev}")
    return best[1]


def summarize(tput: dict[tuple[str, str, int], list[tuple[float, list[float]]]],
              kills: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """Per (format, producers) the median and range of each mode's runs and the latencies over
    all of them; per kill case the medians and maxima."""

    def case(runs: list[tuple[float, list[float]]]) -> dict[str, Any]:
        rates, lat = [r for r, _ in runs], [x * 1000 for _, xs in runs for x in xs]
        return {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
                "p50_ms": percentile(lat, 0.5), "p99_ms": percentile(lat, 0.99)}  # fmt: skip

    rows = []
    for fmt, n in sorted({(f, n) for _, f, n in tput}, key=lambda x: (FORMATS.index(x[0]), x[1])):
        e, a = case(tput[("everysec", fmt, n)]), case(tput[("always", fmt, n)])
        rows.append({"format": fmt, "producers": n, "reps": len(tput[("always", fmt, n)]),
                     "everysec": e, "always": a,
                     "always_vs_everysec": a["median"] / e["median"]})  # fmt: skip
    cases = []
    for mode, timing in KILL_CASES:
        ks = [k for k in kills if (k["mode"], k["timing"]) == (mode, timing)]
        keys = ("acked", "lost", "window_ms", "restart_s", "aof_mb")
        cases.append({"mode": mode, "timing": timing, "kills": len(ks),
                      "median": {x: statistics.median(k[x] for k in ks) for x in keys},
                      "fsync_seen": sum(k["fsync_seen"] for k in ks),
                      "lost_max": max(k["lost"] for k in ks),
                      "window_max_ms": max(k["window_ms"] for k in ks)})  # fmt: skip
    return {"throughput": rows, "kills": cases}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--kills", type=int, help="kills per case (default 5, quick 2)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--tmp", type=Path, help="where the AOFs go (default: a temporary dir)")
    a = p.parse_args()
    if a.kills is not None and a.kills < 1:
        p.error(f"--kills must be at least 1, got {a.kills}")
    seconds, reps, counts = (2.0, 1, (1,)) if a.quick else (5.0, 3, (1, 4))
    n_kills = a.kills or (2 if a.quick else 5)
    find_server_binary()  # fail early with the install hint
    run, rng = Run("durability", a), random.Random(a.seed)
    loads = {fmt: pipelines(fmt, a.seed) for fmt in FORMATS}
    tput: dict[tuple[str, str, int], list[tuple[float, list[float]]]] = {}
    kills: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-durability-", dir=a.tmp) as tmp_s:
        tmp = Path(tmp_s)
        for rep in range(reps):  # interleaved, so machine noise spreads over all cases
            for fmt, n, mode in ((f, n, m) for f in FORMATS for n in counts for m in MODES):
                runs = tput.setdefault((mode, fmt, n), [])
                runs.append(throughput(tmp, mode, loads[fmt], n, seconds))
                log(f"throughput {rep + 1}/{reps} {mode} {fmt} x{n}: {runs[-1][0]:,.0f} events/s")
        for i in range(n_kills):
            for mode, timing in KILL_CASES:  # interleaved, as above
                kills.append(kill_once(tmp, mode, timing, [loads["fields"], loads["jsonl"]], rng))
                log(f"kill {i + 1}/{n_kills} {mode} {timing}: {kills[-1]}")
        with EmbeddedRedis(tmp / "version") as s:
            version = redis.Redis.from_url(s.url).info("server").get("redis_version", "?")
        disk = disk_note(tmp)
    size = {f: statistics.median(sum(len(c) for c, _, _ in p) for p in loads[f]) for f in FORMATS}
    params = {"throughput_s": seconds, "reps": reps, "pipeline_events": PIPELINE_EVENTS,
              "redis_version": version, "disk": disk, "fields_pipeline_kb": size["fields"] / 1000,
              "fields_fsyncs_per_pipeline": size["fields"] / 16384,  # Redis reads 16 KB a turn
              "jsonl_command_kb": size["jsonl"] / 4000}  # fmt: skip
    run.write(params, summarize(tput, kills))


if __name__ == "__main__":
    main()
