"""The mark of the batch whose slices are being written, for reads that need one state.

A batch's write is many script calls, one metric after another, so while it runs one metric's
hash of a key may hold the batch's events and another's not yet. A lookup of one metric never
sees that: each (metric, key) hash is written by one atomic call. A derived metric reads
several, and a formula over two states of different batches can give a value no stream of
events ever gave (a sum of 0 over a count of 1). So the fold marks each write:

- before it: `WRITING_KEY` holds the batch's token (with an expiry, `MARK_TTL_MS`, so that a
  writer that died mid-write holds nothing up for long), and `WRITES_KEY` counts one;
- after it: the token is removed, and `WRITES_KEY` counts one more.

Each pair goes in one pipeline, in that order: any interleaving with a reader's two reads of
the marks changes what it reads, so a begin and an end between them are never missed.

A reader (`query.engine`) reads both marks before and after its reads, in the same round trip.
Its reads are of one state when the marks did not change between the two and either no batch
was being written, or none of the slices it read holds that batch's token (raw reads carry
each slice's token; a HyperLogLog or a slice range merged in Redis carries none, and then only
the first case will do). Otherwise it reads again once the marks change (docs/metrics.md,
"Derived metrics").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from sluice.redis.keys import WRITES_KEY, WRITING_KEY

log = logging.getLogger(__name__)

MARK_TTL_MS = 120_000
MARKS = (WRITES_KEY, WRITING_KEY)  # what a reader reads, with MGET (one slot: `{stats}`)
T = TypeVar("T")


def writing(client: Any, token: int, write: Callable[[], T]) -> T:
    """Run `write` (a batch's write of token `token`) between the marks of the module."""
    pipe = client.pipeline(transaction=False)
    pipe.set(WRITING_KEY, str(token), px=MARK_TTL_MS)
    pipe.incr(WRITES_KEY)
    pipe.execute()
    try:
        return write()
    finally:
        try:
            pipe = client.pipeline(transaction=False)
            pipe.delete(WRITING_KEY)
            pipe.incr(WRITES_KEY)
            pipe.execute()
        except Exception:  # Redis went away: the mark expires by itself
            log.debug("write mark not removed", exc_info=True)
