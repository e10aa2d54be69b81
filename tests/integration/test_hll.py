"""`sluice.slices.hll` against a real Redis 6.2: the same registers as PFDEBUG GETREG and the
same integer as PFCOUNT, for one key and for a union of keys, in both of Redis's encodings
(sparse for small sets, dense once they grow)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import pytest
import redis

from sluice.slices.hll import count_registers, estimate, merge_registers, registers

Member = str | bytes
BATCH = 10_000  # members per PFADD


def _random_text(rng: random.Random, n: int) -> list[str]:
    """`n` random hex strings of 2 to 32 characters."""
    return [rng.randbytes(rng.randint(1, 16)).hex() for _ in range(n)]


def _sets() -> dict[str, list[Member]]:
    rng = random.Random(20240611)
    alphabet = "aé漢😀ß\u0301 "
    return {
        "empty": [],
        "one": ["card-1"],
        "two": ["card-1", "card-2"],
        "100": _random_text(rng, 100),
        "1000": _random_text(rng, 1_000),
        "20000": _random_text(rng, 20_000),
        "200000": _random_text(rng, 200_000),
        "unicode": ["".join(rng.choices(alphabet, k=rng.randint(1, 12))) for _ in range(3_000)],
        # Every tail length of MurmurHash64A's last block, and several blocks.
        "every_length": [
            "".join(rng.choices("abcdefghij", k=length)) for length in range(41) for _ in range(20)
        ],
        "numeric": [str(i) for i in range(-500, 5_000)] + ["0", "00", "1e3", "1.5", "-0"],
        "duplicates": ["a", "b", "a", "a", "c", "b"] * 500 + [f"m{i % 700}" for i in range(7_000)],
        "bytes": [
            b"\xff\x00\xfe",
            b"",
            b"\x00",
            bytes(range(256)),
            *(bytes([i]) for i in range(256)),
        ],
        "str_and_bytes": ["same", b"same", "caf\u00e9", "caf\u00e9".encode(), "other"],
    }


SETS = _sets()


@pytest.fixture
def keys(r: redis.Redis, request: pytest.FixtureRequest) -> Iterator[Callable[[str], str]]:
    """Key names under a prefix of this test's own; the keys are deleted after it."""
    prefix = f"test_hll:{request.node.name}:"
    made: list[str] = []

    def key(name: str) -> str:
        made.append(prefix + name)
        return made[-1]

    yield key
    if made:
        r.delete(*made)


def _pfadd(r: redis.Redis, key: str, members: Sequence[Member]) -> None:
    pipe = r.pipeline(transaction=False)
    pipe.pfadd(key)  # creates the (empty) HLL even when there are no members
    for i in range(0, len(members), BATCH):
        pipe.pfadd(key, *members[i : i + BATCH])
    pipe.execute()


def _encoding(r: redis.Redis, key: str) -> bytes:
    return bytes(r.execute_command("PFDEBUG", "ENCODING", key))


def _redis_registers(r: redis.Redis, key: str) -> np.ndarray:
    # PFDEBUG GETREG converts the key to the dense encoding: call it last.
    return np.array(r.execute_command("PFDEBUG", "GETREG", key), dtype=np.uint8)


@pytest.mark.parametrize("name", list(SETS))
def test_estimate_is_pfcount(r: redis.Redis, keys: Callable[[str], str], name: str) -> None:
    members = SETS[name]
    key = keys(name)
    _pfadd(r, key, members)
    assert estimate(members) == r.pfcount(key)
    np.testing.assert_array_equal(registers(members), _redis_registers(r, key))


def test_both_encodings_are_exercised(r: redis.Redis, keys: Callable[[str], str]) -> None:
    small, large = keys("small"), keys("large")
    _pfadd(r, small, SETS["100"])
    _pfadd(r, large, SETS["20000"])
    assert _encoding(r, small) == b"sparse"
    assert _encoding(r, large) == b"dense"


def test_estimate_at_many_sizes(r: redis.Redis, keys: Callable[[str], str]) -> None:
    """PFCOUNT after every step of a growing key, through the sparse-to-dense conversion and
    the estimator's small- and large-range regimes: many different register histograms."""
    rng = random.Random(7)
    key = keys("growing")
    regs = registers([])
    pipe = r.pipeline(transaction=False)
    expected: list[int] = []
    size = 0
    while size < 60_000:
        step = _random_text(rng, max(1, size // 25))
        size += len(step)
        regs = merge_registers(regs, registers(step))
        expected.append(count_registers(regs))
        pipe.pfadd(key, *step)
        pipe.pfcount(key)
    replies = pipe.execute()[1::2]
    assert len(replies) > 100
    assert replies == expected


def test_union_of_keys(r: redis.Redis, keys: Callable[[str], str]) -> None:
    """PFCOUNT over three keys (one sparse, two dense) is the count of the merged registers,
    and the estimate of all their members."""
    rng = random.Random(11)
    shared = _random_text(rng, 3_000)
    parts = [
        shared[:1_000] + _random_text(rng, 40),
        shared,
        shared[2_000:] + _random_text(rng, 9_000),
    ]
    names = [keys(f"part{i}") for i in range(3)]
    for name, part in zip(names, parts, strict=True):
        _pfadd(r, name, part)
    assert _encoding(r, names[0]) == b"sparse"
    a, b, c = (registers(part) for part in parts)
    union = r.pfcount(*names)
    assert count_registers(merge_registers(merge_registers(a, b), c)) == union
    assert estimate([m for part in parts for m in part]) == union
