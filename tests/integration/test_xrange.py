"""Reading a stream's spans as raw, columnar XRANGE replies (`source.xrange.read_replies`)
against a real Redis and a real Redis Cluster: the same rows as the hiredis path, in chunks,
with values the columnar parser declines, and through errors and lost connections."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
import redis

from sluice.graph import StreamsSpec
from sluice.redis.local_cluster import LocalCluster
from sluice.source.decode import Decoder
from sluice.source.log import Span
from sluice.source.options import SourceOptions
from sluice.source.resp import StreamReply
from sluice.source.streams import RedisStreamsLog
from sluice.source.xrange import _raw_for, forget_client, raw_client, read_range, read_replies
from tests.integration.helpers import same_plan

REF_MS = 1_700_000_999_000


def _opts(url: str, shard: str = "s") -> SourceOptions:
    return SourceOptions(
        url=url,
        log=StreamsSpec((shard,)),
        format="fields",
        fields=(("n", "long", True), ("card", "string", False)),
        time_field=None,
        max_events_per_batch=None,
        max_string_bytes=64,
    )


def _fill(r: Any, shard: str, n: int, odd: dict[int, dict[str, Any]] | None = None) -> str:
    last = b""
    for i in range(n):
        last = r.xadd(shard, (odd or {}).get(i, {"n": i, "card": f"c{i % 7}"}))
    return last.decode()


def _hiredis_rows(url: str, shard: str, last: str) -> pa.Table:
    dec = Decoder(_opts(url, shard), REF_MS, shard)
    chunks = read_range(raw_client(url), shard, "0-0", last, 1000)
    return pa.Table.from_batches([b for c in chunks for b in dec.decode(c)])


def _rows(url: str, shard: str, last: str) -> pa.Table:
    log = RedisStreamsLog(_opts(url, shard))
    return pa.Table.from_batches(list(log.read(Span(shard, "0-0", last), REF_MS)))


def test_columnar_reads_give_the_hiredis_rows(r: redis.Redis, redis_url: str) -> None:
    odd = {3: {"n": "x", "card": "c"}, 5: {"card": "a\r\nb"}, 8: {"n": 1, "card": "$5\r\n"}}
    last = _fill(r, "s", 25_000, odd)
    parts = list(read_replies(redis_url, "s", "0-0", last, 10_000))
    assert [len(p) for p in parts] == [10_000, 10_000, 5_000]
    assert not isinstance(parts[0], StreamReply)  # entry 5 holds a CRLF: hiredis reads it
    assert all(isinstance(p, StreamReply) for p in parts[1:])
    got = _rows(redis_url, "s", last)
    assert got.num_rows == 25_000
    assert got.equals(_hiredis_rows(redis_url, "s", last))


def test_an_error_reply_is_raised_through_the_client(r: redis.Redis, redis_url: str) -> None:
    r.set("not-a-stream", "x")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        list(read_replies(redis_url, "not-a-stream", "0-0", "+", 100))


def test_a_lost_connection_is_read_again(r: redis.Redis, redis_url: str) -> None:
    last = _fill(r, "s", 50)
    list(read_replies(redis_url, "s", "0-0", last, 100))  # makes the raw connection
    assert _raw_for(redis_url, "s").conn._sock is not None
    r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert sum(len(p) for p in read_replies(redis_url, "s", "0-0", last, 100)) == 50
    forget_client(redis_url)


def test_columnar_reads_on_a_cluster(rc: Any, redis_cluster: LocalCluster) -> None:
    url = redis_cluster.url
    shard = "events:{3}"
    last = _fill(rc, shard, 3_000)
    got = _rows(url, shard, last)
    assert got.num_rows == 3_000
    assert got.equals(_hiredis_rows(url, shard, last))
    forget_client(url)


@pytest.mark.parametrize("budget", [1, 7, 40, 41, 100])
def test_a_fields_budget_is_planned_exactly(r: redis.Redis, redis_url: str, budget: int) -> None:
    """advance.lua's count of `fields` entries, from the stream's length when nothing but the
    start entry lies before the start (fresh, or trimmed there), else walking the entries."""
    ids = [r.xadd("s", {"n": i, "card": "c"}).decode() for i in range(41)]
    log = RedisStreamsLog(_opts(redis_url))

    def end_after(start: str) -> tuple[str, int, bool]:
        plan = log.plan({"s": start}, budget, 0)
        return plan.end["s"], plan.events, plan.more

    def expected(start: str) -> tuple[str, int, bool]:
        after = ids[ids.index(start) + 1 :] if start in ids else ids
        took = after[: max(budget, 1)]
        return (took[-1] if took else start), len(took), len(after) > len(took)

    assert end_after("0-0") == expected("0-0")  # before the first entry
    r.xtrim("s", minid=ids[10])  # trimmed at a committed entry: it stays, as the start
    assert end_after(ids[10]) == expected(ids[10])
    assert end_after(ids[20]) == expected(ids[20])  # older entries kept: the walk
    assert end_after(ids[-1]) == (ids[-1], 0, False)  # nothing new


def test_planning_a_fields_budget_gives_the_audits_source_side(
    r: redis.Redis, redis_url: str
) -> None:
    """The planner walks a `fields` budget's entries and logs their XOR; it must be what the
    audit would read from the stream, and it is used only for exactly the spans it covers."""
    ids = [r.xadd("s", {"n": i, "card": "c"}).decode() for i in range(30)]
    log = RedisStreamsLog(_opts(redis_url))
    plan = log.plan({"s": ids[4]}, 20, 0)
    assert plan.admitted is not None and plan.admitted["s"][:2] == [ids[4], ids[24]]
    end = {"ids": plan.end, "admitted": plan.admitted}
    spans = log.spans({"ids": {"s": ids[4]}}, end)
    planned = log.planned_source(spans, end)
    assert planned == log.admitted(spans) and planned is not None and planned.events == 20
    other = log.spans({"ids": {"s": ids[5]}}, end)  # not the span it was planned for
    assert log.planned_source(other, end) is None


def _two_shard_opts(url: str) -> SourceOptions:
    return SourceOptions(
        url=url,
        log=StreamsSpec(("a", "b")),
        format="fields",
        fields=(("n", "long", True), ("card", "string", False)),
        time_field=None,
        max_events_per_batch=None,
        max_string_bytes=64,
    )


@pytest.mark.parametrize("budget", [10, 25, 60, 400])
def test_entries_walked_ahead_plan_as_if_walked_then(
    r: redis.Redis, redis_url: str, budget: int
) -> None:
    """After a `fields` plan, the entries after its end are walked in a thread for the next
    plan; that plan (ends, counts, whether more wait, the audit's source side) is the one a
    plan walking them itself makes, with entries added meanwhile, uneven shards, and a start
    that is not where the walk began."""
    _fill(r, "a", 120)
    _fill(r, "b", 30)
    log = RedisStreamsLog(_two_shard_opts(redis_url))
    plan = same_plan(log, {}, budget)
    assert log._ahead_walk is not None  # walking ahead from the plan's end
    _fill(r, "a", 15)  # arrives while the batch would run: after what was walked, or not
    _fill(r, "b", 40)
    for _ in range(100):  # until the streams are drained
        before = plan.end
        plan = same_plan(log, plan.end, budget)
        if plan.end == before:
            break
    assert plan.end["a"] == r.xrevrange("a", count=1)[0][0].decode()
    first = r.xrange("a", count=3)
    other = {"a": first[2][0].decode(), "b": "0-0"}  # not the walk's start: walked anew
    same_plan(log, other, budget)


def test_a_plan_after_walking_ahead_uses_those_entries(r: redis.Redis, redis_url: str) -> None:
    """The next plan takes the entries walked ahead rather than reading them again: with them
    removed from the stream after the walk (which nothing but a user's XDEL does), the plan
    still counts them, so it did not read the stream for them."""
    ids = [x.decode() for x in (r.xadd("a", {"n": i, "card": "c"}) for i in range(20))]
    log = RedisStreamsLog(_two_shard_opts(redis_url))
    plan = log.plan({}, 5, 0)
    assert plan.end["a"] == ids[4]
    assert log._ahead_walk is not None
    log._ahead_walk.join()
    r.xdel("a", ids[6])
    nxt = log.plan(plan.end, 5, 0)
    assert nxt.end["a"] == ids[9] and nxt.events == 5
