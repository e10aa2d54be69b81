"""sluice.source.producer.shard_of: a stable key -> shard mapping."""

from __future__ import annotations

import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.source.producer import shard_of

FAST = settings(max_examples=120, deadline=None, database=None)
values = st.one_of(st.text(max_size=20), st.integers(), st.floats(allow_nan=False))


@FAST
@given(values, st.integers(min_value=1, max_value=1024))
def test_shard_in_range_and_deterministic(value: object, shards: int) -> None:
    s = shard_of(value, shards)
    assert 0 <= s < shards
    assert shard_of(value, shards) == s


@FAST
@given(values)
def test_single_shard_is_zero(value: object) -> None:
    assert shard_of(value, 1) == 0


def test_known_values() -> None:
    # CRC32 of the value's text: fixed across processes and Python versions (unlike hash()).
    assert shard_of("c1", 4) == zlib.crc32(b"c1") % 4
    assert shard_of("card-17", 16) == zlib.crc32(b"card-17") % 16
    assert shard_of(123, 8) == shard_of("123", 8)


def test_stable_across_processes() -> None:
    code = (
        "from sluice.source.producer import shard_of;"
        "print([shard_of(f'k{i}', 7) for i in range(50)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345"},
    ).stdout.strip()
    assert out == str([shard_of(f"k{i}", 7) for i in range(50)])


def test_spreads_keys_over_all_shards() -> None:
    counts = [0] * 8
    for i in range(4000):
        counts[shard_of(f"card-{i}", 8)] += 1
    assert min(counts) > 350  # about 500 each


@pytest.mark.parametrize("shards", [2, 3, 1024])
def test_same_key_same_shard(shards: int) -> None:
    assert len({shard_of("merchant-9", shards) for _ in range(10)}) == 1


def test_a_failed_write_keeps_the_buffer() -> None:
    """A Redis error during flush (here: no server) leaves every event buffered for the retry."""
    import pytest
    import redis as redis_lib

    from sluice.source.producer import Producer

    down = redis_lib.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing there
    p = Producer(down, shards=2, format="jsonl", shard_by="card")
    p.send_many({"card": f"c{i}", "ts": i} for i in range(10))
    with pytest.raises(redis_lib.ConnectionError):
        p.flush()
    assert p.pending() == 10 and p.sent_events == 0
