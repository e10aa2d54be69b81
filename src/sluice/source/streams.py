"""The Redis Streams log: shards are stream keys, positions are entry ids.

A position is the id of the entry before it (`"0-0"` is the beginning), so a span (lo, hi]
reads the entries with lo < id <= hi. After a batch commits, each shard is trimmed with MINID up
to its slowest reader's committed id (`lua/release.lua`); the committed entry itself stays, as
the resume point, which is why the backlog is the stream's length less one when its first entry
is a committed id.

Budgets are counted on the client (`source.walk`): each plan walks its entries in plain XRANGE
replies parsed by hiredis, counting each entry's events, and logs the XOR of their event ids with
the offsets as the audit's source side, computed independently of the batch's own reads. While a
batch runs, the entries after its end are walked ahead for the next plan (`_Ahead`), so the walk
is mostly off the batch's path. A `jsonl` payload thus travels to the client twice (the walk and
the batch's read), and Redis spends only the XRANGE replies on it: a server-side count held
Redis's one thread for the whole walk (70-170 ms of a 500,000-event batch).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import pyarrow as pa
import redis

from sluice.errors import ConfigError
from sluice.redis.connection import redact
from sluice.redis.keys import shard_side_key
from sluice.redis.loading import LOADING, is_loading
from sluice.redis.scripts import (
    RELEASE,
    evalsha_on,
    execute_loading,
)
from sluice.source.decode import Decoder
from sluice.source.ids import (
    ZERO_ID,
    id_ms,
    parse_id,
    split_range,
)
from sluice.source.log import (
    Admitted,
    Backlog,
    Log,
    LogUnavailable,
    Plan,
    Position,
    Span,
    spread_budget,
)
from sluice.source.options import SourceOptions
from sluice.source.resp import StreamReply
from sluice.source.walk import WALK_CHUNK, Walked, read_entries, walk
from sluice.source.xrange import (
    forget_client,
    raw_client,
    read_range,
    read_replies,
)

# Entries per XRANGE call when reading a batch: a `fields` reply is read in columnar form
# (`source.xrange.read_replies`), and larger replies cost fewer round trips; a jsonl entry holds
# hundreds of events, so its replies are already large.
XRANGE_COUNT = {"fields": 10_000, "jsonl": 2000}
log = logging.getLogger(__name__)


def _quiet(message: str) -> None:
    """Waiting for a loading Redis without reporting it (the wait is logged)."""


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _entry_id(reply: Any) -> Any:
    """The id of the one entry of an XRANGE/XREVRANGE ... COUNT 1 reply, parsed or raw."""
    return reply[0][0] if reply else None


def backlog_share(
    offset_id: str | bytes | None, first_id: str | bytes | None, last_id: str | bytes | None
) -> float:
    """The fraction of a stream after `offset_id`, by entry time: the share of the span from
    the first to the last entry's ms that lies after the offset. 1 with no offset (nothing
    committed) or when all entries share one ms; 0 when the stream is empty or the offset is at
    or past its last entry."""
    if first_id is None or last_id is None:
        return 0.0
    if offset_id is None:
        return 1.0
    offset, first, last = parse_id(offset_id), parse_id(first_id), parse_id(last_id)
    if offset >= last:
        return 0.0
    if last[0] == first[0]:
        return 1.0
    share = (last[0] - max(offset[0], first[0])) / (last[0] - first[0])
    return min(1.0, max(0.0, share))


@dataclass(frozen=True)
class _Ahead:
    """Entries of one shard already read after `base`, in stream order, none left out: walked
    ahead of the next plan, or read past a take's end. Entries are only appended after `base`
    (trimming stops at the committed id, which is at or before it), so a plan from `base` may
    take a prefix of them as if it had read them itself."""

    base: str
    walked: Walked


class RedisStreamsLog(Log):
    OFFSETS_FIELD = "ids"
    kind = "redis"
    origin: ClassVar[Any] = ZERO_ID

    def __init__(self, opts: SourceOptions, client: Any = None) -> None:
        self.opts = opts
        self.shards: tuple[str, ...] = opts.shards
        self._own = client  # used as given (not pickled); else this process's raw client
        self._ahead: dict[str, _Ahead] = {}  # walked ahead of the next plan
        self._ahead_walk: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_own": None, "_ahead": {}, "_ahead_walk": None}

    def _client(self) -> Any:
        return self._own if self._own is not None else raw_client(self.opts.url)

    @staticmethod
    def before(a: Position, b: Position) -> bool:
        return parse_id(a) < parse_id(b)

    # -- planning ---------------------------------------------------------------------------

    def start_positions(self) -> dict[str, Position]:
        return dict.fromkeys(self.shards, ZERO_ID)

    def plan(self, start: Mapping[str, Position], budget: int | None, ref_ms: int) -> Plan:
        """Raises LogUnavailable (`loading`) while Redis loads its dataset: the reader plans no
        batch and shows the log as waiting. A failed plan leaves what it walked for the next."""
        try:
            return self._plan(start, budget)
        except (redis.exceptions.ConnectionError, redis.exceptions.ResponseError) as e:
            if is_loading(e):
                raise self._loading(e) from None
            raise

    def _loading(self, e: Exception) -> LogUnavailable:
        return LogUnavailable(
            LOADING, f"redis at {redact(self.opts.url)} is loading its dataset: {e}"
        )

    def _plan(self, start: Mapping[str, Position], budget: int | None) -> Plan:
        self._check_dropped(start)
        ids = {s: start.get(s, ZERO_ID) for s in self.shards}
        admitted: dict[str, list[Any]] = {}
        if self._ahead_walk is not None:
            self._ahead_walk.join()  # its entries are this plan's (or of no use)
            self._ahead_walk = None
        if budget is None:
            end, entries, events, more = self._newest(ids), None, 0, False
        else:
            end, entries, events, more = self._advance(ids, budget, admitted)
        if budget is not None and end != ids:
            # Up to twice a shard's even share, so that a shard that takes more than its share
            # (keys are rarely even) mostly finds its entries walked too.
            target = min(budget, 2 * -(-budget // len(self.shards)))
            self._ahead_walk = threading.Thread(target=self._walk_ahead, args=(end, target),
                                                daemon=True, name="sluice-walk-ahead")  # fmt: skip
            self._ahead_walk.start()
        ref = max(id_ms(v) for v in end.values()) if end else 0
        return Plan(end, {}, entries, events, more, ref, admitted or None)

    def _check_dropped(self, start: Mapping[str, Position]) -> None:
        """A shard that the checkpoint read and the config no longer names (`source.shards`
        lowered) is never read again: raise ConfigError while it holds entries after the
        position read, rather than leave them unread. More shards need nothing: a shard the
        checkpoint does not name is read from its start."""
        dropped = sorted(s for s in start if s not in self.shards)
        if not dropped:
            return
        pipe = self._client().pipeline(transaction=False)
        for s in dropped:
            pipe.execute_command("XRANGE", s, f"({start[s]}", "+", "COUNT", 1)
        unread = [s for s, after in zip(dropped, pipe.execute(), strict=True) if after]
        if unread:
            raise ConfigError(
                f"lowered to {len(self.shards)} while {', '.join(unread)} still hold entries this"
                f" pipeline has not read; run with the old count until they are read (the backlog"
                f" is 0) and no producer writes to them, then lower it",
                "source.shards",
            )

    def _walk_ahead(self, ends: Mapping[str, str], target: int) -> None:
        """Walk the entries after each shard's end until `target` events of them are walked,
        for the next plan (`_Ahead`); runs in a thread while the batch just planned runs. What
        the plan read past its end counts. A failure only leaves the next plan to walk them."""
        try:
            client = raw_client(self.opts.url)
            fmt, limit = self.opts.format, self.opts.max_entry_bytes
            ahead = {}
            for shard, base in ends.items():
                known = self._ahead.get(shard)
                walked = known.walked if known is not None and known.base == base else Walked.none()
                if walked.total < target:
                    cursor = walked.last_id() if len(walked) else base
                    more = read_entries(client, shard, cursor, target - walked.total, fmt, limit)
                    walked = Walked.join([walked, more])
                ahead[shard] = _Ahead(base, walked)
            self._ahead = ahead
        except Exception as e:  # noqa: BLE001 - the next plan walks the entries itself
            log.debug("walking ahead failed", extra={"error": str(e)})

    def _newest(self, ids: dict[str, str]) -> dict[str, str]:
        pipe = self._client().pipeline(transaction=False)
        for s in self.shards:
            pipe.execute_command("XREVRANGE", s, "+", "-", "COUNT", 1)
        out = dict(ids)
        for s, last in zip(self.shards, pipe.execute(), strict=True):
            if last and parse_id(last[0][0]) > parse_id(ids[s]):
                out[s] = _text(last[0][0])
        return out

    def _advance(
        self, ids: dict[str, str], budget: int, admitted: dict[str, list[Any]]
    ) -> tuple[dict[str, str], dict[str, int], int, bool]:
        """Spread `budget` events over the shards (`log.spread_budget`), walking each shard's
        entries (`_take`), which also gives the audit's source side of each shard's span: put
        in `admitted` as [lo, hi, xor (hex), events, entries]."""
        new_ids = dict(ids)
        walked: dict[str, list[Walked]] = {s: [] for s in self.shards}

        def take(shard: str, share: int, first_round: bool) -> tuple[int, bool]:
            got, more = self._take(shard, new_ids[shard], share, first_round)
            if len(got):
                walked[shard].append(got)
                new_ids[shard] = got.last_id()
            return got.total, more

        events, wanting = spread_budget(budget, self.shards, take)
        entries = {}
        for s, parts in walked.items():
            got = Walked.join(parts)
            entries[s] = len(got)
            if len(got):
                admitted[s] = [ids[s], new_ids[s], f"{got.xor():016x}", got.total, len(got)]
        return new_ids, entries, events, bool(wanting)

    def _take(self, shard: str, after: str, share: int, force_first: bool) -> tuple[Walked, bool]:
        """The entries after `after` that fit in `share` events (`walk.walk`), and whether more
        wait. Entries already read after `after` (walked ahead, or read past an earlier take's
        end) are taken first, and what this take reads past its end is kept for the next."""
        known = self._ahead.get(shard)
        read = known.walked if known is not None and known.base == after else None
        fmt, limit = self.opts.format, self.opts.max_entry_bytes
        taken, rest = walk(raw_client(self.opts.url), shard, after, share, force_first, fmt, limit,
                           read)  # fmt: skip
        self._ahead[shard] = _Ahead(taken.last_id() if len(taken) else after, rest)
        return taken, bool(len(rest))

    def split(self, span: Span, entries: int | None, parts: int) -> list[Span]:
        return [Span(span.shard, a, b) for a, b in split_range(span.lo, span.hi, parts)]

    def count_entries(self, span: Span) -> int:
        """The stream's length: an upper bound, since it is trimmed after every commit."""
        try:
            return int(self._client().xlen(span.shard))
        except Exception:  # noqa: BLE001 - an estimate only; one partition is always correct
            return 0

    # -- the audit's source side --------------------------------------------------------------

    def admitted(self, spans: list[Span]) -> Admitted:
        """The XOR of the ids of the events in `spans`, read from the stream again, as a plan's
        walk reads them (`walk.Walked`): for a batch planned without a budget, or whose plan
        logged no source side."""
        client = raw_client(self.opts.url)
        acc = events = entries = 0
        fmt, limit = self.opts.format, self.opts.max_entry_bytes
        for span in spans:
            chunks = read_range(client, span.shard, span.lo, span.hi, WALK_CHUNK[fmt], _quiet)
            for chunk in chunks:
                got = Walked.of(chunk, span.shard, fmt, limit)
                acc ^= got.xor()
                events += got.total
                entries += len(got)
        return Admitted(acc, events, entries)

    # -- backlog ------------------------------------------------------------------------------

    def level(self, reader: str | None = None) -> Backlog:
        """Entries and bytes not yet committed, in one pipelined round trip.

        Without `reader`: the slowest reader's backlog, exact (the stream is trimmed at it).
        With `reader`: that reader's own. For the slowest one the stream is exact; for a faster
        one the part after its committed id is an estimate by entry-id time (`backlog_share`),
        exact only if entries arrived uniformly over time. A reader that has not committed yet
        counts the whole stream.
        """
        pipe = self._client().pipeline(transaction=False)
        for s in self.shards:
            pipe.xlen(s)
            # SAMPLES 0: every node of the stream. The default (5 sampled nodes) was measured
            # off by 0.4x to 2.7x on backlogs of large jsonl entries; all nodes cost µs each.
            pipe.execute_command("MEMORY", "USAGE", s, "SAMPLES", 0)
            pipe.execute_command("XRANGE", s, "-", "+", "COUNT", 1)
            pipe.execute_command("XREVRANGE", s, "+", "-", "COUNT", 1)
            pipe.hgetall(shard_side_key("rd", s))
        res = pipe.execute()
        per: dict[str, int] = {}
        total_bytes = 0
        for i, s in enumerate(self.shards):
            length, size, first, last, rd = res[5 * i : 5 * i + 5]
            committed = {_text(k): _text(v) for k, v in rd.items()}
            first_id, last_id = _entry_id(first), _entry_id(last)
            first_text = None if first_id is None else _text(first_id)
            if reader is None:
                share = 1.0
                done = first_text in set(committed.values())
            else:
                own = committed.get(reader)
                share = backlog_share(own, first_id, last_id)
                done = first_text is not None and own == first_text
            # The stream keeps the last committed entry (it is trimmed up to it): that entry,
            # and the bytes it holds in the stream's share, are not backlog.
            after = max(0, int(length) - done)
            per[s] = round(after * share)
            total_bytes += round(int(size or 0) * share * after / length) if length else 0
        detail = {} if reader is None else {"reader": reader}
        return Backlog(sum(per.values()), total_bytes, per, detail)

    # -- housekeeping -------------------------------------------------------------------------

    def release(self, end: Mapping[str, Position], reset: Sequence[str] = ()) -> None:
        """Record this reader's committed ids and trim each shard up to the slowest reader of
        it (see release.lua; idempotent)."""
        client = self._client()
        released = {s: last for s, last in end.items() if last != ZERO_ID}
        if not released:
            return

        def run() -> Any:
            pipe = client.pipeline(transaction=False)
            for shard, last in released.items():
                keys = [shard, shard_side_key("rd", shard)]
                names = self.opts.readers_of(shard)
                evalsha_on(pipe, RELEASE, keys, [self.opts.reader, last, *names])
            return pipe.execute()

        try:
            execute_loading(client, run, (RELEASE,))
        except (redis.exceptions.ConnectionError, redis.exceptions.ResponseError) as e:
            if is_loading(e):
                raise self._loading(e) from None
            raise

    # -- executor side ------------------------------------------------------------------------

    def read(
        self, span: Span, ref_ms: int, on_wait: Callable[[str, str], None] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """Reads wait while Redis loads its dataset, reporting it as `on_wait("loading", ..)`."""
        decoder = Decoder(self.opts, ref_ms, span.shard)
        fmt, url = self.opts.format, self.opts.url
        count = XRANGE_COUNT[fmt]
        waiting = _quiet if on_wait is None else partial(on_wait, LOADING)
        if fmt != "fields":
            chunks = read_range(raw_client(url), span.shard, span.lo, span.hi, count, waiting)
            for chunk in chunks:
                yield from decoder.decode(chunk)
            return
        for part in read_replies(url, span.shard, span.lo, span.hi, count, waiting):
            if isinstance(part, StreamReply):
                yield from decoder.decode_reply(part)
            else:
                yield from decoder.decode(part)

    def close(self) -> None:
        forget_client(self.opts.url)
