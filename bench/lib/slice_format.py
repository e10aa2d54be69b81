"""The query benchmark's data in the writer's stored slice format, encoded without Spark.

A slice hash `sluice:s:{metric|key}` holds field `<slice start ms>` -> `"<writer token>:<a>"`
and field `_m` -> `"<newest slice start>:<oldest>"`, and expires at newest + slice + retention
(`sluice.redis.keys`, `write_slices.lua`). States are made by the product's own encoder
(`sluice.slices.state.encode_state`); `check_writer_format` proves the whole layout against the
real script before every load.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from lib.load import RespWriter, resp_command
from sluice.pipeline.slice_writes import expire_at_ms, run_write_script
from sluice.redis.keys import encode_key, slice_hash_key
from sluice.slices.state import encode_state, format_number
from sluice.slices.window import slice_start

SLICE_MS = 60_000
RETENTION_MS = 7 * 86_400_000
METRICS: list[dict[str, Any]] = [
    {"name": "txn_count", "key": ["card"], "agg": "count", "slice": "1m", "retention": "7d"},
    {"name": "amount_sum", "key": ["merchant"], "agg": "sum", "value": "amount",
     "slice": "1m", "retention": "7d"},
]  # fmt: skip
WRITER_TOKEN = 1_000_000_000_017  # epoch 1, batch 17: what the writer stores before the ':'


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _hset_command(key: bytes, fields_enc: Sequence[bytes], values_enc: Iterable[bytes]) -> bytes:
    """HSET key f1 v1 ... with the fields and values already bulk-encoded."""
    body = b"".join(itertools.chain.from_iterable(zip(fields_enc, values_enc, strict=True)))
    return b"*%d\r\n" % (2 + 2 * len(fields_enc)) + _bulk(b"HSET") + _bulk(key) + body


def slice_commands(metric: str, key: str, starts: range, packed_values: Sequence[bytes],
                   resolution_ms: int | None = None) -> list[bytes]:  # fmt: skip
    """The commands that store one (metric, key)'s slices as the writer does: HSET of
    `<start>` -> packed value (bulk-encoded) plus `_m`, then PEXPIREAT at the writer's expiry
    (`expire_at_ms`: newest + slice + retention, rounded up to the expiry step). `resolution_ms`
    None: the metric's own (finest) slices, else a coarser resolution's hash.
    """
    hkey = slice_hash_key(metric, encode_key([key]), resolution_ms).encode()
    fields_enc = [_bulk(str(s).encode()) for s in starts] + [_bulk(b"_m")]
    meta = _bulk(f"{format_number(starts[-1])}:{format_number(starts[0])}".encode())
    hset = _hset_command(hkey, fields_enc, itertools.chain(packed_values, (meta,)))
    expire_at = expire_at_ms(starts[-1], starts.step, RETENTION_MS)
    return [hset, resp_command(b"PEXPIREAT", hkey, str(expire_at).encode())]


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


def pack(metric: str, values: Sequence[Any], cache: _PackedCache) -> list[bytes]:
    """Slice values of `metric` (`txn_count` counts, else sums), encoded as the writer stores."""
    if metric == "txn_count":
        return [cache.count(v) for v in values]
    return [cache.number(v) for v in values]


def _writer_hash(client: redis.Redis, name: str, agg: str, starts: range, vals: Any) -> Any:
    """The hash and PTTL the writer's own call of write_slices.lua (`run_write_script`) leaves
    for these slices."""
    theirs = slice_hash_key(name, encode_key(["fmt-check-writer"]))
    client.delete(theirs)
    flat: list[Any] = []
    for s, a in zip(starts, vals, strict=True):
        flat += [str(s), encode_state(WRITER_TOKEN, (a,)).split(":", 1)[1]]
    args = [agg, str(SLICE_MS), str(RETENTION_MS), str(len(vals)), "1", *flat]
    run_write_script(client, WRITER_TOKEN, [(theirs, args, ())], set())
    got = client.hgetall(theirs), client.pttl(theirs)
    client.delete(theirs)
    return got


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
