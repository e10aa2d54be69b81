"""The marks of the batch writes in flight, for reads that need one state.

A batch's write is many script calls, one metric after another, so while it runs one metric's
hash of a key may hold the batch's events and another's not yet. A lookup of one metric never
sees that: each (metric, key) hash is written by one atomic call. A derived metric reads
several, and a formula over two states of different batches can give a value no stream of
events ever gave (a sum of 0 over a count of 1). So every write task marks its write:

- before it: a field `<token>:<part>` of `WRITING_KEY` (the batch's writer token and the task's
  partition; several folds, their tasks and a deposed leader may write at once), its value the
  time it stops counting (`MARK_TTL_MS` on: a writer that died mid-write holds nothing up for
  long), and `WRITES_KEY` counts one;
- after it, once it succeeded: the field is removed, and `WRITES_KEY` counts one more. A task
  that failed leaves its field: the batch is half written until it is written again (Spark's
  retry of the task has the same partition, the fold's replay the same token), and the fold
  removes any field of the token left once the batch is written and audited (`clear`), and
  counts one for each.

Each pair goes in one pipeline, in that order. A reader (`query.engine`) reads the marks
(`READ`) in a round trip before its slice reads and in one after them. Between the two, each
write that began or ended changed the set of writes in flight and counted one; so when the
count grew by exactly the writes that began and ended, no write began and ended unseen between
them, and the writes its slice reads may have met are the ones in flight at either read. Its
reads are of one state then when none of the slices it read holds one of their tokens (raw
reads carry each slice's token; a HyperLogLog or a slice range merged in Redis carries none,
and then only no write in flight will do). Otherwise it reads again once the marks change
(`query.settle`; docs/metrics.md, "Derived metrics").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sluice.redis.keys import WRITES_KEY, WRITING_KEY

log = logging.getLogger(__name__)

MARK_TTL_MS = 600_000
READ = (("GET", WRITES_KEY), ("HGETALL", WRITING_KEY))  # a reader's two commands
Marks = tuple[int, frozenset[bytes]]  # marks made and removed so far, writes in flight


@contextmanager
def writing(client: Any, token: int, part: str) -> Iterator[None]:
    """Mark a write task's write (token `token`, partition `part`) while the block runs; the
    mark stays when the block raises (the module docstring)."""
    field = f"{token}:{part}"
    pipe = client.pipeline(transaction=False)
    pipe.hset(WRITING_KEY, field, time.time_ns() // 1_000_000 + MARK_TTL_MS)
    pipe.incr(WRITES_KEY)
    pipe.execute()
    yield
    pipe = client.pipeline(transaction=False)
    pipe.hdel(WRITING_KEY, field)
    pipe.incr(WRITES_KEY)
    pipe.execute()


def clear(client: Any, token: int) -> None:
    """Remove the marks of token `token` that failed tasks left (its batch is now written),
    and any that stopped counting. Best effort: they also stop counting by themselves."""
    try:
        now = time.time_ns() // 1_000_000
        left = [f for f, until in client.hgetall(WRITING_KEY).items()
                if token_of(f) == str(token).encode() or int(until) < now]  # fmt: skip
        if left:
            pipe = client.pipeline(transaction=False)
            pipe.hdel(WRITING_KEY, *left)
            pipe.incrby(WRITES_KEY, len(left))  # one for each mark removed, as a write's end
            pipe.execute()
    except Exception:  # Redis went away: they stop counting by themselves
        log.debug("write marks not cleared", exc_info=True)


def parse(replies: list[Any], now_ms: int) -> Marks:
    """`READ`'s replies as (marks made and removed so far, the writes in flight: their fields
    `<token>:<part>`). HGETALL's reply is a dict from redis-py and a flat list from the
    multiplexed client."""
    count, fields = replies
    if isinstance(fields, list):
        fields = dict(zip(fields[::2], fields[1::2], strict=True))
    live = frozenset(bytes(f) for f, until in fields.items() if int(until) >= now_ms)
    return int(count or 0), live


def token_of(field: bytes) -> bytes:
    """The writer token of a write's field (`<token>:<part>`)."""
    return field.split(b":", 1)[0]
