"""Processes and servers: temporary state, a pipeline on an embedded Redis, `sluice run` and
`serve` as child processes, and the CPU they use. Servers listen on 127.0.0.1; waits are bounded."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson
import redis

from lib.load import LoadPool, is_busy, prefill
from lib.results import log
from lib.stats import batch_rate
from sluice.config import Config
from sluice.pipeline.fold import FoldQuery
from sluice.redis.connection import RedisHandle, open_redis
from sluice.redis.keys import SLICE_PREFIX, STATS_KEY
from sluice.status.snapshot import backlog, recent_batches
from sluice.testing.faults import SlowStore
from sluice.testing.ports import free_port


def wait_until(ok: Callable[[], Any], what: str, timeout_s: float, poll_s: float) -> None:
    """Poll `ok()` every `poll_s` until it is true; RuntimeError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


CLK_TCK = os.sysconf("SC_CLK_TCK")
os.environ.setdefault("SLUICE_SPARK_LOG_LEVEL", "ERROR")  # read by build_spark


class Workspace:
    """Fresh temporary state dirs under one root, removed by `cleanup()` unless kept."""

    def __init__(self, keep: bool = False) -> None:
        self.root, self.keep, self._n = Path(tempfile.mkdtemp(prefix="sluice-bench-")), keep, 0

    def state_dir(self, label: str) -> Path:
        self._n += 1
        (path := self.root / f"{self._n:02d}-{label}").mkdir()
        return path

    def cleanup(self) -> None:
        if self.keep:
            log(f"state kept under {self.root}")
        else:
            shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def pipeline_run(
    spark: Any, cfg: Config, write_delay_ms: float = 0.0, **kw: Any
) -> Iterator[tuple[FoldQuery, RedisHandle]]:
    """An embedded Redis under cfg.state_dir and a (not yet started) fold (`kw` passed on, and
    a store slowed by `write_delay_ms` per 1,000 updates); both stopped on exit, also on
    errors."""
    handle = open_redis(None, cfg.state_dir)
    pipeline: FoldQuery | None = None
    try:
        pipeline = FoldQuery(cfg, handle, spark, **kw)
        if write_delay_ms:
            pipeline.writer = SlowStore(write_delay_ms)
        yield pipeline, handle
    finally:
        if pipeline is not None:
            pipeline.stop()
        handle.close()


def stat_counter(client: Any, name: str) -> int:
    return int(client.hget(STATS_KEY, name) or 0)


def wait_idle(pipeline: FoldQuery, client: Any, cfg: Config, timeout_s: float,
              what: str) -> tuple[bool, int]:  # fmt: skip
    """`FoldQuery.wait_idle` in 5 s slices with a progress line each, riding out BUSY replies
    (Redis refuses other clients while a script runs over 5 s). Returns (idle, BUSY polls)."""
    deadline, busy = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        try:
            if pipeline.wait_idle(timeout_s=min(5.0, max(0.1, deadline - time.monotonic()))):
                return True, busy
            entries, _ = backlog(client, cfg)
        except redis.exceptions.ResponseError as e:
            if not is_busy(e):
                raise
            busy += 1
            log(f"{what}: redis answers BUSY (a Lua script has run over 5 s)")
            time.sleep(1.0)
            continue
        log(f"{what}: {stat_counter(client, 'events_in'):,} events in, {entries:,} entries left")
    return False, busy


def drain(pipeline: FoldQuery, handle: RedisHandle, cfg: Config, pool: LoadPool, n_events: int,
          timeout_s: float, what: str, target: Any = None) -> dict[str, Any]:  # fmt: skip
    """Pre-fill about `n_events` from `pool` into `target` (default: `handle`), start `pipeline`
    and wait until it is idle: the events written, whether it went idle, the BUSY polls, the
    batch records (by batch number) and their rate (`lib.stats.batch_rate`, None if < 2)."""
    sent = prefill(target or handle.url, pool, n_events)
    log(f"{what}: pre-filled {sent:,} events; starting the pipeline")
    pipeline.start()
    idle, busy = wait_idle(pipeline, handle.client, cfg, timeout_s, what)
    records = sorted(recent_batches(handle.client, 600), key=lambda r: r["batch"])
    rate = batch_rate(records)
    log(f"{what}: {len(records)} batches, {rate}")
    return {"prefilled": sent, "idle": idle, "busy_polls": busy, "records": records, "rate": rate}


def input_level(client: Any, streams: Sequence[str]) -> tuple[int, int]:
    """(entries, exact bytes) of the input streams in one round trip (`MEMORY USAGE ... SAMPLES
    0` sizes every node; the default samples 5 and extrapolates, which uneven entries skew)."""
    pipe = client.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
        pipe.execute_command("MEMORY", "USAGE", s, "SAMPLES", 0)
    res = pipe.execute()
    return sum(int(x) for x in res[0::2]), sum(int(x or 0) for x in res[1::2])


def command_usec(client: Any) -> dict[str, int]:
    """Redis's own time per command (INFO commandstats), microseconds since it started."""
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["usec"]) for k, v in stats.items()}


def count_metric_total(client: Any, metric: str) -> int:
    """A count metric summed over every key and slice of its base resolution (each slice field
    holds `<writer token>:<count>`): the events the store holds, independent of the counters."""
    keys = [
        k
        for k in client.scan_iter(match=f"{SLICE_PREFIX}{{{metric}|*", count=5000)
        if b":r" not in k.rsplit(b"}", 1)[1]
    ]  # not a coarser resolution of the metric
    total = 0
    for i in range(0, len(keys), 1000):  # many keys (one per card): pipelined
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + 1000]:
            pipe.hgetall(key)
        for fields in pipe.execute():
            total += sum(int(v.split(b":")[1]) for f, v in fields.items() if f != b"_m")
    return total


class SluiceProcess:
    """`sluice <args>` in its own process group, output appended to `log_path`. `kill9()` kills
    the whole group at once, as a host crash would: the driver, its Spark JVM and the workers
    (killing only the driver would leave the JVM to shut down on its own time)."""

    def __init__(self, args: Sequence[str], log_path: Path, env: dict[str, str] | None = None):
        self.args, self.log_path = [sys.executable, "-m", "sluice.cli", *args], log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> SluiceProcess:
        self._log = self.log_path.open("ab")
        self._log.write(f"---- bench: sluice {' '.join(self.args[3:])} ----\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)  # fmt: skip
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pids(self) -> list[int]:
        """The process and its live descendants (uvicorn workers, the JVM, Python workers)."""
        out, todo = [], [self.proc.pid] if self.proc else []
        while todo and len(out) < 1000:
            out.append(p := todo.pop())
            for task in Path(f"/proc/{p}/task").glob("*/children"):
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in task.read_text().split()]
        return out

    def tail(self, n_chars: int = 1500) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-n_chars:].strip()

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)  # pgid == pid: start_new_session
        self.proc.wait(timeout=30)
        self._close_log()

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (stop after the batch in flight); SIGKILL the group if it does not exit in
        `timeout_s`. Returns the exit code."""
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


class ServeProcess(SluiceProcess):
    """`sluice serve -c <config> --workers N [--http S]` on 127.0.0.1 and a free port."""

    def __init__(self, config_path: Path, workers: int, log_path: Path,
                 http: str | None = None, env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.port = free_port()
        args = ["serve", "-c", str(config_path), "--host", "127.0.0.1", "--port", str(self.port)]
        args += ["--workers", str(workers), *(["--http", http] if http else [])]
        super().__init__(args, log_path, env)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServeProcess:
        """Start and wait for /healthz. Raises RuntimeError with the log tail if it fails."""
        super().start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with contextlib.suppress(OSError, ValueError):
                if http_json(self.base_url + "/healthz", timeout_s=1.0)[0] == 200:
                    return self
            time.sleep(0.1)
        raise RuntimeError(f"sluice serve not healthy within {timeout_s:.0f} s: {self.tail()}")

    def check_alive(self) -> None:
        """Raise RuntimeError (with the log's tail) if the server has exited."""
        if not self.alive():
            raise RuntimeError(f"sluice serve exited: {self.tail()}")


def http_json(url: str, body: bytes | None = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    """(status, parsed JSON body) of a GET, or of a POST when `body` is given."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, body, headers), timeout=timeout_s
        ) as r:
            return r.status, orjson.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read() or b"null")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class CpuSnapshot:
    """CPU seconds at one instant: each watched party, this process' reaped children (e.g.
    wrk), and the whole machine's busy and total time, summed over cores."""

    parties: dict[str, float]
    children_s: float
    busy_s: float
    total_s: float
    wall_s: float

    @classmethod
    def take(cls, parties: Mapping[str, Sequence[int]]) -> CpuSnapshot:
        cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = sum(cpu) - cpu[3] - cpu[4]  # all but idle and iowait
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = {k: sum(map(proc_cpu_s, pids)) for k, pids in parties.items()}
        return cls(used, ru.ru_utime + ru.ru_stime, busy / CLK_TCK, sum(cpu) / CLK_TCK,
                   time.monotonic())  # fmt: skip

    def cores_since(self, a: CpuSnapshot) -> dict[str, float]:
        """Cores used since `a` (CPU seconds / wall seconds): each party, `loadgen` (reaped
        children), `other` (the rest of the machine) and `idle`."""
        wall = max(1e-9, self.wall_s - a.wall_s)
        out = {k: (v - a.parties.get(k, 0.0)) / wall for k, v in self.parties.items()}
        out["loadgen"] = (self.children_s - a.children_s) / wall
        busy = (self.busy_s - a.busy_s) / wall
        out["other"] = max(0.0, busy - sum(out.values()))
        out["idle"] = max(0.0, (self.total_s - a.total_s) / wall - busy)
        return out


class CpuSampler(threading.Thread):
    """A CpuSnapshot every `every_s`, stamped with the wall clock (epoch ms, as batch records
    are), of the parties `parties()` names at that moment, until `stop()`: the cores used over
    any window of the run, such as a drain's from its first batch's end to its last's."""

    def __init__(self, parties: Callable[[], Mapping[str, Sequence[int]]],
                 every_s: float = 0.25) -> None:  # fmt: skip
        super().__init__(name="cpu-sampler", daemon=True)
        self.parties, self.every_s = parties, every_s
        self.samples: list[tuple[float, CpuSnapshot]] = []
        self._stop_evt = threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append((time.time() * 1000, CpuSnapshot.take(self.parties())))
            if self._stop_evt.wait(self.every_s):
                return

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()

    def cores_between(self, t0_ms: float, t1_ms: float) -> dict[str, float] | None:
        """Cores from the last sample at or before `t0_ms` to the first at or after `t1_ms`
        (None when the samples do not cover the window)."""
        before = [snap for t, snap in self.samples if t <= t0_ms]
        after = [snap for t, snap in self.samples if t >= t1_ms]
        return after[0].cores_since(before[-1]) if before and after else None


def children(pid: int) -> list[int]:
    """The processes `pid` started (from /proc), for per-process CPU readings."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process under `pid`: its children, theirs, and so on."""
    out, todo = [], children(pid)
    while todo:
        out.append(p := todo.pop())
        todo += children(p)
    return out
