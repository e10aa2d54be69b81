"""Redis's DUMP format for hashes (`sluice.redis.dump`): the CRC-64 Redis checks, one value and
many at once, and the payloads' layout. That Redis takes the payloads is tested on a real Redis
in tests/integration/test_slice_restore.py."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa

from sluice.redis.dump import crc64, crc64_column, hash_payload_heads, hash_payloads, rdb_strings


def _bitwise_crc64(data: bytes) -> int:
    """Redis's crc64.c, bit by bit: Jones polynomial 0xad93d23594c935a9, reflected, initial
    value 0, no final xor."""
    poly, crc = 0x95AC9329AC4BC9B5, 0  # the polynomial bit-reversed
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
    return crc


def test_crc64_is_redis_s() -> None:
    assert crc64(b"123456789") == 0xE9C6D914C4B8D9CA == _bitwise_crc64(b"123456789")
    assert crc64(b"") == 0


def test_a_column_s_crcs_are_each_value_s() -> None:
    rng = np.random.default_rng(5)
    values = [b"", b"\x00", b"\x00\x00abc", b"123456789"]
    values += [rng.bytes(int(n)) for n in rng.integers(0, 700, 200)]
    column = pa.array(values, pa.binary())
    got = crc64_column(column)
    assert [int(x) for x in got] == [_bitwise_crc64(v) for v in values]
    sliced = column.slice(100, 50)  # an array with an offset
    assert [int(x) for x in crc64_column(sliced)] == [crc64(v) for v in values[100:150]]


def test_lengths_take_one_or_two_bytes() -> None:
    got = rdb_strings(pa.array(["", "ab", "x" * 63, "y" * 64, "z" * 16_383])).to_pylist()
    assert got[0] == b"\x00" and got[1] == b"\x02ab" and got[2][:1] == bytes([63])
    assert got[3][:2] == bytes([0x40, 64]) and got[4][:2] == bytes([0x7F, 0xFF])
    assert [len(g) for g in got] == [1, 3, 64, 66, 16_385]


def test_a_payload_is_type_pairs_version_and_crc() -> None:
    heads = hash_payload_heads(np.array([2, 1]), rdb_strings(pa.array(["_b", "_b"])))
    # A head pair is a field only here, joined with its value below, as the writer joins them.
    pairs = rdb_strings(pa.array(["v1", "f", "v", "v2"]))
    joined = pa.array([pairs[0].as_py(), pairs[1].as_py() + pairs[2].as_py(), pairs[3].as_py()])
    got = hash_payloads(heads, joined, np.array([0, 2, 3])).to_pylist()
    first = b"\x04\x02" + b"\x02_b" + b"\x02v1" + b"\x01f\x01v" + b"\x09\x00"
    assert got[0] == first + struct.pack("<Q", crc64(first))
    second = b"\x04\x01" + b"\x02_b" + b"\x02v2" + b"\x09\x00"
    assert got[1] == second + struct.pack("<Q", crc64(second))
