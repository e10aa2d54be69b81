"""The log: where events wait between the producers and the streaming queries that read them.

Two implementations speak this interface: Redis Streams (`source.streams`, the embedded
default) and Kafka (`source.kafka`). The Spark source, admission control, the completeness
audit, trimming, backlog measurement and the status views use only what is here.

Shards and positions. A log is a set of shards: the keys of a sharded Redis stream, or the
partitions of one Kafka topic (named "0", "1", ...). A *position* is a point between two entries
of a shard, written as the log likes: Redis names it by the id of the entry before it (`"0-0"`
is the beginning), Kafka by the offset of the entry after it (0 is the beginning). A `Span`
[lo, hi) is the entries between two positions. Every read, count and audit is of spans, so a
batch that Spark re-runs after a crash, with the same logged offsets, sees the same entries.

Offsets. The Spark source logs a batch's end as `{<field>: {shard: position}, "ref": ms}` plus,
optionally, `"events"` (the events admitted, counted when a budget applies; it picks the
batch's plan: `spark.single_task_events`), `"entries"` (entries per shard, which sizes the
batch's partitions), `"from"` (shards whose span does not start where the previous batch
ended: a Kafka partition that is new, or whose offsets went back because its topic was
recreated) and `"admitted"` (the audit's source side, when planning computed it:
`Plan.admitted`). `<field>` is the log's
`OFFSETS_FIELD`. `ref` is the batch's reference time, fixed when it is planned.

Entries and events. An entry (a stream entry, a Kafka record) holds one event or, in `jsonl`,
many. Budgets and the audit count events, with the decoder's rule for how many an entry holds.

Where each method runs: `read` on the executors (it must not rely on anything but the plain
options the log was built from); the rest on the driver host. Methods that talk to the log's
server raise `LogUnavailable` when it cannot be reached or the topic is gone; callers keep the
pipeline waiting instead of failing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pyarrow as pa

from sluice.errors import SluiceError

Position = Any  # str for Redis Streams, int for Kafka


class LogUnavailable(SluiceError):
    """The log cannot be read now: its server is unreachable, or the topic does not exist.

    `reason` is a short machine-readable word (`unreachable`, `no_topic`); the message says what
    to check. Transient: the pipeline waits and tries again.
    """

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class Span:
    """The entries of one shard between positions lo (exclusive side) and hi."""

    shard: str
    lo: Position
    hi: Position


@dataclass(frozen=True)
class Plan:
    """How far a batch may go: the end positions, the spans that start elsewhere than the
    previous end (`first`), entries and events admitted, and whether a budget held data back.
    `admitted`: the audit's source side per shard, when planning read it (see
    `Log.planned_source`); logged with the end positions."""

    end: dict[str, Position]
    first: dict[str, Position]
    entries: dict[str, int] | None
    events: int
    more: bool
    ref_ms: int
    admitted: dict[str, Any] | None = None


@dataclass(frozen=True)
class Backlog:
    """Entries and bytes waiting in the log for a reader, in all and per shard. `detail`
    says how it was measured (`reader`; Kafka: `bytes_estimated`, `lag` per partition)."""

    entries: int
    bytes: int
    shards: dict[str, int]
    detail: dict[str, Any]


@dataclass(frozen=True)
class Admitted:
    """The audit's source side: the XOR of the ids of the events in a batch's spans."""

    xor: int
    events: int
    entries: int


class Log(ABC):
    """One log, as seen by one reader. Holds plain options only until a method needs a client."""

    OFFSETS_FIELD: ClassVar[str]
    kind: ClassVar[str]  # "redis" | "kafka"

    # -- driver side ------------------------------------------------------------------------

    @abstractmethod
    def start_positions(self) -> dict[str, Position]:
        """Where a fresh checkpoint begins, per shard."""

    @abstractmethod
    def plan(self, start: Mapping[str, Position], budget: int | None, ref_ms: int) -> Plan:
        """The next batch after `start`: everything there is with `budget` None, else at most
        `budget` events (each shard may overshoot by its first entry, so that an entry larger
        than the budget cannot stall it). `ref_ms` is the caller's clock, for logs whose
        entries carry no usable arrival time."""

    def spans(self, start: Mapping[str, Any], end: Mapping[str, Any]) -> list[Span]:
        """The non-empty spans of the batch from offsets `start` to `end` (the offset dicts
        the Spark source logs; `start` is None-like {} for the first batch)."""
        lo_all = start.get(self.OFFSETS_FIELD) or {}
        first = end.get("from") or {}
        out = []
        for shard, hi in end[self.OFFSETS_FIELD].items():
            lo = first.get(shard, lo_all.get(shard, self.origin))
            if self.before(lo, hi):
                out.append(Span(shard, lo, hi))
        return out

    origin: ClassVar[Any]  # the position before any entry

    @staticmethod
    @abstractmethod
    def before(a: Position, b: Position) -> bool:
        """Whether position `a` comes before position `b`."""

    @abstractmethod
    def split(self, span: Span, entries: int | None, parts: int) -> list[Span]:
        """`span` cut into at most `parts` consecutive spans covering it exactly (`entries`:
        how many entries it holds, when known)."""

    @abstractmethod
    def count_entries(self, span: Span) -> int:
        """An upper bound on the entries in `span`, for sizing partitions when the plan did
        not record it (a batch re-planned from the offset log)."""

    def planned_source(self, spans: list[Span], end: Mapping[str, Any]) -> Admitted | None:
        """The audit's source side of `spans` as planning computed it from the log, logged with
        the batch's end offsets `end` as `admitted`, {shard: [lo, hi, xor (hex), events,
        entries]} (a log that reads a batch's entries to plan its budget computes it then):
        used when it covers exactly the batch's spans, which a batch re-planned from the offset
        log after a crash does too. None if it does not: `admitted` reads the log. (Offset logs
        written before entries were logged hold 4-element `fields` records, an entry per
        event.)"""
        planned = end.get("admitted") or {}
        acc = n = entries = 0
        for span in spans:
            got = planned.get(span.shard)
            if got is None or (str(got[0]), str(got[1])) != (str(span.lo), str(span.hi)):
                return None
            acc ^= int(got[2], 16)
            n += int(got[3])
            entries += int(got[4]) if len(got) > 4 else int(got[3])
        return Admitted(acc, n, entries) if spans else None

    @abstractmethod
    def admitted(self, spans: list[Span]) -> Admitted:
        """The XOR of the ids of every event in `spans`, read from the log itself,
        independently of the batch's own read."""

    @abstractmethod
    def level(self, reader: str | None = None) -> Backlog:
        """The backlog: entries and bytes not yet released by `reader` (None: by the slowest
        reader)."""

    @abstractmethod
    def release(self, end: Mapping[str, Position], reset: Sequence[str] = ()) -> None:
        """Everything before `end` is committed by this reader: record it, and do the log's
        housekeeping (Redis: trim up to the slowest reader; Kafka: commit the group's
        offsets). `reset`: shards whose positions went back (a Kafka partition read again
        from its start, `Plan.first`), where `end` may be below what was released before.
        Idempotent."""

    # -- executor side ----------------------------------------------------------------------

    @abstractmethod
    def read(
        self, span: Span, ref_ms: int, on_wait: Callable[[str, str], None] | None = None
    ) -> Iterator[pa.RecordBatch]:
        """The events of `span`, decoded (see `source.decode`), in log order. A log that
        waits for its server calls `on_wait(reason, message)` meanwhile."""

    def close(self) -> None:  # noqa: B027 - optional: a log without clients has nothing to do
        """Release clients (the log may be used again: they are made anew)."""


BUDGET_ROUNDS = 3


def spread_budget(
    budget: int,
    shards: Sequence[str],
    take: Callable[[str, int, bool], tuple[int, bool]],
    rounds: int = BUDGET_ROUNDS,
) -> tuple[int, list[str]]:
    """Spread an event budget over shards: evenly first, then what a shard with little backlog
    left unused goes to the shards that still have more (keys are rarely even).

    `take(shard, share, first_round)` advances one shard by at most `share` events (in the
    first round it may overshoot by one entry, so that an entry larger than the budget cannot
    stall the shard) and returns (events taken, whether it has more). Returns the events taken
    in all and the shards that still had more when the budget ran out.
    """
    wanting = list(shards)
    left = budget
    for round_ in range(rounds):
        if left <= 0 or not wanting:
            break
        share = max(1, left // len(wanting))
        still = []
        for s in wanting:
            n, more = take(s, share, round_ == 0)
            left -= n
            if more:
                still.append(s)
        wanting = still
    return budget - left, wanting
