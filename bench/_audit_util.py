"""Helpers for bench/audit.py: the audit's memory (ledger in Redis, `source_xor` in the driver)
and a `sluice run` child process that can be SIGKILLed and restarted while Redis is sampled.

Memory is read the way an operator would: `MEMORY USAGE <key> SAMPLES 0` (every element, not
Redis's 5-element estimate) for the ledger hashes and the failures list, and `tracemalloc` (which
sees numpy's buffers) for one direct call of `sluice.pipeline.audit.source_xor` against a real
stream.
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import hiredis
import orjson
import redis

from _util import TICK_S, LoadPool, PacedProducer, RespWriter, prefill
from sluice.config import Config
from sluice.pipeline.audit import LEDGER_KEEP, SOURCE_CHUNK, AuditResult, Ledger, source_xor
from sluice.pipeline.status import backlog
from sluice.redis.connection import client_for
from sluice.redis.keys import HEALTH_KEY, STATS_KEY
from sluice.redis.scripts import AUDIT_SOURCE, script_source
from sluice.source.ids import ZERO_ID

SLUICE = [sys.executable, "-m", "sluice.cli"]  # as tests/e2e/test_processes.py starts it
T = TypeVar("T")


def is_busy(e: BaseException) -> bool:
    """Redis refused a command because a script has run past `lua-time-limit` (5 s). redis-py
    prefixes a pipeline's error with the command (`Command # 1 (...) of pipeline caused error:`)."""
    msg = str(e)
    return msg.startswith("BUSY ") or "error: BUSY " in msg


def busy_tolerant(call: Callable[[], T], pause_s: float = 0.2) -> T:
    """`call()`, again and again while Redis answers BUSY (only a long script makes it)."""
    while True:
        try:
            return call()
        except redis.exceptions.ResponseError as e:
            if not is_busy(e):
                raise
            time.sleep(pause_s)


# -- ledger memory ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LedgerMemory:
    keys: int  # ledger hashes present
    records: int  # batch records in them (HLEN summed)
    ledger_bytes: int  # MEMORY USAGE SAMPLES 0, summed over the hashes
    failures: int  # entries of the failures list
    failures_bytes: int  # its MEMORY USAGE (0 when the list does not exist)
    record_json_bytes: float  # mean length of one stored record (the JSON value)

    @property
    def bytes_per_record(self) -> float | None:
        return self.ledger_bytes / self.records if self.records else None


def ledger_memory(client: Any, stream: str, shards: int) -> LedgerMemory:
    """The ledger's footprint in Redis right now (all `audit.ledger_shards` hashes)."""
    ledger = Ledger(client, stream, shards)
    keys = [ledger.key(n) for n in range(shards)]
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hlen(k)
        pipe.execute_command("MEMORY", "USAGE", k, "SAMPLES", 0)
        pipe.hvals(k)
    pipe.llen(ledger.failures_key)
    pipe.execute_command("MEMORY", "USAGE", ledger.failures_key, "SAMPLES", 0)
    res = pipe.execute()
    lens = [int(x) for x in res[0 : 3 * shards : 3]]
    values = [v for vs in res[2 : 3 * shards : 3] for v in vs]
    return LedgerMemory(
        keys=sum(1 for n in lens if n),
        records=sum(lens),
        ledger_bytes=sum(int(x or 0) for x in res[1 : 3 * shards : 3]),
        failures=int(res[-2]),
        failures_bytes=int(res[-1] or 0),
        record_json_bytes=sum(len(v) for v in values) / len(values) if values else 0.0,
    )


def fill_ledger(
    client: Any, stream: str, shards: int, batches: int, events_per_batch: int, seed: int
) -> LedgerMemory:
    """Record `batches` balanced audit results through the real `Ledger.record` (random 64-bit
    XORs, so the JSON is as long as a real one's) and measure the ledger. Past
    `shards * LEDGER_KEEP` batches the ledger must stop growing: that is its bound."""
    rng = random.Random(seed)
    ledger = Ledger(client, stream, shards)
    for b in range(batches):
        x, fan = rng.getrandbits(64), rng.getrandbits(64)
        ledger.record(
            AuditResult(
                batch=b, attempt=1, source_x=x, fan_x=fan, applied_x=x ^ fan,
                events=events_per_batch, entries=max(1, events_per_batch // 500),
                audit_ms=round(rng.uniform(50, 500), 1),
            )
        )  # fmt: skip
    return ledger_memory(client, stream, shards)


def ledger_cap(shards: int) -> int:
    """Records the ledger keeps at most (the older ones are deleted as new ones come)."""
    return shards * LEDGER_KEEP


# -- the driver's transient memory in source_xor --------------------------------------------


@dataclass(frozen=True)
class XorMemory:
    fmt: str
    events: int  # events the call counted (must equal the events written)
    written: int
    entries: int
    chunk_entries: int  # entries of the largest single Lua call
    chunk_events: int  # events of the largest single Lua call
    peak_bytes: int  # tracemalloc peak above the baseline, during the call
    call_ms: float  # the same call without tracemalloc

    @property
    def bytes_per_event(self) -> float:
        return self.peak_bytes / self.chunk_events if self.chunk_events else 0.0


def source_xor_memory(url: str, cfg: Config, pool: LoadPool, n_events: int) -> XorMemory:
    """Write about `n_events` into `cfg`'s (empty) shards, then call `source_xor` over all of
    it: once untraced (timing; also loads the script), once under tracemalloc (peak)."""
    written = prefill(url, pool, n_events)
    client = client_for(url, timeout_s=120)
    shards = cfg.source.shard_keys()
    end: dict[str, str] = {}
    largest = (0, 0)  # (entries, events) of the largest chunk
    for s in shards:
        top: Any = client.xrevrange(s, "+", "-", count=1)
        if not top:
            continue
        end[s] = top[0][0].decode()
        n = int(client.xlen(s))
        chunk = min(n, SOURCE_CHUNK[cfg.source.format])
        largest = max(largest, (chunk, round(chunk * pool.events_per_entry())))
    start = dict.fromkeys(end, ZERO_ID)
    fmt, max_bytes = cfg.source.format, cfg.source.max_entry_bytes
    t0 = time.perf_counter()
    source_xor(client, start, end, fmt, max_bytes)
    call_ms = (time.perf_counter() - t0) * 1000
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        _, events, entries = source_xor(client, start, end, fmt, max_bytes)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    client.close()
    return XorMemory(fmt, events, written, entries, largest[0], largest[1], peak, call_ms)


@dataclass(frozen=True)
class XorTiming:
    fmt: str
    entries: int  # in the one shard, read by one Lua call
    events: int
    call_ms: float
    ping_max_ms: float  # the longest PING round trip of another client during the call
    ping_busy: int  # PINGs Redis answered BUSY during the call

    @property
    def us_per_event(self) -> float:
        return self.call_ms * 1000 / self.events if self.events else 0.0


class PingProbe(threading.Thread):
    """Another client's view of Redis during a call: PING every 50 ms, the longest round trip
    and the BUSY replies (Redis runs one script at a time and serves nobody else meanwhile)."""

    def __init__(self, url: str) -> None:
        super().__init__(name="bench-ping-probe", daemon=True)
        self.client = client_for(url, timeout_s=600)
        self.max_ms = 0.0
        self.busy = 0
        self._stop_evt = threading.Event()

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(timeout=600)
        self.client.close()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            t0 = time.perf_counter()
            try:
                self.client.ping()
            except redis.exceptions.ResponseError as e:
                if not is_busy(e):
                    raise
                self.busy += 1
            self.max_ms = max(self.max_ms, (time.perf_counter() - t0) * 1000)
            self._stop_evt.wait(0.05)


def source_xor_scaling(
    url: str, cfg: Config, pool: LoadPool, entry_counts: Sequence[int]
) -> list[XorTiming]:
    """`source_xor` over one shard of n entries, for each n in `entry_counts`: does the source
    side's time grow linearly with the batch, and how long does it keep Redis from others?
    `pool` must write to `cfg`'s first shard only; the stream is emptied before each size."""
    shard = cfg.source.shard_keys()[0]
    client = client_for(url, timeout_s=600)
    out: list[XorTiming] = []
    for n in entry_counts:
        client.delete(shard)
        prefill(url, pool, round(n * pool.events_per_entry()))
        top: Any = client.xrevrange(shard, "+", "-", count=1)
        end = {shard: top[0][0].decode()}
        client.script_load(script_source(AUDIT_SOURCE))  # as in a running pipeline: loaded
        probe = PingProbe(url)
        probe.start()
        t0 = time.perf_counter()
        try:
            _, events, entries = source_xor(
                client, {shard: ZERO_ID}, end, cfg.source.format, cfg.source.max_entry_bytes
            )
            call_ms = (time.perf_counter() - t0) * 1000
        finally:
            probe.stop()
        out.append(XorTiming(cfg.source.format, entries, events, call_ms, probe.max_ms, probe.busy))
    client.close()
    return out


# -- sluice run as a process -----------------------------------------------------------------


class SluiceProcess:
    """`sluice run -c <config>` in its own session (process group), output appended to `log_path`.

    `kill9()` SIGKILLs the whole group: the Python driver, its Spark JVM and the Python workers
    die at the same instant, as in a container or host crash (killing only the driver would leave
    the JVM to notice its closed stdin and shut down on its own time).
    """

    def __init__(self, config_path: Path, log_path: Path) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        self.starts += 1
        self._log.write(f"---- bench: start {self.starts} ----\n".encode())
        self._log.flush()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SLUICE_SPARK_LOG_LEVEL": "ERROR"}
        self.proc = subprocess.Popen(
            [*SLUICE, "run", "-c", str(self.config_path)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session
        self.proc.wait(timeout=30)
        self._close_log()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (stop after the batch in flight); SIGKILL the group if it does not exit."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._close_log()
        return self.proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


@dataclass(frozen=True)
class Sample:
    """One look at Redis during the recovery run (wall-clock ms, like the batch records)."""

    t_ms: int
    backlog_events: int
    last_batch: int | None
    last_done_ms: int | None
    batches: int
    audit_ok: int
    events_in: int
    heartbeat_ms: int | None
    changed_ms: int | None
    state: str


def sample(client: Any, cfg: Config, events_per_entry: float) -> Sample:
    """Backlog, counters, the last batch record and the supervisor's health, in 2 round trips.
    Raises redis.ResponseError (BUSY) while a long script runs."""
    entries, _ = backlog(client, cfg)
    pipe = client.pipeline(transaction=False)
    pipe.hmget(STATS_KEY, "last_batch", "batches", "audit_ok", "events_in")
    pipe.hmget(HEALTH_KEY, "heartbeat_ms", "changed_ms", "state")
    (last, batches, ok, events_in), (beat, changed, state) = pipe.execute()
    rec = orjson.loads(last) if last else None
    return Sample(
        t_ms=time.time_ns() // 1_000_000,
        backlog_events=round(entries * events_per_entry),
        last_batch=rec["batch"] if rec else None,
        last_done_ms=rec["done_ms"] if rec else None,
        batches=int(batches or 0),
        audit_ok=int(ok or 0),
        events_in=int(events_in or 0),
        heartbeat_ms=int(beat) if beat else None,
        changed_ms=int(changed) if changed else None,
        state=state.decode() if state else "",
    )


class SteadyProducer(PacedProducer):
    """`_util.PacedProducer`'s pacing, but a command Redis refuses with BUSY (a script running
    past `lua-time-limit`) is queued and sent again on the next tick instead of ending the thread.

    `sent_events` counts acknowledged events only; `busy_replies` the refusals; `error` holds any
    other failure, which ends the thread. Runs until `stop()`.
    """

    def __init__(self, url: str, pool: LoadPool, rate_per_s: float) -> None:
        super().__init__(url, pool, rate_per_s, duration_s=math.inf)
        self.name = "bench-steady-producer"
        self.busy_replies = 0

    def _run(self) -> None:
        writer = RespWriter(self.url, timeout_s=120)
        t0 = last = time.monotonic()
        owed = 0.0
        i = 0
        n_cmds = len(self.pool.commands)
        retry: list[tuple[bytes, int]] = []
        try:
            while not self._stop_evt.is_set() or retry:
                now = time.monotonic()
                batch, retry = retry, []
                if not self._stop_evt.is_set():
                    owed = min(owed + self.rate_per_s * (now - last), self.rate_per_s)
                    while owed >= self.pool.events[i % n_cmds]:
                        owed -= self.pool.events[i % n_cmds]
                        batch.append((self.pool.commands[i % n_cmds], self.pool.events[i % n_cmds]))
                        i += 1
                last = now
                if batch:
                    replies = call_all(writer, [c for c, _ in batch])
                    for (cmd, n), reply in zip(batch, replies, strict=True):
                        if not isinstance(reply, hiredis.ReplyError):
                            self.sent_events += n
                        elif is_busy(reply):
                            self.busy_replies += 1
                            retry.append((cmd, n))
                        else:
                            raise RuntimeError(f"redis refused a benchmark command: {reply}")
                self.elapsed_s = time.monotonic() - t0
                time.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
        finally:
            self.elapsed_s = time.monotonic() - t0
            writer.close()


def call_all(writer: RespWriter, commands: Sequence[bytes]) -> list[Any]:
    """Send `commands` in one write; every reply in order, error replies included."""
    writer.sock.sendall(b"".join(commands))
    replies: list[Any] = []
    while len(replies) < len(commands):
        reply = writer.reader.gets()
        if reply is False:
            data = writer.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("redis closed the connection")
            writer.reader.feed(data)
        else:
            replies.append(reply)
    return replies
