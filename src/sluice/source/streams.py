"""The Redis Streams log: shards are stream keys, positions are entry ids.

A position is the id of the entry before it (`"0-0"` is the beginning), so a span (lo, hi]
reads the entries with lo < id <= hi. After a batch commits, each shard is trimmed with MINID up
to its slowest reader's committed id (`lua/release.lua`); the committed entry itself stays, as
the resume point, which is why the backlog is the stream's length less one when its first entry
is a committed id.

Budgets are counted server-side (`lua/advance.lua`), so only end ids travel to the client. The
audit's source side reads the same ids again in plain XRANGE replies, independently of the
batch's own reads, and counts each entry's events on the client (`audit_event_count`). A
`fields` budget is walked on the client instead (one event per
entry), which also gives the audit's source side; while a batch runs, the entries after its end
are walked ahead for the next plan (`_Ahead`), so that walk is mostly off the batch's path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from sluice.redis.keys import shard_side_key
from sluice.redis.scripts import (
    ADVANCE,
    RELEASE,
    evalsha_on,
    execute_loading,
    script_source,
)
from sluice.source.decode import Decoder
from sluice.source.ids import (
    ZERO_ID,
    entry_id_columns,
    event_ids,
    format_id,
    id_ms,
    parse_id,
    split_range,
    xor_all,
)
from sluice.source.log import Admitted, Backlog, Log, Plan, Position, Span, spread_budget
from sluice.source.options import SourceOptions
from sluice.source.resp import StreamReply
from sluice.source.xrange import (
    forget_client,
    raw_client,
    read_range,
    read_replies,
    xrange_chunk,
)

# Entries per XRANGE call when reading a batch: a `fields` reply is read in columnar form
# (`source.xrange.read_replies`), and larger replies cost fewer round trips; a jsonl entry holds
# hundreds of events, so its replies are already large.
XRANGE_COUNT = {"fields": 10_000, "jsonl": 2000}
# Entries per XRANGE of the audit's own read: a jsonl entry holds hundreds of events and tens of
# KB, so fewer of them keep a reply's memory small.
AUDIT_CHUNK = {"fields": 10_000, "jsonl": 50}
AUDIT_XRANGE_COUNT = AUDIT_CHUNK["fields"]
# The bytes other than b"\n" that Python's bytes.strip removes: a line is blank when it holds
# nothing else.
_BLANK = b" \t\r\x0b\x0c"

log = logging.getLogger(__name__)


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


def _walk(client: Any, shard: str, after: str, limit: int) -> Iterator[tuple[str, Any, Any, Any]]:
    """Up to `limit` `fields` entries of `shard` after `after`, chunk by chunk, as plain XRANGE
    replies parsed by hiredis: (the chunk's last id, entry id columns `ms` and `seq`, event
    ids). Stops early once the stream has no more."""
    end, n = after, 0
    while n < limit:
        want = min(AUDIT_XRANGE_COUNT, limit - n)
        chunk = xrange_chunk(client, shard, end, "+", want)
        if chunk:
            ms, seq = entry_id_columns([e[0] for e in chunk])
            n += len(chunk)
            end = _text(chunk[-1][0])
            yield end, ms, seq, event_ids(ms.astype(np.int64), seq, np.zeros(len(ms)), shard)
        if len(chunk) < want:
            return


def audit_event_count(fields: list[bytes], max_entry_bytes: int) -> int:
    """How many events one `jsonl` entry holds (its flat [name, value, ...] list), for the
    audit: the rule of `values.entry_event_count`, which the decoder uses, written apart from
    it so that the audit does not share the decoder's code. Over `max_entry_bytes` (names and
    values, the last value of a repeated name only): 1. No `d`: 1. Else the lines of `d` (split
    on b"\\n") that hold a byte other than whitespace, or 1 when none does."""
    last = dict(zip(fields[0::2], fields[1::2], strict=True))
    if (
        sum(map(len, fields)) > max_entry_bytes
        and sum(len(k) + len(v) for k, v in last.items()) > max_entry_bytes
    ):
        return 1
    d = last.get(b"d")
    if d is None:
        return 1
    kept = d.translate(None, _BLANK)  # a blank line is now an empty one
    if kept and b"\n\n" not in kept and kept[0] != 10 and kept[-1] != 10:
        return kept.count(b"\n") + 1  # no empty line: every line counts
    return max(1, sum(1 for line in kept.split(b"\n") if line))


@dataclass(frozen=True)
class _Ahead:
    """`fields` entries of one shard walked ahead of the next plan: those after `base`, in
    stream order, as their ids (`ms`, `seq`) and event ids (`ev`). Entries are only appended
    after `base` (trimming stops at the committed id, which is at or before it), so a plan from
    `base` may take a prefix of them as if it had walked them itself."""

    base: str
    ms: Any
    seq: Any
    ev: Any

    def take(self, share: int) -> tuple[_Ahead, str, int, int]:
        """(what is left, end id, entries taken, XOR of their event ids), at most `share`."""
        k = min(share, len(self.ms))
        end = format_id(int(self.ms[k - 1]), int(self.seq[k - 1])) if k else self.base
        rest = _Ahead(end, self.ms[k:], self.seq[k:], self.ev[k:])
        return rest, end, k, xor_all(self.ev[:k])


class RedisStreamsLog(Log):
    OFFSETS_FIELD = "ids"
    kind = "redis"
    origin: ClassVar[Any] = ZERO_ID

    def __init__(self, opts: SourceOptions, client: Any = None) -> None:
        self.opts = opts
        self.shards: tuple[str, ...] = opts.shards
        self._own = client  # used as given (not pickled); else this process's raw client
        self._ahead: dict[str, _Ahead] = {}  # walked ahead of the next plan (`fields`)
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
        ids = {s: start.get(s, ZERO_ID) for s in self.shards}
        admitted: dict[str, list[Any]] = {}
        if self._ahead_walk is not None:
            self._ahead_walk.join()  # its entries are this plan's (or of no use)
            self._ahead_walk = None
        if budget is None:
            end, entries, events, more = self._newest(ids), None, 0, False
        else:
            end, entries, events, more = self._advance(ids, budget, admitted)
        self._ahead = {}
        if budget is not None and self.opts.format == "fields" and end != ids:
            per_shard = -(-budget // len(self.shards))
            self._ahead_walk = threading.Thread(target=self._walk_ahead, args=(end, per_shard),
                                                daemon=True, name="sluice-walk-ahead")  # fmt: skip
            self._ahead_walk.start()
        ref = max(id_ms(v) for v in end.values()) if end else 0
        return Plan(end, {}, entries, events, more, ref, admitted or None)

    def _walk_ahead(self, ends: Mapping[str, str], per_shard: int) -> None:
        """Walk up to `per_shard` `fields` entries after each shard's end, for the next plan
        (`_Ahead`); runs in a thread while the batch just planned runs. A failure only leaves
        the next plan to walk them itself."""
        try:
            client = raw_client(self.opts.url)
            ahead = {}
            for shard, base in ends.items():
                parts = [(ms, seq, ev) for _, ms, seq, ev in _walk(client, shard, base, per_shard)]
                if parts:
                    cols = [np.concatenate([p[i] for p in parts]) for i in range(3)]
                    ahead[shard] = _Ahead(base, *cols)
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
        """Spread `budget` events over the shards (`log.spread_budget`). `jsonl` is counted in
        Redis by advance.lua: only the end ids travel back. `fields` entries are one event each
        and are walked here (`_walk_fields`), which also gives the audit's source side of each
        shard's span: put in `admitted` as [lo, hi, xor (hex), events]."""
        script = self._client().register_script(script_source(ADVANCE))
        new_ids = dict(ids)
        entries = dict.fromkeys(self.shards, 0)
        walked: dict[str, tuple[int, int]] = {}

        def take(shard: str, share: int, first_round: bool) -> tuple[int, bool]:
            if self.opts.format == "fields":
                end, n, more, x = self._walk_fields(shard, new_ids[shard], share)
                acc, total = walked.get(shard, (0, 0))
                walked[shard] = (acc ^ x, total + n)
                new_ids[shard] = end
                entries[shard] += n
                return n, more
            end, n_entries, n_events, more = script(
                keys=[shard], args=[new_ids[shard], share, self.opts.format, int(first_round)]
            )
            end = _text(end)
            if parse_id(end) > parse_id(new_ids[shard]):
                new_ids[shard] = end
            entries[shard] += int(n_entries)
            return int(n_events), bool(int(more))

        events, wanting = spread_budget(budget, self.shards, take)
        for s, (x, n) in walked.items():
            if n:
                admitted[s] = [ids[s], new_ids[s], f"{x:016x}", n]
        return new_ids, entries, events, bool(wanting)

    def _walk_fields(self, shard: str, after: str, share: int) -> tuple[str, int, bool, int]:
        """Up to `share` `fields` entries after `after`: (end id, entries, whether more wait,
        the XOR of their event ids). Read as plain XRANGE replies parsed by hiredis, not by the
        columnar reader the batch itself will use, so the XOR is the audit's source side,
        computed independently of the batch's read (see `planned_source`). Entries walked ahead
        from `after` (`_walk_ahead`) are taken first."""
        client = raw_client(self.opts.url)
        acc = n = left = 0
        end = after
        ahead = self._ahead.get(shard)
        if ahead is not None and ahead.base == after:
            rest, end, n, acc = ahead.take(share)
            self._ahead[shard], left = rest, len(rest.ms)
        for last, _, _, ev in _walk(client, shard, end, share - n):
            acc ^= xor_all(ev)
            n += len(ev)
            end = last
        if n < share:  # caught up with the stream
            return end, n, False, acc
        more = left > 0 or bool(xrange_chunk(client, shard, end, "+", 1))
        return end, n, more, acc

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
        """The XOR of the ids of the events in `spans`, read from the stream again.

        `fields`: every entry is one event (`entry_event_count`), so only the entry ids count.
        They come from plain XRANGE replies parsed by hiredis, in AUDIT_XRANGE_COUNT entries a
        call, so Redis only sends entries (no script turns every field into a Lua string), and
        the parsing is not the columnar reader's that the batch itself used (`read`).
        `jsonl`: the same plain replies, each entry's events counted by `audit_event_count`.
        """
        if self.opts.format == "fields":
            return self._admitted_fields(spans)
        client = raw_client(self.opts.url)
        acc = events = entries = 0
        for span in spans:
            for chunk in read_range(client, span.shard, span.lo, span.hi, AUDIT_CHUNK["jsonl"]):
                counts = np.fromiter(
                    (audit_event_count(e[1], self.opts.max_entry_bytes) for e in chunk),
                    dtype=np.int64, count=len(chunk),
                )  # fmt: skip
                ms, seq = entry_id_columns([e[0] for e in chunk])
                n = int(counts.sum())
                starts = np.cumsum(counts) - counts
                idx = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)
                ids = event_ids(np.repeat(ms.astype(np.int64), counts),
                                np.repeat(seq, counts), idx, span.shard)  # fmt: skip
                acc ^= xor_all(ids)
                events += n
                entries += len(chunk)
        return Admitted(acc, events, entries)

    def planned_source(self, spans: list[Span], end: Mapping[str, Any]) -> Admitted | None:
        """The source side the planner computed for a `fields` batch (`_walk_fields`), logged
        with its end offsets: used when it covers exactly the batch's spans, which a batch
        re-planned from the offset log after a crash does too."""
        planned = end.get("admitted") or {}
        acc = n = 0
        for span in spans:
            got = planned.get(span.shard)
            if got is None or (got[0], got[1]) != (span.lo, span.hi):
                return None
            acc ^= int(got[2], 16)
            n += int(got[3])
        return Admitted(acc, n, n) if spans else None

    def _admitted_fields(self, spans: list[Span]) -> Admitted:
        client = raw_client(self.opts.url)
        acc = n = 0
        for span in spans:
            for chunk in read_range(client, span.shard, span.lo, span.hi, AUDIT_XRANGE_COUNT):
                ms, seq = entry_id_columns([e[0] for e in chunk])
                acc ^= xor_all(event_ids(ms.astype(np.int64), seq, np.zeros(len(ms)), span.shard))
                n += len(chunk)
        return Admitted(acc, n, n)

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
                ids = set(committed.values())
                share = 1.0
                n = int(length) - (first_text in ids)
            else:
                own = committed.get(reader)
                share = backlog_share(own, first_id, last_id)
                n = round((int(length) - (first_text is not None and own == first_text)) * share)
            per[s] = max(0, n)
            total_bytes += round(int(size or 0) * share)
        detail = {} if reader is None else {"reader": reader}
        return Backlog(sum(per.values()), total_bytes, per, detail)

    # -- housekeeping -------------------------------------------------------------------------

    def release(self, end: Mapping[str, Position]) -> None:
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

        execute_loading(client, run, (RELEASE,))

    # -- executor side ------------------------------------------------------------------------

    def read(
        self, span: Span, ref_ms: int, on_wait: Callable[[str, str], None] | None = None
    ) -> Iterator[pa.RecordBatch]:
        decoder = Decoder(self.opts, ref_ms, span.shard)
        fmt, url = self.opts.format, self.opts.url
        count = XRANGE_COUNT[fmt]
        if fmt != "fields":
            for chunk in read_range(raw_client(url), span.shard, span.lo, span.hi, count):
                yield from decoder.decode(chunk)
            return
        for part in read_replies(url, span.shard, span.lo, span.hi, count):
            if isinstance(part, StreamReply):
                yield from decoder.decode_reply(part)
            else:
                yield from decoder.decode(part)

    def close(self) -> None:
        forget_client(self.opts.url)
