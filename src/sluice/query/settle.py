"""Which derived lookups of a batch read their inputs from one state (`sluice.redis.marks`).

A batch of lookups with a derived metric among them reads the write marks in a round trip
before its slice reads and in one after them (on a Redis Cluster the marks and the slices live
on different nodes, so only separate round trips order them). A derived lookup is read again,
once the marks change, when its reads may have met a batch's write half done: a write began and
ended between the two reads of the marks (the count grew by more than the writes seen to begin
and end), or one of its inputs' reads holds a slice of a write in flight at either read, or a
write was in flight and an input carries no token to tell by (merged in Redis, a HyperLogLog).
It waits at most `SETTLE_S` in all, then answers what it read.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sluice.redis.marks import Marks, token_of

SETTLE_S = 2.0  # how long a derived lookup waits for a batch write it met to end
SETTLE_POLL_S = 0.005  # how often it reads the marks meanwhile


def unsettled(
    metrics: Sequence[str],
    plan: Sequence[tuple[Any, ...]],
    replies: Sequence[Any],
    before: Marks,
    after: Marks,
    derived: Collection[str],
) -> list[int]:
    """The derived lookups (indices; `metrics`: each lookup's metric) to read again, given the
    plan of the engine's reads (`query.engine.Plan`), their replies and the marks read before
    and after them."""
    (made, was), (now, is_) = before, after
    if now - made != len(is_ - was) + len(was - is_):  # a write began and ended unseen
        return [n for n, name in enumerate(metrics) if name in derived]
    in_flight = was | is_
    if not in_flight:
        return []
    marks = tuple({token_of(field) + b":" for field in in_flight})
    again: set[int] = set()
    met: list[bool] = []  # per plan entry: whether its reads met a write in flight
    at = 0
    for n, _m, _cov, count, raw, first in plan:
        if count == 0:  # an earlier entry's reads
            hit = met[first]
        elif not raw:
            hit = True
        else:
            hit = any(s is not None and s.startswith(marks)
                      for r in replies[at : at + count] for s in r)  # fmt: skip
        at += count
        met.append(hit)
        if hit and metrics[n] in derived:
            again.add(n)
    return sorted(again)
