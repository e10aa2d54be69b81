"""Redis's DUMP format for hashes (`sluice.redis.dump`, and the RESTOREs built in C by
`sluice.redis._dump`): the CRC-64 Redis checks, one value and many at once, and the payloads'
layout. That Redis takes the payloads, and that a ziplist payload is the one Redis itself DUMPs,
is tested on a real Redis in tests/integration/test_slice_restore.py."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from sluice.pipeline import slice_restore
from sluice.pipeline.slice_restore import restore_items
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


def test_the_c_restores_are_built() -> None:
    assert slice_restore._items_in_c is not None, (
        "sluice.redis._dump is not built: `pip install -e .` builds it (it needs a C compiler)"
    )


def test_the_c_crc64_is_redis_s() -> None:
    from sluice.redis._dump import crc64 as c_crc64

    rng = np.random.default_rng(9)
    for data in [b"", b"123456789", *(rng.bytes(int(n)) for n in rng.integers(0, 900, 100))]:
        assert c_crc64(data) == _bitwise_crc64(data) == crc64(data)


def _hashes(rng: np.random.Generator, n: int, long_every: int = 0) -> tuple:
    """`restore_items`' arguments for `n` hashes of 1 to 5 slices (texts as a backfill stores
    them; with `long_every`, every such hash has one text of 70 to 16,000 bytes)."""
    counts = rng.integers(1, 6, n)
    bounds = np.append(0, np.cumsum(counts))
    starts = np.concatenate([1_700_000_000_000 + 10_000 * np.sort(rng.choice(500, c, False))
                             for c in counts])  # fmt: skip
    texts = [f"0:{int(x)}:{x:.6f}" for x in rng.normal(0, 1e6, int(bounds[-1]))]
    for h in range(0, n, long_every or n + 1):
        texts[int(bounds[h])] = "0:" + "7" * int(rng.integers(70, 16_000))
    names = pa.array([f"sluice:s:{{m|card-{i}}}" for i in range(n)])
    expiry = starts[bounds[1:] - 1] + 3_600_000
    return names, expiry, bounds, starts, pa.array(texts)


def test_c_and_arrow_restores_match_where_both_write_the_plain_type(monkeypatch: Any) -> None:
    """With ziplist limits no hash meets (or long values past them), the C code writes the
    plain hash type, byte for byte what the Arrow code writes: payloads, and whole commands."""
    rng = np.random.default_rng(11)
    for limits, args in [((0, 0), _hashes(rng, 300)), ((128, 64), _hashes(rng, 50, 1))]:
        got = {resp: restore_items(*args, "1699999990000", limits, resp) for resp in (False, True)}
        assert got[False].to_pylist()[0][:1] == b"\x04"
        monkeypatch.setattr(slice_restore, "_items_in_c", None)
        for resp in (False, True):
            want = restore_items(*args, "1699999990000", limits, resp)
            assert got[resp].to_pylist() == want.to_pylist()
        monkeypatch.undo()


def test_c_restores_refuse_bounds_that_do_not_fit() -> None:
    from sluice.redis._dump import restore_commands

    names, expiry, bounds, starts, texts = _hashes(np.random.default_rng(2), 3)
    offsets = np.frombuffer(texts.buffers()[1], np.int32)
    name_offsets = np.frombuffer(names.buffers()[1], np.int32)
    empty = np.array([0, bounds[1], bounds[1], bounds[3]])  # a hash with no slices
    for bad in (bounds + np.array([0, 0, 0, 99]), bounds[::-1].copy(), empty):
        with pytest.raises(ValueError):
            restore_commands(name_offsets, names.buffers()[2], expiry, bad, starts, offsets,
                             texts.buffers()[2], b"1", 128, 64, True)  # fmt: skip
    before = offsets - 1  # an offset before the texts' first byte
    with pytest.raises(ValueError):
        restore_commands(name_offsets, names.buffers()[2], expiry, bounds, starts, before,
                         texts.buffers()[2], b"1", 128, 64, True)  # fmt: skip


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
