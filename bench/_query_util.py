"""Helpers for bench/query.py: slice data in the writer's format, the `sluice serve` process, the
wrk load generator, CPU accounting, statistics and the docs section.

Slice data is written straight into Redis in the exact layout `write_slices.lua` produces
(`sluice.redis.keys`): hash `sluice:s:{metric|key}`, field `<slice start ms>` ->
`"<writer token>:<a>"` (the product's encoder, `sluice.slices.state.encode_state`), field `_m`
-> `"<newest slice start>:<oldest>"`, and a PEXPIREAT of newest + slice + retention.
`check_writer_format` proves the layout against the real script.
Commands are pre-encoded RESP sent over a raw socket (replies parsed by hiredis), so loading
millions of fields costs little Python.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import orjson
import redis

from _util import RespWriter, log
from _util import percentile as nearest_rank
from sluice.redis.keys import encode_key, slice_hash_key
from sluice.redis.scripts import WRITE_SLICES, script_source
from sluice.slices.state import encode_state, format_number
from sluice.slices.window import slice_start

SLICE_MS = 60_000
RETENTION_MS = 7 * 86_400_000
SCHEMA = {"ts": "long", "card": "string", "merchant": "string", "amount": "double"}
METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "1m", "retention": "7d"},
    {"name": "amount_sum", "key": ["merchant"], "agg": "sum", "value": "amount",
     "slice": "1m", "retention": "7d"},
]  # fmt: skip
KEY_PREFIX = {"txn_count": "card", "amount_sum": "merchant"}
WINDOWS = ("1m", "15m", "1h", "24h")
WINDOW_MS = {"1m": 60_000, "15m": 900_000, "1h": 3_600_000, "24h": 86_400_000}
ZIPF_A = 1.3  # as sluice.source.loadgen.EventGenerator
HOT_EVENTS_PER_MIN = 50.0  # mean events per slice of the hottest key; rank r gets 50 / r**1.3
WRITER_TOKEN = 1_000_000_000_017  # epoch 1, batch 17: what the writer stores before the ':'
LOAD_CHUNK_KEYS = 100
CLK_TCK = os.sysconf("SC_CLK_TCK")
WRK_MARK = "SLUICE_WRK "


# -- the data set ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSpec:
    """What to load: `keys[metric]` keys per metric (`card-0`.., `merchant-0`..), each with a
    value in every 1-minute slice from `hours` before `now_ms`'s slice to `ahead_min` slices
    after it (so windows ending at any time during the run stay fully covered)."""

    keys: dict[str, int]
    hours: float
    ahead_min: int
    now_ms: int
    resolutions_ms: tuple[int, ...] = (SLICE_MS,)  # finest first; coarser ones get own hashes

    @property
    def newest_ms(self) -> int:
        return slice_start(self.now_ms, SLICE_MS) + self.ahead_min * SLICE_MS

    @property
    def oldest_ms(self) -> int:
        back_slices = math.ceil(self.hours * 3_600_000 / SLICE_MS)
        return slice_start(self.now_ms, SLICE_MS) - back_slices * SLICE_MS

    def slice_starts(self) -> range:
        return range(self.oldest_ms, self.newest_ms + 1, SLICE_MS)

    def key_name(self, metric: str, rank: int) -> str:
        return f"{KEY_PREFIX[metric]}-{rank}"

    def coarse_starts(self, res_ms: int) -> range:
        """Slice starts of resolution `res_ms` that hold any of the loaded 1-minute slices."""
        first = self.oldest_ms - self.oldest_ms % res_ms
        return range(first, self.newest_ms - self.newest_ms % res_ms + 1, res_ms)

    def total_fields(self) -> int:
        per_key = len(self.slice_starts()) + 1
        per_key += sum(len(self.coarse_starts(r)) + 1 for r in self.resolutions_ms[1:])
        return sum(self.keys.values()) * per_key


def config_dict(redis_url: str, state_dir: Path, resolutions_ms: Sequence[int]) -> dict[str, Any]:
    """The served config: the two metrics, 1 m slices (plus coarser `resolutions_ms`, if more
    than one), 7 d retention, loopback only."""
    metrics = METRICS
    if len(resolutions_ms) > 1:
        metrics = [{**m, "resolutions": list(resolutions_ms)} for m in METRICS]
        metrics = [{k: v for k, v in m.items() if k != "slice"} for m in metrics]
    return {
        "redis": redis_url,
        "state_dir": str(state_dir),
        "source": {"stream": "events", "shards": 1, "format": "jsonl", "schema": SCHEMA},
        "metrics": metrics,
        "server": {"host": "127.0.0.1"},
    }


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def resp(*args: bytes) -> bytes:
    """One command in the Redis wire protocol."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


def _hset_command(key: bytes, fields_enc: Sequence[bytes], values_enc: Iterable[bytes]) -> bytes:
    """HSET key f1 v1 ... with the fields and values already bulk-encoded."""
    body = b"".join(itertools.chain.from_iterable(zip(fields_enc, values_enc, strict=True)))
    return b"*%d\r\n" % (2 + 2 * len(fields_enc)) + _bulk(b"HSET") + _bulk(key) + body


def slice_commands(
    metric: str,
    key: str,
    starts: range,
    packed_values: Sequence[bytes],
    resolution_ms: int | None = None,
) -> list[bytes]:
    """The commands that store one (metric, key)'s slices as the writer does: HSET of
    `<start>` -> packed value (bulk-encoded) plus `_m`, then PEXPIREAT newest + slice + retention.
    `resolution_ms` None: the metric's own (finest) slices, else a coarser resolution's hash.
    """
    hkey = slice_hash_key(metric, encode_key([key]), resolution_ms).encode()
    fields_enc = [_bulk(str(s).encode()) for s in starts] + [_bulk(b"_m")]
    meta = _bulk(f"{format_number(starts[-1])}:{format_number(starts[0])}".encode())
    hset = _hset_command(hkey, fields_enc, itertools.chain(packed_values, (meta,)))
    expire_at = starts[-1] + starts.step + RETENTION_MS
    return [hset, resp(b"PEXPIREAT", hkey, str(expire_at).encode())]


class _PackedCache:
    """Bulk-encoded `"<token>:<a>"` values, cached for the small integers counts take."""

    def __init__(self) -> None:
        self.ints: dict[int, bytes] = {}

    def count(self, a: int) -> bytes:
        got = self.ints.get(a)
        if got is None:
            got = self.ints[a] = _PackedCache.number(a)
        return got

    @staticmethod
    def number(a: float) -> bytes:
        return _bulk(encode_state(WRITER_TOKEN, (a,)).encode())


def key_values(metric: str, rank: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` slice values of the key of Zipf rank `rank` (0 = hottest): count = 1 + Poisson(rate),
    sum = count x a lognormal amount (mean about 20, rounded to cents)."""
    rate = HOT_EVENTS_PER_MIN / (rank + 1) ** ZIPF_A
    counts = 1 + rng.poisson(rate, n)
    if metric == "txn_count":
        return counts
    return np.round(counts * rng.lognormal(3.0, 0.5, n), 2)


def coarse_values(spec: DataSpec, values: np.ndarray, res_ms: int) -> np.ndarray:
    """Per slice of `spec.coarse_starts(res_ms)`, the sum of the 1-minute `values` inside it (what
    the writer folds into a coarser resolution for count and sum)."""
    starts = np.asarray(spec.slice_starts(), dtype=np.int64)
    first = spec.coarse_starts(res_ms)[0]
    sums = np.bincount((starts - first) // res_ms, weights=values)
    return sums.astype(np.int64) if values.dtype.kind == "i" else sums


def _pack(metric: str, values: np.ndarray, cache: _PackedCache) -> list[bytes]:
    if metric == "txn_count":
        return [cache.count(v) for v in values.tolist()]
    return [cache.number(v) for v in values.tolist()]


def _metric_commands(
    spec: DataSpec, metric: str, ranks: range, rng: np.random.Generator
) -> list[bytes]:
    starts = spec.slice_starts()
    cache = _PackedCache()
    out: list[bytes] = []
    for rank in ranks:
        key = spec.key_name(metric, rank)
        vals = key_values(metric, rank, len(starts), rng)
        out += slice_commands(metric, key, starts, _pack(metric, vals, cache))
        for res_ms in spec.resolutions_ms[1:]:
            coarse = _pack(metric, coarse_values(spec, vals, res_ms), cache)
            out += slice_commands(metric, key, spec.coarse_starts(res_ms), coarse, res_ms)
    return out


def load_slices(url: str, spec: DataSpec, seed: int) -> int:
    """Write every key of `spec` into Redis in the writer's format. Returns the fields written
    (slices plus one `_m` per key)."""
    rng = np.random.default_rng(seed)
    conn = RespWriter(url, timeout_s=120.0)
    fields = 0
    t0 = time.monotonic()
    try:
        for metric, n_keys in spec.keys.items():
            for lo in range(0, n_keys, LOAD_CHUNK_KEYS):
                ranks = range(lo, min(n_keys, lo + LOAD_CHUNK_KEYS))
                replies = conn.call_many(_metric_commands(spec, metric, ranks, rng))
                fields += sum(int(r) for r in replies[0::2])  # HSET replies (PEXPIREAT: 1)
                if (lo // LOAD_CHUNK_KEYS) % 20 == 19:
                    log(f"  loaded {metric} {ranks.stop:,}/{n_keys:,} keys, {fields:,} fields,"
                        f" {time.monotonic() - t0:.0f} s")  # fmt: skip
    finally:
        conn.close()
    return fields


def _writer_args(agg: str, starts: range, vals: Sequence[float], width: int | None) -> list[Any]:
    """write_slices.lua's ARGV for one key: `agg, slice_ms, retention_ms, n[, width]` then per
    slice `start, v1..` (width given: the current script), or `start, a, b` (width None: the
    script before per-agg widths)."""
    head: list[Any] = [agg, SLICE_MS, RETENTION_MS, len(vals)]
    if width is not None:
        head.append(width)
    for s, a in zip(starts, vals, strict=True):
        head += [s, format_number(a)] if width is not None else [s, format_number(a), 0]
    return head


def _writer_hash(client: redis.Redis, name: str, agg: str, starts: range, vals: Any) -> Any:
    """The hash and PTTL write_slices.lua leaves for these slices, trying the script's known
    ARGV conventions (it is being changed) until one runs. Raises RuntimeError if none does."""
    write = client.register_script(script_source(WRITE_SLICES))
    theirs = slice_hash_key(name, encode_key(["fmt-check-writer"]))
    errors = []
    for width in (1, None):
        client.delete(theirs)
        try:
            write(keys=[theirs], args=[WRITER_TOKEN, *_writer_args(agg, starts, vals, width)])
        except redis.ResponseError as e:
            errors.append(str(e))
            continue
        got = client.hgetall(theirs), client.pttl(theirs)
        client.delete(theirs)
        return got
    raise RuntimeError(f"write_slices.lua rejected every known argument layout: {errors}")


def check_writer_format(client: redis.Redis, url: str, now_ms: int) -> None:
    """Write the same few slices of each metric once with `write_slices.lua` (the pipeline's
    writer) and once with this module's encoder, and require identical hashes and expiry.
    Raises AssertionError naming the difference."""
    first = slice_start(now_ms, SLICE_MS) - 4 * SLICE_MS
    starts = range(first, first + 5 * SLICE_MS, SLICE_MS)
    values = {"txn_count": [3, 1, 17, 2, 9], "amount_sum": [20.5, 0.1, 3.0, 1234.56, 7.25]}
    conn = RespWriter(url, timeout_s=120.0)
    try:
        for m in METRICS:
            name, vals = m["name"], values[m["name"]]
            want, want_ttl = _writer_hash(client, name, m["agg"], starts, vals)
            ours = slice_hash_key(name, encode_key(["fmt-check-ours"]))
            packed = [_PackedCache.number(a) for a in vals]
            conn.call_many(slice_commands(name, "fmt-check-ours", starts, packed))
            got, got_ttl = client.hgetall(ours), client.pttl(ours)
            client.delete(ours)
            assert got == want, f"{name}: loader wrote {got!r}, the writer {want!r}"
            assert abs(got_ttl - want_ttl) < 5_000, f"{name}: expiry {got_ttl} vs {want_ttl} ms"
    finally:
        conn.close()


def expected_value(client: redis.Redis, metric: str, key: str, window: str, end_ms: int) -> Any:
    """The merged value computed in Python from the raw hash (Redis' merge order), for checks."""
    from sluice.slices.window import coverage

    cov = coverage(end_ms, WINDOW_MS[window], SLICE_MS)
    hkey = slice_hash_key(metric, encode_key([key]))
    raw = client.hmget(hkey, [str(s) for s in cov.slice_starts()])
    nums = [float(v.split(b":")[1]) for v in raw if v is not None]
    total = nums[0] if nums else 0
    for x in nums[1:]:
        total += x
    return int(total) if metric == "txn_count" else float(total)


# -- requests -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LookupSpec:
    metric: str
    key: str
    window: str


def draw_lookups(spec: DataSpec, n: int, rng: np.random.Generator) -> list[LookupSpec]:
    """`n` lookups: metric uniform, key Zipf(1.3) over the metric's keys (as loadgen draws
    keys), window uniform over WINDOWS."""
    metrics = list(spec.keys)
    m_idx = rng.integers(0, len(metrics), n)
    w_idx = rng.integers(0, len(WINDOWS), n)
    raw_ranks = rng.zipf(ZIPF_A, n) - 1
    out = []
    for mi, wi, r in zip(m_idx.tolist(), w_idx.tolist(), raw_ranks.tolist(), strict=True):
        metric = metrics[mi]
        out.append(LookupSpec(metric, spec.key_name(metric, r % spec.keys[metric]), WINDOWS[wi]))
    return out


def get_path(lk: LookupSpec, end_ms: int | None = None) -> str:
    path = f"/v1/metrics/{lk.metric}?key={quote(lk.key)}&window={lk.window}"
    return path if end_ms is None else f"{path}&end={end_ms}"


def batch_body(lookups: Sequence[LookupSpec]) -> bytes:
    queries = [{"metric": lk.metric, "key": [lk.key], "window": lk.window} for lk in lookups]
    return orjson.dumps({"queries": queries})


def write_request_file(path: Path, lines: Iterable[str | bytes]) -> int:
    """One request per line (a GET path or a JSON body). Returns the line count."""
    n = 0
    with path.open("wb") as f:
        for line in lines:
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
            n += 1
    return n


# -- HTTP helpers ---------------------------------------------------------------------------------


def http_json(url: str, body: bytes | None = None, timeout_s: float = 10.0) -> tuple[int, Any]:
    """(status, parsed JSON body) of a GET, or of a POST when `body` is given."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp_:
            return resp_.status, orjson.loads(resp_.read())
    except urllib.error.HTTPError as e:
        return e.code, orjson.loads(e.read() or b"null")


# -- the server process ---------------------------------------------------------------------------


def sluice_bin() -> str:
    """The `sluice` entry point next to this interpreter."""
    return str(Path(sys.executable).parent / "sluice")


def serve_supports_workers() -> bool:
    """Whether `sluice serve` has a `--workers` option."""
    out = subprocess.run(
        [sluice_bin(), "serve", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    return "--workers" in out.stdout


class ServeProcess:
    """`sluice serve` as a child process in its own session, on 127.0.0.1:`port`."""

    def __init__(self, config_path: Path, port: int, workers: int, log_path: Path) -> None:
        self.config_path = config_path
        self.port = port
        self.workers = workers
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sluice_bin(), "serve", "-c", str(self.config_path), "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port)]
        return [*cmd, "--workers", str(self.workers)]

    def start(self, timeout_s: float = 60.0) -> ServeProcess:
        """Start and wait for /healthz. Raises RuntimeError with the log tail if it fails."""
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                self.command(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sluice serve exited ({self.proc.returncode}): {self.tail()}")
            if self._healthy():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"sluice serve not healthy within {timeout_s:.0f} s: {self.tail()}")

    def _healthy(self) -> bool:
        try:
            status, _ = http_json(self.base_url + "/healthz", timeout_s=1.0)
        except (OSError, ValueError):
            return False
        return status == 200

    def tail(self, n_chars: int = 1500) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-n_chars:].strip()

    def pids(self) -> list[int]:
        """The server process and its descendants (uvicorn workers, if any)."""
        return [] if self.proc is None else process_tree(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its process group after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- CPU accounting -------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants, from /proc/<pid>/task/*/children."""
    out, todo = [], [pid]
    while todo and len(out) < 1000:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                continue
    return out


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores."""
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in parts[:8])
    busy = user + nice + system + irq + softirq + steal
    return busy / CLK_TCK, (busy + idle + iowait) / CLK_TCK


def children_cpu_s() -> float:
    """CPU seconds of this process' reaped children (wrk runs), user + system."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@dataclass
class CpuSnapshot:
    """CPU counters at one instant: server tree, redis, reaped children, machine busy/total."""

    server_s: float
    redis_s: float
    children_s: float
    busy_s: float
    total_s: float
    wall_s: float

    @classmethod
    def take(cls, server_pids: Sequence[int], redis_pid: int) -> CpuSnapshot:
        busy, total = machine_cpu_s()
        return cls(
            server_s=sum(proc_cpu_s(p) for p in server_pids),
            redis_s=proc_cpu_s(redis_pid),
            children_s=children_cpu_s(),
            busy_s=busy,
            total_s=total,
            wall_s=time.monotonic(),
        )


@dataclass
class CpuUse:
    """Cores used over an interval (CPU seconds / wall seconds) by each party."""

    server: float
    redis: float
    loadgen: float
    other: float  # the rest of the machine: other processes, the kernel outside them
    idle: float


def cpu_use(a: CpuSnapshot, b: CpuSnapshot) -> CpuUse:
    wall = max(1e-9, b.wall_s - a.wall_s)
    server = (b.server_s - a.server_s) / wall
    redis_ = (b.redis_s - a.redis_s) / wall
    loadgen = (b.children_s - a.children_s) / wall
    busy = (b.busy_s - a.busy_s) / wall
    cores = (b.total_s - a.total_s) / wall
    other = max(0.0, busy - server - redis_ - loadgen)
    return CpuUse(server, redis_, loadgen, other, max(0.0, cores - busy))


# -- wrk ------------------------------------------------------------------------------------------

WRK_LUA = r"""
-- Sluice query benchmark: requests from a file, one per line (GET paths, or POST bodies).
local reqs = {}
local i = 0
local n_threads = 0
local PCTS = {1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9, 99.99}
local think_ms = 0

function setup(thread)
  thread:set("thread_no", n_threads)
  n_threads = n_threads + 1
end

function init(args)
  local mode, file = args[1], args[2]
  for line in io.lines(file) do
    if mode == "get" then
      reqs[#reqs + 1] = wrk.format("GET", line)
    else
      reqs[#reqs + 1] = wrk.format("POST", "/v1/query",
        {["Content-Type"] = "application/json"}, line)
    end
  end
  i = ((thread_no or 0) * 7919) % #reqs
  think_ms = tonumber(args[3] or "0")
  if think_ms > 0 then
    -- Each connection waits an exponential think time (mean think_ms) before each request.
    math.randomseed(17 + (thread_no or 0))
    delay = function() return -math.log(1 - math.random()) * think_ms end
  end
end

function request()
  i = i + 1
  if i > #reqs then i = 1 end
  return reqs[i]
end

function done(summary, latency, requests)
  local e = summary.errors
  local p = {}
  for _, q in ipairs(PCTS) do
    p[#p + 1] = string.format('"%s":%.0f', tostring(q), latency:percentile(q))
  end
  io.write(string.format('SLUICE_WRK {"requests":%.0f,"duration_us":%.0f,"connect":%.0f,'
    .. '"read":%.0f,"write":%.0f,"status":%.0f,"timeout":%.0f,"mean_us":%.1f,"max_us":%.0f,'
    .. '"pct_us":{%s}}\n', summary.requests, summary.duration, e.connect, e.read, e.write,
    e.status, e.timeout, latency.mean, latency.max, table.concat(p, ",")))
end
"""


@dataclass
class WrkResult:
    """One wrk run. Latencies in ms; `errors` by kind (connect, read, write, status, timeout)."""

    requests: int
    duration_s: float
    errors: dict[str, int]
    mean_ms: float
    max_ms: float
    pct_ms: dict[float, float]
    cpu: CpuUse | None = None
    redis_calls: int = 0  # the lookups' commands Redis ran during the run (READ_COMMANDS)
    redis_usec: float = 0.0  # and the time it spent in them, µs
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def redis_us_per_lookup(self, lookups_per_request: int) -> float:
        """Redis' own time per lookup (INFO commandstats over the run)."""
        lookups = self.requests * lookups_per_request
        return self.redis_usec / lookups if lookups else 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def parse_wrk(stdout: str) -> WrkResult:
    """The SLUICE_WRK JSON line of the script's done(). Raises RuntimeError if absent."""
    line = next((ln for ln in stdout.splitlines() if ln.startswith(WRK_MARK)), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result line:\n{stdout[-1500:]}")
    d = json.loads(line[len(WRK_MARK) :])
    errors = {k: int(d[k]) for k in ("connect", "read", "write", "status", "timeout")}
    return WrkResult(
        requests=int(d["requests"]),
        duration_s=d["duration_us"] / 1e6,
        errors=errors,
        mean_ms=d["mean_us"] / 1000,
        max_ms=d["max_us"] / 1000,
        pct_ms={float(q): v / 1000 for q, v in d["pct_us"].items()},
    )


@dataclass(frozen=True)
class WrkJob:
    """One wrk invocation against `base_url` with requests from `requests_file`."""

    base_url: str
    script: Path
    requests_file: Path
    mode: str  # "get" | "batch"
    connections: int
    threads: int
    duration_s: float
    think_ms: float = 0.0  # mean think time per connection before each request; 0 = none
    timeout_s: float = 10.0

    def command(self) -> list[str]:
        return [
            "wrk", f"-t{self.threads}", f"-c{self.connections}", f"-d{self.duration_s:g}s",
            f"--timeout={self.timeout_s:g}s", "-s", str(self.script), self.base_url,
            "--", self.mode, str(self.requests_file), f"{self.think_ms:.3f}",
        ]  # fmt: skip


def run_wrk(job: WrkJob) -> WrkResult:
    """Run wrk to completion (bounded by its -d plus a margin). Raises RuntimeError on failure."""
    out = subprocess.run(
        job.command(),
        capture_output=True,
        text=True,
        timeout=job.duration_s + job.timeout_s + 60,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-1500:]}")
    return parse_wrk(out.stdout)


# -- statistics -----------------------------------------------------------------------------------


# What a lookup makes Redis run: HMGET (raw slices), EVALSHA (read_slices.lua, long ranges),
# PFCOUNT (distinct).
READ_COMMANDS = ("hmget", "evalsha", "pfcount")


def redis_read_stats(client: Any) -> tuple[int, float]:
    """(calls, µs) of READ_COMMANDS since the last CONFIG RESETSTAT."""
    stats = client.info("commandstats")
    calls = sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in READ_COMMANDS)
    usec = sum(float(stats.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in READ_COMMANDS)
    return calls, usec


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 1]. Raises ValueError on no values."""
    found = nearest_rank(values, q)
    if found is None:
        raise ValueError("percentile of no values")
    return found


def median(values: Sequence[float]) -> float:
    return percentile(values, 0.5) if len(values) % 2 else _mid(sorted(values))


def _mid(vs: Sequence[float]) -> float:
    n = len(vs)
    return (vs[n // 2 - 1] + vs[n // 2]) / 2


def time_calls_us(fn: Any, args_list: Sequence[tuple[Any, ...]]) -> list[float]:
    """Wall time of `fn(*args)` for each args tuple, in microseconds."""
    out = []
    for args in args_list:
        t0 = time.perf_counter_ns()
        fn(*args)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


# -- docs -----------------------------------------------------------------------------------------
