"""Load for the benchmarks: the bench config, and `EventGenerator` events (Zipf keys, seeded)
pre-encoded as raw RESP `XADD`s, sharded like `sluice.source.producer`. Sending them is a socket
write plus reading the replies with hiredis, so a producer costs the 2 cores almost nothing and
the numbers measure Sluice, not the benchmark. Kafka entries are (partition, value) records."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import hiredis
import numpy as np
import pandas as pd

from sluice.config import Config, config_from_dict
from sluice.source.loadgen import EventGenerator
from sluice.source.producer import shard_of
from sluice.testing.kafka import FencedProducer

SCHEMA = {"ts": "long", "card": "string", "merchant": "string", "amount": "double"}
METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1h"},
    {"name": "amount_sum", "key": ["merchant"], "agg": "sum", "value": "amount",
     "slice": "10s", "retention": "1h"},
    {"name": "card_max", "key": ["card"], "agg": "max", "value": "amount",
     "slice": "10s", "retention": "1h"},
]  # fmt: skip
# The high-cardinality workload (issue 15): six metrics over three key sets and three slice
# lengths, fed by events with uniform keys over a KeySpace's cards and merchants, stamped
# uniformly over its spread (HIGHCARD's: 100,000 cards, 200 merchants, the last 10 minutes).
HIGHCARD_METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "10s", "retention": "1h"},
    {"name": "card_amount", "key": ["card"], "agg": "sum", "value": "amount", "slice": "1m",
     "retention": "1h"},
    {"name": "merchant_count", "key": ["merchant"], "agg": "count", "slice": "10s",
     "retention": "1h"},
    {"name": "merchant_amount", "key": ["merchant"], "agg": "sum", "value": "amount",
     "slice": "30s", "retention": "1h"},
    {"name": "pair_count", "key": ["card", "merchant"], "agg": "count", "slice": "30s",
     "retention": "1h"},
    {"name": "pair_max", "key": ["card", "merchant"], "agg": "max", "value": "amount",
     "slice": "1m", "retention": "1h"},
]  # fmt: skip


class KeySpace(NamedTuple):
    """Where the high-cardinality workload's events fall: uniform over `cards` cards and
    `merchants` merchants, and over the `spread_ms` before their reference time."""

    cards: int
    merchants: int
    spread_ms: int


HIGHCARD = KeySpace(100_000, 200, 600_000)
WORKLOADS = ("zipf", "highcard")
SHARDS = 2
JSONL_EVENTS_PER_ENTRY = 500  # the Producer's default `batch_events`
# The drain benchmarks' sizes per (quick, format): (source.max_events_per_batch, pool events).
# jsonl's full batch cap is also the config default.
SIZES = {(True, "jsonl"): (100_000, 100_000), (True, "fields"): (20_000, 40_000),
         (False, "jsonl"): (1_000_000, 200_000), (False, "fields"): (200_000, 100_000)}  # fmt: skip
SEND_CHUNK_COMMANDS = 1000
TICK_S = 0.05


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def bench_config_data(fmt: str, state_dir: Path, max_events_per_batch: int,
                      stream: str = "events") -> dict[str, Any]:  # fmt: skip
    """The benchmarks' sluice.yaml: 3 metrics, 2 shards, 10 s slices, 1 h retention, default
    Spark (local[2], 500 ms trigger)."""
    return {
        "state_dir": str(state_dir),
        "source": {
            "stream": stream, "shards": SHARDS, "format": fmt, "schema": SCHEMA,
            "time_field": "ts", "max_events_per_batch": max_events_per_batch,
        },
        "metrics": METRICS,
    }  # fmt: skip


def bench_config(fmt: str, state_dir: Path, max_events_per_batch: int, stream: str = "events",
                 kafka: tuple[str, str] | None = None, **update: Any) -> Config:  # fmt: skip
    """`bench_config_data` validated, reading Kafka (bootstrap, topic) `kafka` if given;
    `update` replaces whole top-level sections."""
    data = bench_config_data(fmt, state_dir, max_events_per_batch, stream)
    if kafka is not None:
        source = {k: v for k, v in data["source"].items() if k != "shards"}
        topic = {"bootstrap": kafka[0], "topic": kafka[1], "group_id": f"sluice-{kafka[1]}"}
        data["source"] = {**source, "kafka": topic}
    return config_from_dict({**data, **update})


def resp_command(*args: bytes) -> bytes:
    """One command in the Redis wire protocol (RESP2 array of bulk strings)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


@dataclass(frozen=True)
class LoadPool:
    """Pre-encoded entries (XADDs, or Kafka records), shards interleaved; `events[i]` is entry
    i's event count."""

    commands: list[Any]
    events: list[int]
    shard_events: tuple[int, ...]

    @property
    def total_events(self) -> int:
        return sum(self.events)

    def events_per_entry(self) -> float:
        return self.total_events / len(self.commands)

    def only(self, key: str) -> LoadPool:
        """The XADDs to stream `key` alone."""
        keep = [i for i, c in enumerate(self.commands) if c.split(b"\r\n")[4] == key.encode()]
        events = [self.events[i] for i in keep]
        return LoadPool([self.commands[i] for i in keep], events, (sum(events),))


def _value(v: Any) -> bytes:
    """Like `sluice.source.producer`: floats as repr, the rest as text."""
    return repr(v).encode() if isinstance(v, float) else str(v).encode()


def shard_count(cfg: Config) -> int:
    """Shards of the bench log: `source.shards` streams, or the Kafka topic's SHARDS partitions."""
    return cfg.source.shards if cfg.source.kafka is None else SHARDS


def _entries(cfg: Config, df: pd.DataFrame) -> list[tuple[int, list[bytes], int]]:
    """Log entries for `df` as (shard, [field, value, ...], events), shards interleaved so
    each gets load at the same pace: jsonl, JSONL_EVENTS_PER_ENTRY events per entry (fields `d`
    and `n`, as the Producer writes), Kafka's json one; fields, one entry per event."""
    n, fmt = shard_count(cfg), cfg.source.format
    cache: dict[Any, int] = {}
    shards = [cache.setdefault(v, shard_of(v, n)) for v in df["card"].tolist()]
    per: list[list[tuple[int, list[bytes], int]]] = [[] for _ in range(n)]
    if fmt in ("jsonl", "json"):
        lines: list[list[bytes]] = [[] for _ in range(n)]
        text = df.to_json(orient="records", lines=True)
        for s, ln in zip(shards, (x.encode() for x in text.split("\n") if x), strict=True):
            lines[s].append(ln)
        step = JSONL_EVENTS_PER_ENTRY if fmt == "jsonl" else 1
        for s, part in enumerate(lines):
            for j in range(0, len(part), step):
                chunk = part[j : j + step]
                per[s].append((s, [b"d", b"\n".join(chunk), b"n", b"%d" % len(chunk)], len(chunk)))
    else:
        names = [str(c).encode() for c in df.columns]
        for s, row in zip(shards, df.itertuples(index=False, name=None), strict=True):
            fields = [x for nv in zip(names, map(_value, row), strict=True) for x in nv]
            per[s].append((s, fields, 1))
    longest = max(len(p) for p in per)
    return [p[i] for i in range(longest) for p in per if i < len(p)]


def _encode(cfg: Config, entries: Sequence[tuple[int, list[bytes], int]]) -> list[Any]:
    """Entries as XADDs, or as Kafka (partition, value) records: the value is field `d`."""
    if cfg.source.kafka is not None:
        return [(s, f[1]) for s, f, _ in entries]
    keys = [k.encode() for k in cfg.source.shard_keys()]
    return [resp_command(b"XADD", keys[s], b"*", *f) for s, f, _ in entries]


def highcard_frame(n_events: int, seed: int, at_ms: int,
                   space: KeySpace = HIGHCARD) -> pd.DataFrame:  # fmt: skip
    """`n_events` events of the high-cardinality workload: cards and merchants uniform over
    `space`'s, times uniform over its spread before `at_ms`, amounts log-normal (columns in
    SCHEMA's order)."""
    rng = np.random.default_rng(seed)
    cards = rng.integers(0, space.cards, n_events)
    merchants = rng.integers(0, space.merchants, n_events)
    return pd.DataFrame({
        "ts": at_ms - rng.integers(0, space.spread_ms, n_events).astype(np.int64),
        "card": [f"card-{i}" for i in cards.tolist()],
        "merchant": [f"merchant-{i}" for i in merchants.tolist()],
        "amount": np.round(rng.lognormal(3.0, 1.0, n_events), 2),
    })  # fmt: skip


def build_pool(cfg: Config, n_events: int, seed: int, at_ms: int, workload: str = "zipf",
               space: KeySpace = HIGHCARD) -> LoadPool:  # fmt: skip
    """`n_events` events (`zipf`: Zipf keys, 1% up to 5 min late, times at `at_ms`; `highcard`:
    `highcard_frame` over `space`) as entries for `cfg`'s log and format, sharded by card: good
    for well under the 1 h retention."""
    if workload == "highcard":
        frame = highcard_frame(n_events, seed, at_ms, space)
    else:
        frame = EventGenerator(cfg, seed=seed).frame(n_events, at_ms)
    entries = _entries(cfg, frame)
    per_shard = [0] * shard_count(cfg)
    for s, _, n in entries:
        per_shard[s] += n
    return LoadPool(_encode(cfg, entries), [n for _, _, n in entries], tuple(per_shard))


def xrange_entries(cfg: Config, n_events: int, seed: int, at_ms: int, workload: str = "zipf",
                   space: KeySpace = HIGHCARD) -> list[list[Any]]:  # fmt: skip
    """The same kind of events as `build_pool` (`highcard` ones over `space`), shaped like a
    raw XRANGE reply (`[[id, [f1, v1, ...]], ...]`, ids at `at_ms`), for
    `sluice.source.decode.Decoder`."""
    if workload == "highcard":
        frame = highcard_frame(n_events, seed, at_ms, space)
    else:
        frame = EventGenerator(cfg, seed=seed).frame(n_events, at_ms)
    entries = _entries(cfg, frame)
    return [[f"{at_ms}-{i}".encode(), f] for i, (_, f, _) in enumerate(entries)]


def probe_command(cfg: Config, card: str, at_ms: int) -> Any:
    """One probe event with card `card`, encoded like `build_pool`'s entries."""
    event = pd.DataFrame([{"ts": at_ms, "card": card, "merchant": "probe", "amount": 1.0}])
    return _encode(cfg, _entries(cfg, event))[0]


def is_busy(e: BaseException | str) -> bool:
    """Redis refused a command because a script has run past `lua-time-limit` (5 s). redis-py
    prefixes a pipeline's error with the command (`Command # 1 (...) of pipeline caused error:`)."""
    msg = str(e)
    return msg.startswith("BUSY ") or "error: BUSY " in msg


class RespWriter:
    """A raw connection that sends pre-encoded commands and reads every reply with hiredis."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        u = urlsplit(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = hiredis.Reader()

    def call_many(self, commands: Sequence[bytes], check: bool = True) -> list[Any]:
        """Send `commands` in one write; their replies in order. An error reply raises
        RuntimeError with `check`, else it is returned (a `hiredis.ReplyError`). Raises
        ConnectionError if the server goes away."""
        self.sock.sendall(b"".join(commands))
        replies: list[Any] = []
        while len(replies) < len(commands):
            reply = self.reader.gets()
            if reply is False:
                data = self.sock.recv(1 << 16)
                if not data:
                    raise ConnectionError("redis closed the connection")
                self.reader.feed(data)
            elif check and isinstance(reply, hiredis.ReplyError):
                raise RuntimeError(f"redis refused a benchmark command: {reply}")
            else:
                replies.append(reply)
        return replies

    def send(self, commands: Sequence[bytes]) -> None:
        """Send all, in chunks of SEND_CHUNK_COMMANDS, checking and dropping the replies."""
        for i in range(0, len(commands), SEND_CHUNK_COMMANDS):
            self.call_many(commands[i : i + SEND_CHUNK_COMMANDS])

    def close(self) -> None:
        self.sock.close()


class KafkaWriter(FencedProducer):
    """Records to a test broker's topic (exact end offsets), with `RespWriter`'s interface."""

    def call_many(self, commands: Sequence[tuple[int, bytes]], check: bool = True) -> list[None]:
        self.send(commands)
        return [None] * len(commands)


def open_writer(target: Any, timeout_s: float = 60.0) -> Any:
    """A writer of entries: a `RespWriter` on a Redis URL, a `KafkaWriter` on (bootstrap, topic)."""
    return RespWriter(target, timeout_s) if isinstance(target, str) else KafkaWriter(*target)


def prefill(target: Any, pool: LoadPool, n_events: int) -> int:
    """Write about `n_events` events (cycling the pool; the last entry may overshoot) as fast as
    possible to `target` (see `open_writer`). Returns the events written."""
    commands, sent = [], 0
    while sent < n_events:
        i = len(commands) % len(pool.commands)
        commands.append(pool.commands[i])
        sent += pool.events[i]
    writer = open_writer(target)
    try:
        writer.send(commands)
    finally:
        writer.close()
    return sent


class PacedProducer(threading.Thread):
    """Sends the pool's entries (cycling) to `url` (see `open_writer`) at `rate_per_s` events/s
    until `stop()` or `duration_s`, owing events for elapsed time (a slow tick is made up, up to
    1 s). With `retry_busy` a command refused with BUSY (a script past `lua-time-limit`) is sent
    again on the next tick, until the retries are through. `sent_events` counts acknowledged
    events; `error` holds the exception that ended the thread."""

    def __init__(self, url: Any, pool: LoadPool, rate_per_s: float,
                 duration_s: float = float("inf"), retry_busy: bool = False) -> None:  # fmt: skip
        super().__init__(name="bench-producer", daemon=True)
        self.url, self.pool, self.rate_per_s = url, pool, rate_per_s
        self.duration_s, self.retry_busy = duration_s, retry_busy
        self.sent_events, self.busy_replies, self.elapsed_s = 0, 0, 0.0
        self.error: BaseException | None = None
        self._stop_evt = threading.Event()

    def stop(self) -> None:
        self._stop_evt.set()

    def achieved_per_s(self) -> float:
        return self.sent_events / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def run(self) -> None:
        writer = open_writer(self.url, timeout_s=120)
        t0 = last = time.monotonic()
        owed, i, cmds, events = 0.0, 0, self.pool.commands, self.pool.events
        retry: list[tuple[bytes, int]] = []
        try:
            while (
                not self._stop_evt.is_set() or retry
            ) and time.monotonic() - t0 < self.duration_s:
                now = time.monotonic()
                batch, retry = retry, []
                if not self._stop_evt.is_set():
                    owed = min(owed + self.rate_per_s * (now - last), self.rate_per_s)
                    while owed >= events[i % len(cmds)]:
                        owed -= events[i % len(cmds)]
                        batch.append((cmds[i % len(cmds)], events[i % len(cmds)]))
                        i += 1
                last = now
                if batch:
                    replies = writer.call_many([c for c, _ in batch], check=not self.retry_busy)
                    for (cmd, n), reply in zip(batch, replies, strict=True):
                        if not isinstance(reply, hiredis.ReplyError):
                            self.sent_events += n
                        elif is_busy(str(reply)):
                            self.busy_replies += 1
                            retry.append((cmd, n))
                        else:
                            raise RuntimeError(f"redis refused a benchmark command: {reply}")
                self.elapsed_s = time.monotonic() - t0
                pause = max(0.0, TICK_S - (time.monotonic() - now))
                if retry:  # stop() must not cut short the wait before a retry
                    time.sleep(pause)
                else:
                    self._stop_evt.wait(pause)
        except (OSError, RuntimeError) as e:  # reported by the caller, not swallowed
            self.error = e
        finally:
            self.elapsed_s = time.monotonic() - t0
            writer.close()
