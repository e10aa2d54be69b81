"""A sample of the answers the server gave, logged for `sluice consistency` to recompute.

Which answers: per (metric, key), by hash, as Chronon samples its online/offline consistency
check. A lookup is logged iff `crc32("<metric>|<encoded key>") / 2**32 < rate`, so the same keys
are in the sample on every request, in every worker and on every server, and a key's answers over
time can be compared with the archive's. Derived metrics hash their own name; `series` points
and failed lookups are never logged (the engine only logs answers it returns).

Each logged answer is one `XADD` to `ANSWERS_KEY`, trimmed with `MAXLEN ~ max_entries`: Redis
then drops whole stream nodes only, so the stream may hold up to one node (100 entries by
default, `stream-node-max-entries`) more than `max_entries`. Its fields are strings:

    metric         the metric (or derived) name asked for
    key            JSON list of the key values
    window_ms      the window's length
    end_ms         the window's end (the lookup's `end`, or the server's now)
    value          JSON of the answer's value: a number, null, or {q: value} for quantiles
    covered_start  what the slices read actually covered, [covered_start, covered_end)
    covered_end
    served_ms      the server's clock when it answered

Logging never fails a request: `send` and `asend` log their errors at debug and return. The
XADDs carry values computed from the request's own replies, so they cannot ride on its
pipeline. On asyncio (the server), `asend` queues them without waiting for their reply, so the
request waits for no round trip of theirs (with a `MuxClient` they leave in the connection's
next write, together with other requests' commands); the blocking `send` writes them in one
more round trip after the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from zlib import crc32

import orjson
import redis

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.query.wire import aexecute
from sluice.redis.keys import ANSWERS_KEY, encode_key

if TYPE_CHECKING:
    from sluice.query.engine import Lookup

log = logging.getLogger(__name__)

Entry = dict[str, str | int]
_JSON = orjson.OPT_SERIALIZE_NUMPY  # as the server serialises the answer itself


def sampled(metric: str, encoded_key: str, rate: float) -> bool:
    """Whether answers for (metric, key) are in a sample of `rate` (the rule the server uses;
    `sluice consistency` and tests may use it to tell which keys to expect)."""
    return crc32(f"{metric}|{encoded_key}".encode()) / 2**32 < rate


class AnswerLog:
    """Picks the sampled answers of a batch of lookups and writes them to the answers stream.

    Safe to share across requests and event loops; holds only the rate, the bound, the clock
    and the writes still in flight (so that they are not garbage-collected mid-way).
    """

    def __init__(self, rate: float, max_entries: int, clock: Clock = SYSTEM_CLOCK) -> None:
        """`rate`: the share of keys logged, 0 to 1 (`server.log_answers`, validated there);
        `max_entries`: the stream's bound (`server.log_answers_max`)."""
        self.rate = rate
        self.max_entries = max_entries
        self.clock = clock
        self._every = rate >= 1.0
        # crc / 2**32 < rate  <=>  crc < rate * 2**32, exactly: both sides only scale by 2**32.
        self._limit = rate * 2**32
        self._pending: set[asyncio.Future[Any]] = set()

    @classmethod
    def from_config(cls, cfg: Config, clock: Clock = SYSTEM_CLOCK) -> AnswerLog | None:
        """The server's log per `server.log_answers`; None when it is 0 (off)."""
        if cfg.server.log_answers <= 0:
            return None
        return cls(cfg.server.log_answers, cfg.server.log_answers_max, clock)

    def pick(self, lookups: Sequence[Lookup], answers: Sequence[dict[str, Any]]) -> list[Entry]:
        """The entries of the sampled lookups among `lookups` and their `answers` (in the same
        order). Called on the request's path: an unsampled lookup costs one crc32 of its metric
        and encoded key."""
        every, limit = self._every, self._limit
        out: list[Entry] = []
        served_ms = 0
        at = -1
        for lk in lookups:  # not zip(): on one lookup, its iterator costs more than the hash
            at += 1
            if not every:
                # `encode_key` escapes each value with four str.replace; a key with none of
                # `%|{}` in its values is its own encoding, found at a fifth of the cost.
                key = lk.key
                encoded = key[0] if len(key) == 1 else "|".join(key)
                if (
                    "%" in encoded
                    or "{" in encoded
                    or "}" in encoded
                    or ("|" in encoded and encoded.count("|") >= len(key))
                ):
                    encoded = encode_key(key)
                if crc32(f"{lk.metric}|{encoded}".encode()) >= limit:
                    continue
            answer = answers[at]
            if not out:
                served_ms = self.clock.now_ms()
            out.append(
                {
                    "metric": lk.metric,
                    "key": orjson.dumps(list(lk.key)).decode(),
                    "window_ms": lk.window_ms,
                    "end_ms": lk.end_ms,
                    "value": orjson.dumps(answer["value"], option=_JSON).decode(),
                    "covered_start": answer["covered_start"],
                    "covered_end": answer["covered_end"],
                    "served_ms": served_ms,
                }
            )
        return out

    def command(self, entry: Entry) -> tuple[Any, ...]:
        """The XADD of one entry, as arguments for a pipeline or `Commands`."""
        fields = [part for item in entry.items() for part in item]
        return ("XADD", ANSWERS_KEY, "MAXLEN", "~", self.max_entries, "*", *fields)

    def send(self, client: Any, entries: Sequence[Entry]) -> None:
        """Write `entries` with a sync client, in one pipelined round trip. Blocks for it;
        never raises (errors are logged at debug)."""
        if not entries:
            return
        try:
            pipe = client.pipeline(transaction=False)
            for entry in entries:
                pipe.execute_command(*self.command(entry))
            pipe.execute()
        except (redis.RedisError, redis.exceptions.RedisClusterException) as e:
            log.debug("answers not logged: %s", e)

    def asend(self, aclient: Any, entries: Sequence[Entry]) -> None:
        """Queue `entries` on an asyncio client (`MuxClient` or redis-py's) and return at once,
        on the running loop: nobody waits for the reply. Never raises."""
        if not entries:
            return
        try:
            task = asyncio.ensure_future(aexecute(aclient, [self.command(e) for e in entries]))
        except RuntimeError as e:  # no running loop
            log.debug("answers not logged: %s", e)
            return
        self._pending.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[Any]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("answers not logged: %s", task.exception())
