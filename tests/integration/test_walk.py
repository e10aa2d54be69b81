"""Planning `jsonl` budgets on the client (`source.walk`): entry by entry with the decoder's
event count, the audit's source side logged with the offsets, and entries walked ahead for the
next plan, against a real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from sluice.graph import StreamsSpec
from sluice.source.options import SourceOptions
from sluice.source.streams import RedisStreamsLog
from sluice.source.values import entry_event_count
from tests.integration.helpers import same_plan

# Lines per entry, blank lines and an entry without `d` included (1 event each).
SHAPES: list[dict[str, bytes]] = [
    {"d": b'{"a":1}\n{"a":2}\n{"a":3}', "n": b"3"},
    {"d": b'{"a":1}'},
    {"d": b'{"a":1}\n\n{"a":2}\n \t\n{"a":3}\n{"a":4}\n{"a":5}\n'},
    {"x": b"no d"},
    {"d": b'{"a":1}\n{"a":2}', "n": b"9"},  # `n` is a hint the count does not trust
    {"d": b"\n \n"},
]


def _opts(url: str, shards: tuple[str, ...]) -> SourceOptions:
    return SourceOptions(
        url=url,
        log=StreamsSpec(shards),
        format="jsonl",
        fields=(("a", "long", True),),
        time_field=None,
        max_events_per_batch=None,
        max_string_bytes=64,
    )


def _fill(r: Any, shard: str, n: int, offset: int = 0) -> list[tuple[str, int]]:
    """`n` entries cycling through SHAPES: (id, events) of each."""
    out = []
    for i in range(n):
        shape = SHAPES[(i + offset) % len(SHAPES)]
        entry_id = r.xadd(shard, shape).decode()
        out.append((entry_id, entry_event_count(
            {k.encode(): v for k, v in shape.items()}, "jsonl", 1 << 20)))  # fmt: skip
    return out


@pytest.mark.parametrize("budget", [1, 2, 4, 7, 12, 500])
def test_a_jsonl_budget_is_planned_exactly(r: redis.Redis, redis_url: str, budget: int) -> None:
    """A plan takes the entries that fit in the budget, by the decoder's count of each, and at
    least the first one (an entry over the budget cannot stall the shard); it logs the XOR of
    their event ids, which is what the audit reads from the stream again."""
    entries = _fill(r, "s", 40)
    log = RedisStreamsLog(_opts(redis_url, ("s",)))
    start = "0-0"
    while True:
        plan = log.plan({"s": start}, budget, 0)
        after = entries[[e for e, _ in entries].index(start) + 1 :] if start != "0-0" else entries
        took, total = [], 0
        for entry_id, n in after:
            if took and total + n > budget:
                break
            took.append(entry_id)
            total += n
        end = took[-1] if took else start
        assert (plan.end["s"], plan.events, plan.more) == (end, total, len(took) < len(after))
        if not took:
            break
        assert plan.entries == {"s": len(took)}
        spans = log.spans({"ids": {"s": start}}, {"ids": plan.end})
        planned = log.planned_source(spans, {"ids": plan.end, "admitted": plan.admitted})
        assert planned == log.admitted(spans)
        assert planned is not None and (planned.events, planned.entries) == (total, len(took))
        start = end


@pytest.mark.parametrize("budget", [3, 10, 25, 200])
def test_jsonl_entries_walked_ahead_plan_as_if_walked_then(
    r: redis.Redis, redis_url: str, budget: int
) -> None:
    """After a plan, the entries after its end are walked in a thread for the next plan; that
    plan is the one a plan walking them itself makes, with entries of uneven sizes, entries
    added meanwhile and uneven shards."""
    _fill(r, "a", 60)
    _fill(r, "b", 15, offset=2)
    log = RedisStreamsLog(_opts(redis_url, ("a", "b")))
    plan = same_plan(log, {}, budget)
    assert log._ahead_walk is not None
    _fill(r, "a", 7, offset=1)
    _fill(r, "b", 20, offset=3)
    for _ in range(200):  # until the streams are drained
        before = plan.end
        plan = same_plan(log, plan.end, budget)
        if plan.end == before:
            break
    assert plan.end["a"] == r.xrevrange("a", count=1)[0][0].decode()
    assert plan.end["b"] == r.xrevrange("b", count=1)[0][0].decode()


def test_a_plan_takes_what_the_last_one_read_past_its_end(r: redis.Redis, redis_url: str) -> None:
    """The entry that did not fit a plan's budget, and those walked ahead after it, are not read
    again by the next plan: with them removed from the stream afterwards (which nothing but a
    user's XDEL does), the next plan still counts them."""
    entries = _fill(r, "s", 12)
    log = RedisStreamsLog(_opts(redis_url, ("s",)))
    plan = log.plan({"s": "0-0"}, 4, 0)
    assert plan.end["s"] == entries[1][0] and plan.events == 4  # 3 + 1; the next holds 5
    assert log._ahead_walk is not None
    log._ahead_walk.join()
    r.xdel("s", entries[2][0], entries[3][0])
    nxt = log.plan(plan.end, 6, 0)
    assert (nxt.end["s"], nxt.events) == (entries[3][0], 6)  # 5 + 1, both read before the XDEL
