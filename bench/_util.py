"""Helpers for bench/throughput.py: config, pre-encoded load, a paced producer, statistics, docs.

Load is pre-generated once per phase with `sluice.source.loadgen.EventGenerator` (Zipf keys,
seeded) and pre-encoded as raw RESP `XADD` commands, sharded like `sluice.source.producer`
(crc32 of `card`). Sending is then a socket write plus reading the replies with hiredis, so the
producer costs almost no CPU on the 2-core machine and the numbers measure Sluice, not the
benchmark's own Python.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import hiredis
import orjson
import pandas as pd

from sluice.config import Config, config_from_dict
from sluice.source.loadgen import EventGenerator
from sluice.source.producer import shard_of

SCHEMA = {"ts": "long", "card": "string", "merchant": "string", "amount": "double"}
METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1h"},
    {"name": "amount_sum", "key": ["merchant"], "agg": "sum", "value": "amount",
     "slice": "10s", "retention": "1h"},
    {"name": "card_max", "key": ["card"], "agg": "max", "value": "amount",
     "slice": "10s", "retention": "1h"},
]  # fmt: skip
SHARDS = 2
SHARD_BY = "card"
JSONL_EVENTS_PER_ENTRY = 500  # the Producer's default `batch_events`
SEND_CHUNK_COMMANDS = 1000
TICK_S = 0.05

T = TypeVar("T")


def log(msg: str) -> None:
    """A progress line on stderr, stamped with the wall clock."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def bench_config(fmt: str, state_dir: Path, max_events_per_batch: int) -> Config:
    """The benchmark's config: 3 metrics, 2 shards, 10 s slices, 1 h retention, default Spark."""
    return config_from_dict(bench_config_data(fmt, state_dir, max_events_per_batch))


def bench_config_data(fmt: str, state_dir: Path, max_events_per_batch: int) -> dict[str, Any]:
    """`bench_config` as the plain data of a sluice.yaml."""
    return {
        "state_dir": str(state_dir),
        "source": {
            "stream": "events",
            "shards": SHARDS,
            "format": fmt,
            "schema": SCHEMA,
            "time_field": "ts",
            "max_events_per_batch": max_events_per_batch,
        },
        "metrics": METRICS,
    }


# -- load: pre-encoded XADD commands ------------------------------------------------------------


def resp_command(*args: bytes) -> bytes:
    """One command in the Redis wire protocol (RESP2 array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(parts)


@dataclass(frozen=True)
class LoadPool:
    """Pre-encoded XADD commands, shards interleaved; `events[i]` is command i's event count."""

    commands: list[bytes]
    events: list[int]
    shard_events: tuple[int, ...]  # events per shard

    @property
    def total_events(self) -> int:
        return sum(self.events)

    def events_per_entry(self) -> float:
        return self.total_events / len(self.commands)


def _shard_column(values: Sequence[Any]) -> list[int]:
    cache: dict[Any, int] = {}
    return [cache.setdefault(v, shard_of(v, SHARDS)) for v in values]


def _interleave(per_shard: list[list[T]]) -> list[T]:
    """Round-robin over the shards' lists, so every shard gets load at the same pace."""
    out: list[T] = []
    longest = max(len(p) for p in per_shard)
    for i in range(longest):
        out.extend(p[i] for p in per_shard if i < len(p))
    return out


def _fields_value(v: Any) -> bytes:
    """Like `sluice.source.producer`: floats as repr, the rest as text."""
    return repr(v).encode() if isinstance(v, float) else str(v).encode()


def event_frame(cfg: Config, n_events: int, seed: int, now_ms: int) -> pd.DataFrame:
    """`n_events` synthetic events (loadgen's generator: Zipf cards/merchants, 1% late)."""
    return EventGenerator(cfg, seed=seed).frame(n_events, now_ms)


def _entries(cfg: Config, df: pd.DataFrame) -> tuple[list[int], list[list[bytes]], list[int]]:
    """Stream entries for `df` as (shard, [field, value, ...], events), shards interleaved.

    jsonl: entries of JSONL_EVENTS_PER_ENTRY events (fields `d`, `n`) like the Producer;
    fields: one entry per event, one entry field per event field.
    """
    shards = _shard_column(df[SHARD_BY].tolist())
    n_shards = cfg.source.shards
    per: list[list[tuple[int, list[bytes], int]]] = [[] for _ in range(n_shards)]
    if cfg.source.format == "jsonl":
        text = df.to_json(orient="records", lines=True)
        lines: list[list[bytes]] = [[] for _ in range(n_shards)]
        for s, ln in zip(shards, (x.encode() for x in text.split("\n") if x), strict=True):
            lines[s].append(ln)
        for s, part in enumerate(lines):
            for j in range(0, len(part), JSONL_EVENTS_PER_ENTRY):
                chunk = part[j : j + JSONL_EVENTS_PER_ENTRY]
                fields = [b"d", b"\n".join(chunk), b"n", str(len(chunk)).encode()]
                per[s].append((s, fields, len(chunk)))
    else:
        bnames = [str(n).encode() for n in df.columns]
        for s, row in zip(shards, df.itertuples(index=False, name=None), strict=True):
            fields = []
            for bn, v in zip(bnames, row, strict=True):
                fields += [bn, _fields_value(v)]
            per[s].append((s, fields, 1))
    merged = _interleave(per)
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


def build_pool(cfg: Config, n_events: int, seed: int, now_ms: int) -> LoadPool:
    """`n_events` synthetic events as pre-encoded XADDs for `cfg.source.format`, sharded by card.

    Event times are `now_ms` (1% up to 5 min late), so a pool is good for well under the 1 h
    retention.
    """
    shards, fields, events = _entries(cfg, event_frame(cfg, n_events, seed, now_ms))
    keys = [k.encode() for k in cfg.source.shard_keys()]
    commands = [
        resp_command(b"XADD", keys[s], b"*", *f) for s, f in zip(shards, fields, strict=True)
    ]
    per_shard = [0] * len(keys)
    for sh, n in zip(shards, events, strict=True):
        per_shard[sh] += n
    return LoadPool(commands, events, tuple(per_shard))


def xrange_entries(cfg: Config, n_events: int, seed: int, now_ms: int) -> list[list[Any]]:
    """The same kind of events as `build_pool`, shaped like a raw XRANGE reply
    (`[[id, [f1, v1, ...]], ...]`, ids at `now_ms`), for `sluice.source.decode.Decoder`."""
    _, fields, _ = _entries(cfg, event_frame(cfg, n_events, seed, now_ms))
    return [[f"{now_ms}-{i}".encode(), f] for i, f in enumerate(fields)]


def probe_fields(cfg: Config, card: str, now_ms: int) -> tuple[str, dict[str, Any]]:
    """(shard key, XADD fields) of one probe event with card `card`, in the source's format."""
    event = {"ts": now_ms, "card": card, "merchant": "probe", "amount": 1.0}
    shard = cfg.source.shard_keys()[shard_of(card, SHARDS)]
    if cfg.source.format == "jsonl":
        return shard, {"d": orjson.dumps(event), "n": 1}
    return shard, {k: _fields_value(v) for k, v in event.items()}


class RespWriter:
    """A raw connection that sends pre-encoded commands and checks every reply (via hiredis).

    Raises RuntimeError on an error reply, ConnectionError if the server goes away.
    """

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or 6379), timeout=timeout_s
        )
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()

    def send(self, commands: Sequence[bytes]) -> None:
        """Send all, in chunks of SEND_CHUNK_COMMANDS, checking (and dropping) the replies."""
        for i in range(0, len(commands), SEND_CHUNK_COMMANDS):
            self.call_many(commands[i : i + SEND_CHUNK_COMMANDS])

    def call_many(self, commands: Sequence[bytes]) -> list[Any]:
        """Send `commands` in one write; return their replies, in order."""
        self.sock.sendall(b"".join(commands))
        replies: list[Any] = []
        while len(replies) < len(commands):
            reply = self.reader.gets()
            if reply is False:
                data = self.sock.recv(1 << 16)
                if not data:
                    raise ConnectionError("redis closed the connection")
                self.reader.feed(data)
            elif isinstance(reply, hiredis.ReplyError):
                raise RuntimeError(f"redis refused a benchmark command: {reply}")
            else:
                replies.append(reply)
        return replies

    def close(self) -> None:
        self.sock.close()


def cycle_commands(pool: LoadPool, n_events: int) -> Iterator[tuple[bytes, int]]:
    """Commands from `pool`, cycling, until `n_events` events (the last entry may overshoot)."""
    sent = 0
    i = 0
    while sent < n_events:
        j = i % len(pool.commands)
        yield pool.commands[j], pool.events[j]
        sent += pool.events[j]
        i += 1


def prefill(url: str, pool: LoadPool, n_events: int) -> int:
    """Write about `n_events` events (cycling the pool) as fast as possible. Returns events."""
    writer = RespWriter(url)
    sent = 0
    buf: list[bytes] = []
    try:
        for cmd, n in cycle_commands(pool, n_events):
            buf.append(cmd)
            sent += n
            if len(buf) >= SEND_CHUNK_COMMANDS:
                writer.send(buf)
                buf = []
        writer.send(buf)
    finally:
        writer.close()
    return sent


class PacedProducer(threading.Thread):
    """Sends the pool's commands (cycling) at `rate_per_s` events/s until `stop()` or
    `duration_s`. Owes events for elapsed real time, so a slow tick is made up (capped at 1 s).

    `sent_events`, `elapsed_s` are readable during and after the run; `error` holds an exception
    that ended the thread early.
    """

    def __init__(self, url: str, pool: LoadPool, rate_per_s: float, duration_s: float) -> None:
        super().__init__(name="bench-producer", daemon=True)
        self.url = url
        self.pool = pool
        self.rate_per_s = rate_per_s
        self.duration_s = duration_s
        self.sent_events = 0
        self.elapsed_s = 0.0
        self.error: BaseException | None = None
        self._stop_evt = threading.Event()

    def stop(self) -> None:
        self._stop_evt.set()

    def achieved_per_s(self) -> float:
        return self.sent_events / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def run(self) -> None:
        try:
            self._run()
        except (OSError, RuntimeError) as e:  # reported by the caller, not swallowed
            self.error = e

    def _run(self) -> None:
        writer = RespWriter(self.url)
        t0 = last = time.monotonic()
        owed = 0.0
        i = 0
        n_cmds = len(self.pool.commands)
        try:
            while not self._stop_evt.is_set():
                now = time.monotonic()
                if now - t0 >= self.duration_s:
                    break
                owed = min(owed + self.rate_per_s * (now - last), self.rate_per_s)
                last = now
                batch: list[bytes] = []
                while owed >= self.pool.events[i % n_cmds]:
                    owed -= self.pool.events[i % n_cmds]
                    self.sent_events += self.pool.events[i % n_cmds]
                    batch.append(self.pool.commands[i % n_cmds])
                    i += 1
                if batch:
                    writer.send(batch)
                self.elapsed_s = time.monotonic() - t0
                self._stop_evt.wait(max(0.0, TICK_S - (time.monotonic() - now)))
        finally:
            self.elapsed_s = time.monotonic() - t0
            writer.close()


# -- statistics ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    vs = sorted(values)
    k = max(0, min(len(vs) - 1, math.ceil(q * len(vs)) - 1))
    return vs[k]


@dataclass
class BatchRate:
    """Throughput over a run of batch records (warm-up batch excluded)."""

    batches: int
    events: int
    wall_s: float  # from the end of the warm-up batch to the end of the last batch
    busy_s: float  # sum of the measured batches' own durations

    @property
    def wall_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def busy_per_s(self) -> float:
        return self.events / self.busy_s if self.busy_s > 0 else 0.0


def batch_rate(records: Sequence[dict[str, Any]]) -> BatchRate | None:
    """Rate of `records` (dicts with batch, events, started_ms, done_ms) without the first.

    wall: events of batches 2..n over the time from batch 1's end to batch n's end, so the gaps
    between batches (planning, offsets, trigger waits) count; busy: over the batches' own time.
    Returns None with fewer than 2 batches.
    """
    rs = sorted(records, key=lambda r: r["batch"])
    if len(rs) < 2:
        return None
    measured = rs[1:]
    return BatchRate(
        batches=len(measured),
        events=sum(r["events"] for r in measured),
        wall_s=(rs[-1]["done_ms"] - rs[0]["done_ms"]) / 1000,
        busy_s=sum(r["done_ms"] - r["started_ms"] for r in measured) / 1000,
    )


@dataclass
class StepVerdict:
    bounded: bool
    reason: str


def judge_step(
    samples: Sequence[tuple[float, int]],
    rate_per_s: float,
    max_lag_s: float,
    batch_events: Sequence[int],
    cap_events: int,
) -> StepVerdict:
    """Did the pipeline keep up with a fixed-rate step? `samples` are (t_s, backlog events)
    over the step, `batch_events` the sizes of the batches admitted in its last two thirds.

    Bounded iff all of: (1) no such batch was filled to the admission cap (95 %): a full batch
    means input was left waiting behind it; (2) the backlog's peak in the last third is at most
    1.2 x its peak in the middle third plus 0.25 s of input (a batch-sized sawtooth is fine, a
    rising trend is not); (3) the final backlog is under `max_lag_s` seconds of input. The first
    third is the transient and is ignored.
    """
    if len(samples) < 6:
        return StepVerdict(False, "too few samples")
    if not batch_events:
        return StepVerdict(False, "no batch started in the last two thirds of the step")
    full = sum(1 for e in batch_events if e >= 0.95 * cap_events)
    if full:
        return StepVerdict(False, f"{full} of {len(batch_events)} batches hit the admission cap")
    n = len(samples)
    mid = [b for _, b in samples[n // 3 : 2 * n // 3]]
    last = [b for _, b in samples[2 * n // 3 :]]
    final_lag_s = samples[-1][1] / rate_per_s
    if final_lag_s > max_lag_s:
        return StepVerdict(False, f"final backlog {final_lag_s:.1f} s of input")
    if max(last) > 1.2 * max(mid) + 0.25 * rate_per_s:
        return StepVerdict(False, f"backlog rising: peak {max(mid):,} -> {max(last):,} events")
    return StepVerdict(
        True, f"peak backlog {max(mid + last):,} events, largest batch {max(batch_events):,}"
    )


@dataclass
class Deadline:
    """A time budget for the whole benchmark."""

    budget_s: float
    t0: float = field(default_factory=time.monotonic)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)


# -- docs -------------------------------------------------------------------------------------


def machine_note(load_start: float | None, load_end: float | None) -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    loads = "n/a" if load_start is None else f"{load_start:.2f} at start, {load_end:.2f} at end"
    return (
        f"{os.cpu_count()} cores{f' ({model})' if model else ''}, {platform.system()}; shared"
        f" with other work, so noisy (1-min load average {loads})"
    )


def replace_section(path: Path, heading: str, body: str) -> None:
    """Write `heading` + `body` into markdown file `path`, replacing only that `## ` section
    (up to the next `## ` heading) if present, appending it otherwise; creates the file with a
    `# Benchmarks` title if missing."""
    section = f"{heading}\n\n{body.strip()}\n"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# Benchmarks\n\n{section}")
        return
    lines = path.read_text().splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    if start is None:
        text = "".join(lines).rstrip("\n")
        path.write_text(f"{text}\n\n{section}")
        return
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    before = "".join(lines[:start])
    after = "".join(lines[end:])
    path.write_text(before + section + ("\n" + after if after else ""))
