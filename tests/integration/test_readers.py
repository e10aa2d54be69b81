"""Several readers of one input stream, each with its own offsets: a shard is trimmed only up to
its slowest reader, and each reader's backlog is measured apart. Real Redis, real source readers
(`commit` needs no Spark)."""

from __future__ import annotations

from typing import Any

import redis

from sluice.config import BackpressureConfig
from sluice.graph import StreamsSpec
from sluice.redis.keys import shard_keys, shard_side_key
from sluice.redis.local_cluster import LocalCluster
from sluice.source.options import SourceOptions
from sluice.source.reader import LogStreamReader
from sluice.source.streams import raw_client
from tests.integration.helpers import stream_level

BP = BackpressureConfig()


def _reader(
    url: str, reader: str = "", readers: tuple[str, ...] = ("",), shards: tuple[str, ...] = ("s",)
) -> LogStreamReader:
    opts = SourceOptions(
        url=url,
        log=StreamsSpec(shards),
        format="fields",
        fields=(("n", "long", True),),
        time_field=None,
        max_events_per_batch=None,
        max_string_bytes=64,
        reader=reader,
        readers={s: readers for s in shards},
    )
    return LogStreamReader(opts)


def _fill(r: Any, stream: str, first_ms: int, n: int) -> None:
    """n entries, one per ms from `first_ms`: ids `<first_ms>-0`, `<first_ms + 1>-0`, ..."""
    for i in range(n):
        r.xadd(stream, {"n": i}, id=f"{first_ms + i}-0")


def _commit(reader: LogStreamReader, last_id: str) -> None:
    reader.commit({"ids": dict.fromkeys(reader.opts.shards, last_id), "ref": 0})


def _first_id(r: redis.Redis, stream: str) -> str:
    first: Any = r.xrange(stream, count=1)
    return str(first[0][0].decode())


def test_a_shard_is_trimmed_only_up_to_its_slowest_reader(r: redis.Redis, redis_url: str) -> None:
    _fill(r, "s", 1000, 10)
    a = _reader(redis_url, "a", ("a", "b"))
    b = _reader(redis_url, "b", ("a", "b"))
    _commit(b, "1002-0")
    _commit(a, "1005-0")
    assert _first_id(r, "s") == "1002-0"  # MINID keeps the slower reader's committed entry
    _commit(a, "1008-0")
    assert r.xlen("s") == 8  # a moving on frees nothing while b lags
    _commit(b, "1007-0")
    assert _first_id(r, "s") == "1007-0"
    assert r.hgetall(shard_side_key("rd", "s")) == {b"a": b"1008-0", b"b": b"1007-0"}
    # the status backlog: entries after the slowest reader's committed id (1008-0, 1009-0)
    from sluice.config import config_from_dict
    from sluice.status.snapshot import backlog

    cfg = config_from_dict(
        {"source": {"stream": "s", "schema": {"n": "long"}, "time_field": None},
         "metrics": [{"name": "c", "key": ["n"], "agg": "count"}]}
    )  # fmt: skip
    assert backlog(r, cfg) == (2, {"s": 2})


def test_a_reader_that_never_committed_blocks_trimming(r: redis.Redis, redis_url: str) -> None:
    _fill(r, "s", 1000, 10)
    _commit(_reader(redis_url, "a", ("a", "b", "c")), "1005-0")
    _commit(_reader(redis_url, "b", ("a", "b", "c")), "1009-0")
    assert r.xlen("s") == 10
    _commit(_reader(redis_url, "c", ("a", "b", "c")), "1007-0")
    assert _first_id(r, "s") == "1005-0"


def test_an_offset_never_moves_back(r: redis.Redis, redis_url: str) -> None:
    _fill(r, "s", 1000, 10)
    _commit(_reader(redis_url, "a", ("a", "b")), "1003-0")
    # A restart of `a` from an older checkpoint replays an earlier commit; the id stays.
    _commit(_reader(redis_url, "a", ("a", "b")), "1001-5")
    _commit(_reader(redis_url, "b", ("a", "b")), "1009-0")
    assert r.hget(shard_side_key("rd", "s"), "a") == b"1003-0"
    assert _first_id(r, "s") == "1003-0"


def test_the_default_reader_trims_to_its_own_id_and_records_it(
    r: redis.Redis, redis_url: str
) -> None:
    shards = ("events:0", "events:1")
    for s in shards:
        _fill(r, s, 1000, 10)
    _commit(_reader(redis_url, shards=shards), "1004-0")
    assert [r.xlen(s) for s in shards] == [6, 6]  # the committed id itself stays
    assert [r.hgetall(shard_side_key("rd", s)) for s in shards] == [{b"": b"1004-0"}] * 2


def test_stream_level_of_a_reader(r: redis.Redis, redis_url: str) -> None:
    _fill(r, "s", 1000, 100)
    _commit(_reader(redis_url, "slow", ("slow", "fast")), "1010-0")
    _commit(_reader(redis_url, "fast", ("slow", "fast")), "1090-0")
    whole = stream_level(r, ("s",), BP)
    assert whole.entries == 89  # 1011-0 .. 1099-0 (1010-0 stays as the slowest's resume point)
    assert stream_level(r, ("s",), BP, reader="slow").as_dict() == {
        **whole.as_dict(),
        "reader": "slow",
    }
    fast = stream_level(r, ("s",), BP, reader="fast")
    assert fast.entries == 9  # 1091-0 .. 1099-0: arrival was uniform here, so exact
    assert 0 < fast.bytes < whole.bytes / 5
    # The source's own client leaves XRANGE replies unparsed; the level is the same.
    assert stream_level(raw_client(redis_url), ("s",), BP, reader="fast") == fast
    assert stream_level(r, ("s",), BP, reader="new").entries == 90  # nothing committed yet
    _commit(_reader(redis_url, "fast", ("slow", "fast")), "1099-0")
    assert stream_level(r, ("s",), BP, reader="fast").entries == 0
    assert stream_level(r, ("s", "missing"), BP, reader="fast").entries == 0


def test_readers_on_a_cluster(rc: Any, redis_cluster: LocalCluster) -> None:
    # Each script call touches a shard and its reader hash: one slot, on that shard's master.
    shards = tuple(shard_keys("events", 3, hash_tags=True))
    for s in shards:
        _fill(rc, s, 1000, 10)
    _commit(_reader(redis_cluster.url, "a", ("a", "b"), shards), "1005-0")
    _commit(_reader(redis_cluster.url, "b", ("a", "b"), shards), "1003-0")
    assert [rc.xlen(s) for s in shards] == [7, 7, 7]
    assert stream_level(rc, shards, BP, reader="b").entries == 18  # after its 1003-0
    assert stream_level(rc, shards, BP, reader="a").entries < 18
