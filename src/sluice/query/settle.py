"""Which derived lookups of a batch read their inputs from one state (`sluice.redis.marks`).

A batch of lookups with a derived metric among them reads the write marks before and after its
slices, in the same round trip. A derived lookup is read again, once the marks change, when
its reads may have met a batch's write half done: the marks changed between the two reads, or
a batch was being written and one of its inputs' reads either holds a slice of that batch's
token or carries no token to tell by (merged in Redis, or a HyperLogLog). It waits at most
`SETTLE_S` in all, then answers what it read.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sluice.redis.marks import MARKS

SETTLE_S = 2.0  # how long a derived lookup waits for a batch write it met to end
SETTLE_POLL_S = 0.005  # how often it reads the marks meanwhile
READ_MARKS = ("MGET", *MARKS)


def unsettled(
    metrics: Sequence[str],
    plan: Sequence[tuple[Any, ...]],
    replies: Sequence[Any],
    before: Any,
    after: Any,
    derived: Collection[str],
) -> list[int]:
    """The derived lookups (indices; `metrics`: each lookup's metric) to read again, given the
    plan of the engine's reads (`query.engine.Plan`), their replies and the marks read before
    and after them."""
    if before != after:
        return [n for n, name in enumerate(metrics) if name in derived]
    if before[1] is None:  # no batch was being written
        return []
    mark = bytes(before[1]) + b":"
    again: set[int] = set()
    met: list[bool] = []  # per plan entry: whether its reads met the batch being written
    at = 0
    for n, _m, _cov, count, raw, first in plan:
        if count == 0:  # an earlier entry's reads
            hit = met[first]
        elif not raw:
            hit = True
        else:
            hit = any(s is not None and s.startswith(mark)
                      for r in replies[at : at + count] for s in r)  # fmt: skip
        at += count
        met.append(hit)
        if hit and metrics[n] in derived:
            again.add(n)
    return sorted(again)
