"""`sluice.slices.hll` without Redis: the vectorised hash against a plain one-member-at-a-time
MurmurHash64A written from Redis's C, registers Redis reported, and the estimator's edges.
tests/integration/test_hll.py checks everything against a real Redis."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sluice.slices.hll import _round_half_away as round_half_away
from sluice.slices.hll import count_registers, estimate, merge_registers, registers

MASK64 = (1 << 64) - 1


def murmur64a(data: bytes, seed: int = 0xADC83B19) -> int:
    """MurmurHash64A as Redis's hyperloglog.c computes it, one member, Python ints."""
    m, r = 0xC6A4A7935BD1E995, 47
    h = (seed ^ (len(data) * m)) & MASK64
    whole = len(data) - len(data) % 8
    for i in range(0, whole, 8):
        k = (int.from_bytes(data[i : i + 8], "little") * m) & MASK64
        k ^= k >> r
        k = (k * m) & MASK64
        h = ((h ^ k) * m) & MASK64
    tail = data[whole:]
    if tail:
        h = ((h ^ int.from_bytes(tail, "little")) * m) & MASK64
    h ^= h >> r
    h = (h * m) & MASK64
    return h ^ (h >> r)


def reference_registers(members: list[bytes]) -> np.ndarray:
    regs = np.zeros(16384, dtype=np.uint8)
    for member in members:
        h = murmur64a(member)
        bits = (h >> 14) | (1 << 50)
        count = (bits & -bits).bit_length()  # trailing zeros + 1
        regs[h & 16383] = max(regs[h & 16383], count)
    return regs


def test_registers_match_the_scalar_hash_at_every_length() -> None:
    rng = random.Random(5)
    members = [rng.randbytes(length) for length in range(70) for _ in range(30)]
    np.testing.assert_array_equal(registers(members), reference_registers(members))


def test_registers_of_known_members() -> None:
    # Redis 6.2.14, PFADD k <member> then PFDEBUG GETREG k: the one register set, and its value.
    for member, index, value in [("foo", 7348, 5), ("hello world!", 8716, 3), ("", 5938, 2)]:
        regs = registers([member])
        assert regs.dtype == np.uint8
        assert regs.shape == (16384,)
        assert np.flatnonzero(regs).tolist() == [index]
        assert regs[index] == value


def test_str_is_its_utf8_bytes() -> None:
    members = ["café", "漢字", "😀", "plain"]
    np.testing.assert_array_equal(registers(members), registers([m.encode() for m in members]))
    assert estimate(["same", b"same"]) == 1


def test_merge_is_elementwise_max_and_a_union() -> None:
    a, b = registers(["x", "y"]), registers(["y", "z", "w"])
    merged = merge_registers(a, b)
    np.testing.assert_array_equal(merged, np.maximum(a, b))
    np.testing.assert_array_equal(merged, registers(["x", "y", "z", "w"]))


def test_small_counts_are_exact() -> None:
    assert count_registers(registers([])) == 0
    assert estimate([]) == 0
    assert estimate(["a"]) == 1
    assert estimate(iter(["a", "b", "a"])) == 2


def test_rounding_is_half_away_from_zero() -> None:
    # llroundl, unlike Python's round(), rounds halves up for positive values.
    assert [round_half_away(x) for x in (0.0, 0.5, 1.5, 2.5, 2.4999999999999996)] == [0, 1, 2, 3, 2]


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="wrap it in a list"):
        registers("abc")
    with pytest.raises(ValueError, match=r"`regs` must have shape \(16384,\)"):
        count_registers(np.zeros(100, dtype=np.uint8))
    with pytest.raises(ValueError, match="`regs` must have shape"):
        merge_registers(registers([]), np.zeros((2, 16384), dtype=np.uint8))
