"""Redis's HyperLogLog, offline: the exact integer PFCOUNT answers for the members PFADDed.

The online side keeps a `distinct` metric as one Redis HLL per slice and answers with PFCOUNT
over the window's slice keys (a union). An offline job that sees the same events must give the
same number, so this is a re-implementation of `src/hyperloglog.c` (identical in Redis 6.2 and
7.0), not another HLL:

- a member is hashed as the bytes Redis receives (a `str` as UTF-8, as redis-py sends it) with
  MurmurHash64A, seed 0xadc83b19, 8-byte blocks read little-endian, the 1..7 tail bytes XORed
  in little-endian order, then one multiply only if there was a tail;
- register = the hash's low 14 bits (16384 registers); value = 1 + the number of trailing zero
  bits of `hash >> 14` with bit 50 set, so values are 1..51;
- the estimate is hllCount's: Ertl's improved estimator over the register histogram
  (`_tau`, `_sigma`, alpha_inf = 0.721347520444481703680), rounded half away from zero as
  `llroundl` does. The floating-point steps are those of the C code, in its order: a
  reordering changes the last bits and can flip the rounding, so keep them as they are.

Redis keeps small HLLs sparse and converts them to dense; both encode the same registers
(the sparse one promotes itself when a value exceeds 32), so the estimate does not depend on
the encoding. PFCOUNT over several keys merges their registers with max, as `merge_registers`
does, and counts with the same estimator.

Speed: each distinct member is hashed once; members are grouped by byte length and each group
is hashed as uint64 columns read straight out of the joined bytes (numpy wraps uint64
multiplication as C does, and warns only on scalars). Measured with `estimate` on one core
(x86-64, Python 3.11, numpy 2.4), dedup and encoding included: 1 million distinct ASCII str
members of 10-20 bytes in 0.47-0.54 s (about 2 million members/s); the same with non-ASCII
characters in 0.7 s (a separate encode per member); 3 million of 10-40 bytes in 2.3 s, peak
about 320 MB. Most of the time is Python's set and per-member passes, not the hashing (about
0.06 s per million).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np
from numpy.typing import NDArray

__all__ = ["count_registers", "estimate", "merge_registers", "registers"]

P = 14
REGISTER_COUNT = 1 << P  # 16384
Q = 64 - P  # hash bits left after the register index; bit Q ends the zero run
ALPHA_INF = 0.721347520444481703680  # 0.5 / ln(2)
SEED = 0xADC83B19

_M = np.uint64(0xC6A4A7935BD1E995)
_R = np.uint64(47)
_INDEX_MASK = np.uint64(REGISTER_COUNT - 1)
_P_SHIFT = np.uint64(P)
_Q_BIT = np.uint64(1 << Q)
_MASK64 = (1 << 64) - 1

Registers = NDArray[np.uint8]


def registers(members: Iterable[str | bytes]) -> Registers:
    """The 16384 dense registers (uint8, values 0..51) of an HLL into which every member was
    PFADDed; a `str` is added as its UTF-8 bytes. Each distinct member is hashed once. Raises
    UnicodeEncodeError on a `str` that is not valid Unicode (a lone surrogate), as redis-py
    would when sending it, and TypeError on `members` that is one str or bytes."""
    if isinstance(members, str | bytes):
        raise TypeError("`members` must be an iterable of members, not one; wrap it in a list")
    data, lengths_bytes = _encode(list(set(members)))
    starts_bytes = np.cumsum(lengths_bytes) - lengths_bytes
    # Every 8-byte window of the data as a uint64, zero-copy (8 zero bytes pad the last one):
    # words[i] is the little-endian uint64 read at byte i.
    padded = data + bytes(8)
    words = np.ndarray(shape=(len(data) + 1,), dtype="<u8", buffer=padded, strides=(1,))
    order = np.argsort(lengths_bytes, kind="stable")
    sizes, firsts, counts = np.unique(lengths_bytes[order], return_index=True, return_counts=True)
    regs = np.zeros(REGISTER_COUNT, dtype=np.uint8)
    for size, first, count in zip(sizes.tolist(), firsts.tolist(), counts.tolist(), strict=True):
        hashes = _murmur64a(words, starts_bytes[order[first : first + count]], size)
        index = (hashes & _INDEX_MASK).astype(np.intp)
        np.maximum.at(regs, index, _pattern_lengths(hashes))
    return regs


def merge_registers(a: Registers, b: Registers) -> Registers:
    """The registers of the union of `a`'s and `b`'s members: their element-wise maximum, as
    PFMERGE and a several-key PFCOUNT merge. Raises ValueError on a shape other than 16384."""
    _check(a)
    _check(b)
    return np.maximum(a, b).astype(np.uint8, copy=False)


def count_registers(regs: Registers) -> int:
    """The estimate PFCOUNT answers for an HLL with these registers (hllCount); 0 for no
    members. Raises ValueError on a shape other than 16384."""
    _check(regs)
    histogram = np.bincount(regs, minlength=64).tolist()
    m = float(REGISTER_COUNT)
    z = m * _tau((m - histogram[Q + 1]) / m)
    for j in range(Q, 0, -1):
        z += histogram[j]
        z *= 0.5
    z += m * _sigma(histogram[0] / m)
    return _round_half_away(ALPHA_INF * m * m / z)


def estimate(members: Iterable[str | bytes]) -> int:
    """PFCOUNT's answer for a key into which `members` were PFADDed."""
    return count_registers(registers(members))


def _check(regs: Registers) -> None:
    if regs.shape != (REGISTER_COUNT,):
        raise ValueError(f"`regs` must have shape ({REGISTER_COUNT},), not {regs.shape}")


def _encode(members: list[str | bytes]) -> tuple[bytes, NDArray[np.intp]]:
    """The members' bytes, concatenated, and each one's length in bytes."""
    encoded: Sequence[str | bytes] = members
    try:
        # All str and all ASCII, the common case: one encode, and as many bytes as characters.
        data = "".join(cast("list[str]", members)).encode("ascii")
    except (TypeError, UnicodeEncodeError):
        as_bytes = [m.encode() if isinstance(m, str) else m for m in members]
        data, encoded = b"".join(as_bytes), as_bytes
    lengths_bytes = np.array(list(map(len, encoded)), dtype=np.intp)  # faster than fromiter
    return data, lengths_bytes


def _murmur64a(
    words: NDArray[np.uint64], starts_bytes: NDArray[np.intp], length_bytes: int
) -> NDArray[np.uint64]:
    """MurmurHash64A (seed SEED) of the members of `length_bytes` bytes starting at
    `starts_bytes` in the data behind `words` (see `registers`). The tail is read as a whole
    uint64 and masked to its bytes: the read may reach into the next member or the padding."""
    h = np.full(len(starts_bytes), SEED ^ ((length_bytes * int(_M)) & _MASK64), dtype=np.uint64)
    blocks, tail_bytes = divmod(length_bytes, 8)
    for i in range(blocks):
        k = words[starts_bytes + 8 * i] * _M
        k ^= k >> _R
        k *= _M
        h ^= k
        h *= _M
    if tail_bytes:
        h ^= words[starts_bytes + 8 * blocks] & np.uint64((1 << (8 * tail_bytes)) - 1)
        h *= _M
    h ^= h >> _R
    h *= _M
    h ^= h >> _R
    return h


def _pattern_lengths(hashes: NDArray[np.uint64]) -> NDArray[np.uint8]:
    # 1 + trailing zeros of the bits above the index, with bit Q set so the run ends by Q + 1.
    # The lowest set bit is a power of two below 2**51, exact as a double; frexp gives its
    # exponent + 1.
    bits = (hashes >> _P_SHIFT) | _Q_BIT
    lowest = bits & (~bits + np.uint64(1))
    _, exponent = np.frexp(lowest.astype(np.float64))
    return exponent.astype(np.uint8)


def _sigma(x: float) -> float:
    # hllSigma: the series x + x^2 + 2 x^4 + 4 x^8 ..., summed until it stops changing.
    if x == 1.0:
        return math.inf
    y = 1.0
    z = x
    while True:
        x *= x
        previous = z
        z += x * y
        y += y
        if previous == z:
            return z


def _tau(x: float) -> float:
    # hllTau, likewise summed until the double stops changing.
    if x in (0.0, 1.0):
        return 0.0
    y = 1.0
    z = 1.0 - x
    while True:
        x = math.sqrt(x)
        previous = z
        y *= 0.5
        z -= (1.0 - x) ** 2 * y
        if previous == z:
            return z / 3.0


def _round_half_away(x: float) -> int:
    # llroundl: halves round away from zero (Python's round() would round them to even).
    # x - floor(x) is exact for a double, so the comparison is too.
    whole = math.floor(x)
    return whole + 1 if x - whole >= 0.5 else whole
