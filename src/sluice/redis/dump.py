"""Serialized hashes for `RESTORE`: Redis's DUMP format, built on whole Arrow columns.

A DUMP payload is one value in the RDB format: its type, its body, then the RDB version (2 bytes,
little-endian) and a CRC-64 (Jones polynomial, reflected, initial value 0; 8 bytes,
little-endian) of everything before it. Redis checks both and refuses a payload whose version is
newer than its own. A hash is written here as the plain type `RDB_TYPE_HASH` (4): its number of
field/value pairs, then each field and value as a length-prefixed string. Redis builds its own
compact encoding from that as it loads it (or a hash table, past `hash-max-ziplist-entries`), so
the payload depends on no in-memory layout. It is stamped with RDB version 9 (Redis 6.2), which
every later Redis loads too.

`RESTORE key ttl payload ABSTTL` (no `REPLACE`) creates a key with its expiry in one command, and
refuses a key that exists (`BUSYKEY`): a writer that may only create can try it first.

Redis keeps a small hash as one compact string (a ziplist: `hash-max-ziplist-entries` pairs, no
field or value longer than `hash-max-ziplist-value` bytes; Redis 7 calls them listpacks and
converts on load), and DUMPs it as RDB type 13, that string as it lies. A payload in that form
costs Redis one allocation to load, where the plain type costs one ziplist push per field and
value; `_dump.c` builds it (`sluice.pipeline.slice_restore.restore_items`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import anycrc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from redis.exceptions import RedisError

TYPE_HASH = b"\x04"
RDB_VERSION = b"\x09\x00"
MAX_STRING = (1 << 14) - 1  # the longest string a one- or two-byte length prefix covers
# Redis's defaults for `hash-max-ziplist-entries` and `hash-max-ziplist-value`.
ZIPLIST_LIMITS = (128, 64)
_CRC = anycrc.Model("CRC64-REDIS")


def ziplist_limits(client: Any) -> tuple[int, int]:
    """The server's (`hash-max-ziplist-entries`, `hash-max-ziplist-value`): up to these, Redis
    keeps a hash as a ziplist. Redis's defaults where CONFIG is refused (an ACL, a renamed
    command) or says nothing."""
    try:
        got = client.config_get("hash-max-ziplist-*")
        return int(got["hash-max-ziplist-entries"]), int(got["hash-max-ziplist-value"])
    except (RedisError, KeyError, ValueError, TypeError):
        return ZIPLIST_LIMITS


def crc64(data: bytes) -> int:
    """Redis's CRC-64 of `data`."""
    return int(_CRC.calc(data))


def crc64_column(values: pa.Array) -> np.ndarray:
    """Redis's CRC-64 of every value of a binary column (uint64)."""
    calc = _CRC.calc
    return np.fromiter((calc(v) for v in values.to_pylist()), dtype=np.uint64, count=len(values))


@cache
def _length_prefixes() -> pa.Array:
    """RDB length prefixes of 0 .. MAX_STRING: one byte below 64, else two (14 bits)."""
    one = [bytes([i]) for i in range(64)]
    two = [bytes([0x40 | (i >> 8), i & 0xFF]) for i in range(64, MAX_STRING + 1)]
    return pa.array(one + two, pa.binary())


def length_prefix(lengths: np.ndarray) -> pa.Array:
    """The RDB length prefix of each length (each at most MAX_STRING)."""
    return _length_prefixes().take(pa.array(lengths))


def rdb_strings(values: pa.Array) -> pa.Array:
    """Each value (text or binary, at most MAX_STRING bytes) as an RDB string: prefix + bytes."""
    values = values.cast(pa.binary())
    lengths = pc.binary_length(values).to_numpy(zero_copy_only=False)
    return pc.binary_join_element_wise(length_prefix(lengths), values, b"")


def hash_payloads(heads: pa.Array, pairs: pa.Array, pair_offsets: np.ndarray) -> pa.Array:
    """DUMP payloads of hashes, one per row of `heads`. Hash i has the pairs
    `pairs[pair_offsets[i]:pair_offsets[i + 1]]`, each a field and its value already as RDB
    strings joined (`rdb_strings`), plus `heads[i]`: its first pairs, joined the same way, whose
    number is the same for every hash (`head_pairs` in `hash_payload_heads`)."""
    grouped = pa.ListArray.from_arrays(pa.array(pair_offsets.astype(np.int32)), pairs)
    bodies = pc.binary_join(grouped, b"")
    raw = pc.binary_join_element_wise(heads, bodies, pa.scalar(RDB_VERSION, pa.binary()), b"")
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks()
    crc = crc64_column(raw).astype("<u8")
    crc_bytes = pa.Array.from_buffers(
        pa.binary(), len(crc),
        [None, pa.py_buffer(np.arange(0, 8 * len(crc) + 1, 8, dtype=np.int32)),
         pa.py_buffer(crc.tobytes())],
    )  # fmt: skip
    return pc.binary_join_element_wise(raw, crc_bytes, b"")


def hash_payload_heads(pair_counts: np.ndarray, head_pairs: pa.Array) -> pa.Array:
    """The start of each hash's payload: its type, its number of pairs (`pair_counts`, those in
    `head_pairs` included) and `head_pairs` (the pairs every hash starts with, as RDB strings
    joined: one value per hash)."""
    kind = pa.scalar(TYPE_HASH, pa.binary())
    return pc.binary_join_element_wise(kind, length_prefix(pair_counts), head_pairs, b"")
