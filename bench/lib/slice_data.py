"""The query benchmark's data set and requests: dense slices per key, loaded over a raw socket in
the writer's format (`slice_format`), and lookups drawn like `sluice.source.loadgen` draws keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import orjson

from lib.load import RespWriter
from lib.results import log
from lib.slice_format import METRICS, SLICE_MS, _PackedCache, pack, slice_commands
from sluice.redis.keys import encode_key, slice_hash_key
from sluice.slices.window import coverage, slice_start

KEY_PREFIX = {"txn_count": "card", "amount_sum": "merchant"}
WINDOWS = ("1m", "15m", "1h", "24h")
WINDOW_MS = {"1m": 60_000, "15m": 900_000, "1h": 3_600_000, "24h": 86_400_000}
ZIPF_A = 1.3  # as sluice.source.loadgen.EventGenerator
HOT_EVENTS_PER_MIN = 50.0  # mean events per slice of the hottest key; rank r gets 50 / r**1.3
LOAD_CHUNK_KEYS = 100


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


def key_values(metric: str, rank: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` slice values of the key of Zipf rank `rank` (0 = hottest): count = 1 + Poisson(rate),
    sum = count x a lognormal amount (mean about 20, rounded to cents)."""
    counts = 1 + rng.poisson(HOT_EVENTS_PER_MIN / (rank + 1) ** ZIPF_A, n)
    return counts if metric == "txn_count" else np.round(counts * rng.lognormal(3.0, 0.5, n), 2)


def coarse_values(spec: DataSpec, values: np.ndarray, res_ms: int) -> np.ndarray:
    """Per slice of `spec.coarse_starts(res_ms)`, the sum of the 1-minute `values` inside it (what
    the writer folds into a coarser resolution for count and sum)."""
    starts = np.asarray(spec.slice_starts(), dtype=np.int64)
    sums = np.bincount((starts - spec.coarse_starts(res_ms)[0]) // res_ms, weights=values)
    return sums.astype(np.int64) if values.dtype.kind == "i" else sums


def _metric_commands(spec: DataSpec, metric: str, ranks: range,
                     rng: np.random.Generator) -> list[bytes]:  # fmt: skip
    starts = spec.slice_starts()
    cache = _PackedCache()
    out: list[bytes] = []
    for rank in ranks:
        key = spec.key_name(metric, rank)
        vals = key_values(metric, rank, len(starts), rng)
        out += slice_commands(metric, key, starts, pack(metric, vals.tolist(), cache))
        for res_ms in spec.resolutions_ms[1:]:
            coarse = pack(metric, coarse_values(spec, vals, res_ms).tolist(), cache)
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


def expected_value(client: Any, metric: str, key: str, window: str, end_ms: int) -> Any:
    """The merged value computed in Python from the raw hash (Redis' merge order), for checks."""
    cov = coverage(end_ms, WINDOW_MS[window], SLICE_MS)
    raw = client.hmget(slice_hash_key(metric, encode_key([key])),
                       [str(s) for s in cov.slice_starts()])  # fmt: skip
    nums = [float(v.split(b":")[1]) for v in raw if v is not None]
    total = nums[0] if nums else 0
    for x in nums[1:]:
        total += x
    return int(total) if metric == "txn_count" else float(total)


@dataclass(frozen=True)
class LookupSpec:
    metric: str
    key: str
    window: str

    def path(self, end_ms: int | None = None) -> str:
        """The GET path of this lookup."""
        path = f"/v1/metrics/{self.metric}?key={quote(self.key)}&window={self.window}"
        return path if end_ms is None else f"{path}&end={end_ms}"


def draw_lookups(spec: DataSpec, n: int, rng: np.random.Generator) -> list[LookupSpec]:
    """`n` lookups: metric uniform, key Zipf(1.3) over the metric's keys (as loadgen draws
    keys), window uniform over WINDOWS."""
    metrics = list(spec.keys)
    m_idx, w_idx = rng.integers(0, len(metrics), n), rng.integers(0, len(WINDOWS), n)
    ranks = rng.zipf(ZIPF_A, n) - 1
    return [
        LookupSpec(metrics[m], spec.key_name(metrics[m], r % spec.keys[metrics[m]]), WINDOWS[w])
        for m, w, r in zip(m_idx.tolist(), w_idx.tolist(), ranks.tolist(), strict=True)
    ]


def batch_body(lookups: Sequence[LookupSpec]) -> bytes:
    queries = [{"metric": lk.metric, "key": [lk.key], "window": lk.window} for lk in lookups]
    return orjson.dumps({"queries": queries})


def write_request_file(path: Path, lines: Iterable[str | bytes]) -> Path:
    """One request per line (a GET path or a JSON body)."""
    with path.open("wb") as f:
        for line in lines:
            f.write((line.encode() if isinstance(line, str) else line) + b"\n")
    return path


def served_config(
    url: str | None, state_dir: Path, resolutions_ms: Sequence[int]
) -> dict[str, Any]:
    """The config `sluice serve` gets for this data: the two metrics, 1 m slices (plus coarser
    `resolutions_ms`, if more than one), 7 d retention, loopback only. Without `url`, the
    embedded default: the server under `state_dir/redis`."""
    metrics = METRICS
    if len(resolutions_ms) > 1:
        metrics = [{**{k: v for k, v in m.items() if k != "slice"},
                    "resolutions": list(resolutions_ms)} for m in METRICS]  # fmt: skip
    schema = {"ts": "long", "card": "string", "merchant": "string", "amount": "double"}
    return {
        **({} if url is None else {"redis": url}), "state_dir": str(state_dir),
        "metrics": metrics,
        "source": {"stream": "events", "shards": 1, "format": "jsonl", "schema": schema},
        "server": {"host": "127.0.0.1"},
    }  # fmt: skip
