"""Answer "metric M for key K over the last H" by merging slices.

A lookup reads the slices its window's cover touches. Up to RAW_MAX_SLICES of them are read
with HMGET and merged here (`Agg.merge` in `sluice.slices.aggs`), which keeps the
single-threaded Redis to cheap field lookups. Longer ranges are one EVALSHA of
`read_slices.lua`, which merges in Redis and scans a sparse hash instead of asking for every
slice, so neither the wire nor Python ever carries more than RAW_MAX_SLICES values per lookup.
A batch of lookups is one pipelined round trip. A derived metric's inputs are read from one
state: a read that may have met a batch's write half done is read again once it ended
(`sluice.redis.marks`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from itertools import chain
from typing import Any, NamedTuple

import redis

from sluice import formula
from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config, FieldType, MetricConfig
from sluice.errors import BadQuery, UnknownMetric
from sluice.query.answers import AnswerLog
from sluice.query.params import parse_end, parse_window, parse_window_text, seconds_hint
from sluice.query.settle import SETTLE_POLL_S, SETTLE_S, unsettled
from sluice.query.wire import Commands, aexecute, commands_for, slice_fields
from sluice.redis import marks
from sluice.redis.keys import encode_key, slice_hash_affixes, slice_hash_key, slice_hll_key
from sluice.redis.marks import Marks
from sluice.redis.scripts import READ_SLICES, evalsha_on, execute_loading, script_source
from sluice.slices.aggs import AGGS, BLOB, HLL
from sluice.slices.window import Cover, Piece, cover, slice_start
from sluice.units import format_duration_ms

MAX_BATCH = 1000
RAW_MAX_SLICES = 2000  # read raw and merged here up to this many slices; longer: in Redis
# Per (lookup, base metric): lookup index, metric, cover, how many pipeline replies it has (0:
# none, an earlier lookup of the batch asked the same), whether they are raw slice states
# (HMGET) rather than read_slices.lua's merged state, and the plan entry whose value it takes
# (its own, or that earlier lookup's).
Plan = list[tuple[int, MetricConfig, Cover, int, bool, int]]
_Asked = tuple[str, tuple[str, ...], int, int]  # metric, key, covered start and end
MAX_POINTS = 1000


class Lookup(NamedTuple):
    """One validated lookup (a tuple: made for every lookup a request asks, at a fraction of a
    frozen dataclass's cost)."""

    metric: str
    key: tuple[str, ...]
    window_ms: int
    end_ms: int


def integral_value(cfg: Config, m: MetricConfig) -> bool:
    """The metric's value is an integer field of the schema: its sums, minima and the like are
    answered as ints."""
    if m.value is None:
        return False
    spec = cfg.source.schema_.get(m.value.strip())
    return spec is not None and FieldType.parse(spec).type in ("long", "int")


def _answer(lk: Lookup, value: Any, covered_start: int, covered_end: int) -> dict[str, Any]:
    """The response for one lookup (a derived metric's also gets its `inputs`)."""
    return {
        "metric": lk.metric,
        "key": list(lk.key),
        "value": value,
        "start": lk.end_ms - lk.window_ms,
        "end": lk.end_ms,
        "covered_start": covered_start,
        "covered_end": covered_end,
    }


# Default steps of a series whose slices would give too many points: round durations.
_S, _M, _H, _D = 1_000, 60_000, 3_600_000, 86_400_000
STEPS = (_S, 2 * _S, 5 * _S, 10 * _S, 15 * _S, 30 * _S, _M, 2 * _M, 5 * _M, 10 * _M, 15 * _M,
         30 * _M, _H, 2 * _H, 3 * _H, 6 * _H, 12 * _H, _D, 2 * _D, 7 * _D)  # fmt: skip


def default_step(slices: Sequence[int], window_ms: int) -> int:
    """A series' step when none is asked: the slice (the least common multiple of the inputs'
    slices), or where that gives more than MAX_POINTS points over `window_ms` (its steps plus
    up to 2 partly covered at its ends), the least multiple of it that gives fewer, rounded up
    to a round duration (`STEPS`) where one is at most twice that."""
    base = math.lcm(*slices)
    need = -(-window_ms // (MAX_POINTS - 2))
    if base >= need:
        return base
    plain = -(-need // base) * base
    for step in STEPS:
        if step >= plain and step % base == 0:
            return step if step <= 2 * plain else plain
    return plain


class QueryEngine:
    """Stateless apart from the Redis client; safe to share across request handlers.

    With an `answer_log` (the server's, from `server.log_answers`), `run` and `arun` log a
    sample of the answers they return (`sluice.query.answers`); `series` never does.
    """

    def __init__(
        self,
        cfg: Config,
        client: Any,
        clock: Clock = SYSTEM_CLOCK,
        answer_log: AnswerLog | None = None,
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.clock = clock
        self.answer_log = answer_log
        self._integral = {m.name: integral_value(cfg, m) for m in cfg.metrics}
        self._lengths = {m.name: tuple(m.slice_lengths()) for m in cfg.metrics}
        self._aggs = {m.name: AGGS[m.agg] for m in cfg.metrics}
        self._states = {m.name: AGGS[m.agg].state for m in cfg.metrics}
        # Per metric and slice length, the slice hash's key around the encoded key.
        self._affixes = {
            m.name: {r: slice_hash_affixes(m.name, None if r == m.slice else r) for r in lengths}
            for m in cfg.metrics
            if (lengths := m.slice_lengths())
        }
        self._derived = {d.name: formula.parse(d.expr) for d in cfg.derived}
        # The base metrics each name reads: itself, or a derived metric's inputs.
        self._bases: dict[str, list[MetricConfig]] = {m.name: [m] for m in cfg.metrics}
        for name, expr in self._derived.items():
            self._bases[name] = [m for n in formula.names(expr) if (m := cfg.metric(n))]
        # A key value is as long as the fold takes one (`source.max_string_bytes`, in UTF-8
        # bytes); a text of a quarter as many characters is never longer.
        self._key_bytes = cfg.source.max_string_bytes
        self._key_chars = self._key_bytes // 4
        # Per name with base metrics: (keys it takes, the shortest retention), for `lookup`.
        self._plain = {
            name: (len(base[0].key), min(m.retention for m in base))
            for name, base in self._bases.items()
            if base
        }

    # -- validation -------------------------------------------------------------------------

    def lookup(self, metric: Any, key: Sequence[Any] | Any, window: Any, end: Any = None) -> Lookup:
        """Validate one request into a Lookup. Raises UnknownMetric or BadQuery."""
        # The common request in a few steps: a known metric, its number of keys, each a short
        # text, a window within retention. Anything else goes through the checks below, whose
        # errors say what is wrong.
        plain = self._plain.get(metric) if type(metric) is str else None
        if plain is not None and type(window) is str and len(window) <= 32:
            keys = (key,) if type(key) is str else tuple(key) if type(key) is list else ()
            short = self._key_chars
            if len(keys) == plain[0] and all(type(k) is str and len(k) <= short for k in keys):
                window_ms = parse_window_text(window, "window")
                now_ms = self.clock.now_ms()
                end_ms = parse_end(end, now_ms)
                if window_ms <= plain[1] and end_ms - window_ms >= now_ms - plain[1]:
                    return Lookup(metric, keys, window_ms, end_ms)
        return self._lookup(metric, key, window, end)

    def _lookup(self, metric: Any, key: Sequence[Any] | Any, window: Any, end: Any) -> Lookup:
        if not isinstance(metric, str) or not metric:
            raise BadQuery("`metric` must be a metric name", "metric")
        base = self._base_metrics(metric)
        keys = [key] if isinstance(key, str) else list(key or [])
        want = len(base[0].key)
        if not keys:
            raise BadQuery(f"`key` is required: {metric!r} is keyed by {base[0].key}", "key")
        if len(keys) != want or not all(
            isinstance(k, str | int) and not isinstance(k, bool) for k in keys
        ):
            raise BadQuery(
                f"`key`: {metric!r} is keyed by {base[0].key}, so it takes {want} key value"
                f"{'s' if want > 1 else ''}; got {keys!r}",
                "key",
            )
        keys = [str(k) for k in keys]
        if any(len(k.encode("utf-8", "surrogatepass")) > self._key_bytes for k in keys):
            raise BadQuery(
                f"`key` value is longer than {self._key_bytes} bytes in UTF-8"
                " (source.max_string_bytes: the fold takes no longer one)",
                "key",
            )
        window_ms = parse_window(window)
        now_ms = self.clock.now_ms()
        end_ms = parse_end(end, now_ms)
        for m in base:
            if window_ms > m.retention:
                raise BadQuery(
                    f"`window` {format_duration_ms(window_ms)} is longer than the retention of"
                    f" {m.name!r} ({format_duration_ms(m.retention)})",
                    "window",
                    status=422,
                )
            # A key keeps the retention before now's slice (README, "Retention"): a window
            # whose first slice is older than that is refused, not answered short.
            first = slice_start(end_ms - window_ms + 1, m.slice)
            if first < slice_start(now_ms, m.slice) - m.retention:
                raise BadQuery(
                    f"the {format_duration_ms(window_ms)} window ending at `end` {end_ms} starts"
                    f" {format_duration_ms(now_ms - m.retention - end_ms + window_ms)} before"
                    f" the retention of {m.name!r} ({format_duration_ms(m.retention)} back from"
                    " now): the slices there are removed" + seconds_hint(end_ms, now_ms),
                    "end",
                    status=422,
                )
        return Lookup(metric, tuple(keys), window_ms, end_ms)

    def _base_metrics(self, name: str) -> list[MetricConfig]:
        base = self._bases.get(name)
        if base is not None:
            return base
        known = ", ".join([m.name for m in self.cfg.metrics] + [d.name for d in self.cfg.derived])
        raise UnknownMetric(f"unknown metric {name!r}; known metrics: {known}", "metric")

    # -- execution --------------------------------------------------------------------------

    def query(
        self, metric: str, key: Sequence[Any] | Any, window: Any, end: Any = None
    ) -> dict[str, Any]:
        return self.run([self.lookup(metric, key, window, end)])[0]

    def run(self, lookups: Sequence[Lookup]) -> list[dict[str, Any]]:
        """Answer many lookups in one pipelined round trip (blocking); the sampled answers, if
        any, are logged after it, in one more."""
        answers = self._read(lookups)
        if self.answer_log is not None and (logged := self.answer_log.pick(lookups, answers)):
            self.answer_log.send(self.client, logged)
        return answers

    def _read(
        self, lookups: Sequence[Lookup], deadline: float | None = None
    ) -> list[dict[str, Any]]:
        self._check_batch(lookups)
        marked = self._has_derived(lookups)
        deadline = time.monotonic() + SETTLE_S if deadline is None else deadline
        before = self._marks() if marked else None
        plan: Plan = []

        def execute() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            plan[:] = self._queue_all(pipe, lookups)
            return pipe.execute() if plan else []

        replies = execute_loading(self.client, execute, (READ_SLICES,))
        answers = self._answers(lookups, plan, replies)
        if before is None:
            return answers
        after = self._marks()
        again = unsettled([lk.metric for lk in lookups], plan, replies, before, after,
                          self._derived)  # fmt: skip
        if not again or time.monotonic() > deadline:
            return answers
        time.sleep(SETTLE_POLL_S)  # at least: at most SETTLE_S / SETTLE_POLL_S reads again
        while after[1] and time.monotonic() < deadline and self._marks() == after:  # in flight
            time.sleep(SETTLE_POLL_S)
        for i, a in zip(again, self._read([lookups[i] for i in again], deadline), strict=True):
            answers[i] = a
        return answers

    def _marks(self) -> Marks:
        pipe = self.client.pipeline(transaction=False)
        for command in marks.READ:
            pipe.execute_command(*command)
        return marks.parse(pipe.execute(), self.clock.now_ms())

    async def arun(self, lookups: Sequence[Lookup], aclient: Any) -> list[dict[str, Any]]:
        """`run` on an asyncio client (a `MuxClient`, or one of redis-py's): waits for Redis
        without holding a thread."""
        self._check_batch(lookups)
        answers = await self._aread(lookups, aclient, time.monotonic() + SETTLE_S)
        if self.answer_log is not None and (logged := self.answer_log.pick(lookups, answers)):
            self.answer_log.asend(aclient, logged)  # not awaited: no round trip of its own
        return answers

    async def _aread(
        self, lookups: Sequence[Lookup], aclient: Any, deadline: float
    ) -> list[dict[str, Any]]:
        marked = self._has_derived(lookups)
        before = await self._amarks(aclient) if marked else None
        for attempt in (0, 1):
            commands = commands_for(aclient)
            plan = self._queue_all(commands, lookups)
            try:
                replies = await aexecute(aclient, commands) if plan else []
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                await aclient.script_load(script_source(READ_SLICES))
                continue
            answers = self._answers(lookups, plan, replies)
            if before is None:
                return answers
            after = await self._amarks(aclient)
            again = unsettled([lk.metric for lk in lookups], plan, replies, before, after,
                              self._derived)  # fmt: skip
            if not again or time.monotonic() > deadline:
                return answers
            await asyncio.sleep(SETTLE_POLL_S)
            while after[1] and time.monotonic() < deadline and await self._amarks(aclient) == after:
                await asyncio.sleep(SETTLE_POLL_S)
            more = await self._aread([lookups[i] for i in again], aclient, deadline)
            for i, a in zip(again, more, strict=True):
                answers[i] = a
            return answers
        raise AssertionError("unreachable")  # pragma: no cover

    async def _amarks(self, aclient: Any) -> Marks:
        return marks.parse(await aexecute(aclient, marks.READ), self.clock.now_ms())

    def _has_derived(self, lookups: Sequence[Lookup]) -> bool:
        derived = self._derived
        return bool(derived) and any(lk.metric in derived for lk in lookups)

    def _check_batch(self, lookups: Sequence[Lookup]) -> None:
        if len(lookups) > MAX_BATCH:
            raise BadQuery(
                f"at most {MAX_BATCH} queries per request, got {len(lookups)}", "queries"
            )

    def _queue_all(self, pipe: Any, lookups: Sequence[Lookup]) -> Plan:
        """Queue every read on `pipe` (sync or asyncio); returns how to read the replies."""
        plan: Plan = []
        lengths, states = self._lengths, self._states
        asked: dict[_Asked, int] = {}  # the plan entry that reads each
        for n, lk in enumerate(lookups):
            encoded = encode_key(lk.key)
            for m in self._base_metrics(lk.metric):
                cov = cover(lk.end_ms, lk.window_ms, lengths[m.name])
                # The same metric, key and cover as an earlier lookup of the batch (a hot key
                # asked twice): no reads of its own, that lookup's value (`_answers`).
                same = (m.name, lk.key, cov.covered_start, cov.covered_end)
                first = asked.setdefault(same, len(plan))
                if first != len(plan):
                    plan.append((n, m, cov, 0, False, first))
                    continue
                stored = states[m.name]
                # Blobs are merged here only, HyperLogLogs in Redis only (PFCOUNT).
                raw = stored == BLOB or (stored != HLL and cov.n_slices <= RAW_MAX_SLICES)
                plan.append((n, m, cov, self._queue(pipe, m, encoded, cov, raw), raw, first))
        return plan

    def _answers(
        self, lookups: Sequence[Lookup], plan: Plan, replies: list[Any]
    ) -> list[dict[str, Any]]:
        answers: list[dict[str, Any]] = [{} for _ in lookups]
        parts: dict[int, dict[str, tuple[Any, Cover]]] = {}  # derived lookups' inputs
        at = 0
        aggs, integral = self._aggs, self._integral
        done: list[Any] = []  # each plan entry's value
        for n, m, cov, count, raw, first in plan:
            lk = lookups[n]
            if count == 0:  # read and answered for an earlier lookup (`_queue_all`)
                value = done[first]
            else:
                agg = aggs[m.name]
                if count == 1:  # one read: its reply as it is (raw: one HMGET's states)
                    reply = agg.merge(replies[at]) if raw else replies[at]
                else:
                    reply = replies[at : at + count]
                    if raw:
                        reply = agg.merge([*chain.from_iterable(reply)])
                value = agg.finalize(reply, m, integral[m.name])
                at += count
            done.append(value)
            if lk.metric == m.name:  # a base metric's lookup: one read, its answer at once
                answers[n] = _answer(lk, value, cov.covered_start, cov.covered_end)
            else:
                parts.setdefault(n, {})[m.name] = (value, cov)
        for n, part in parts.items():
            lk = lookups[n]
            values = {name: v for name, (v, _) in part.items()}
            covers = [c for _, c in part.values()]
            value = formula.evaluate(self._derived[lk.metric], values)
            start, end = min(c.covered_start for c in covers), max(c.covered_end for c in covers)
            answers[n] = _answer(lk, value, start, end) | {"inputs": values}
        return answers

    def _queue(self, pipe: Any, m: MetricConfig, encoded: str, cov: Cover, raw: bool) -> int:
        """Queue the reads of one (metric, key) over `cov`, raw slice states (one HMGET per
        piece) or merged by read_slices.lua; returns how many replies they give."""
        if raw:  # never a HyperLogLog (`_queue_all`)
            affixes = self._affixes[m.name]
            for p in cov.pieces:
                before, after = affixes[p.slice_ms]
                key = before + encoded + after
                if isinstance(pipe, Commands):
                    pipe.hmget_slices(key, p.first, p.last, p.slice_ms)
                else:
                    pipe.execute_command("HMGET", key, *slice_fields(p.first, p.last, p.slice_ms))
            return len(cov.pieces)

        def res(piece: Piece) -> int | None:
            return None if piece.slice_ms == m.slice else piece.slice_ms

        if AGGS[m.agg].state == HLL:
            # PFCOUNT of several HyperLogLogs merges them server-side (one hash tag: one slot).
            # Queued as a plain command: redis-py's cluster pipeline refuses its `pfcount`.
            keys = [
                slice_hll_key(m.name, encoded, s, res(p))
                for p in cov.pieces
                for s in range(p.first, p.last + 1, p.slice_ms)
            ]
            pipe.execute_command("PFCOUNT", *keys)
            return 1
        args: list[Any] = [AGGS[m.agg].state]
        for p in cov.pieces:
            args += [p.first, p.last, p.slice_ms]
        keys = [slice_hash_key(m.name, encoded, res(p)) for p in cov.pieces]
        evalsha_on(pipe, READ_SLICES, keys, args)
        return 1

    def series(
        self, metric: str, key: Sequence[Any] | Any, window: Any, end: Any = None, step: Any = None
    ) -> dict[str, Any]:
        """Values per step over the window, for charts. Each point covers exactly its step.

        `step` must be a multiple of every slice length the metric reads, so that each point
        is answered from whole slices. It defaults to `default_step`.
        """
        first = self.lookup(metric, key, window, end)
        if step in (None, ""):
            step_ms = default_step([m.slice for m in self._base_metrics(metric)], first.window_ms)
        else:
            step_ms = parse_window(step, "step")
        for m in self._base_metrics(metric):
            if step_ms % m.slice:
                raise BadQuery(
                    f"`step` {format_duration_ms(step_ms)} is not a multiple of the"
                    f" {format_duration_ms(m.slice)} slices of {m.name!r}",
                    "step",
                )
        lo = slice_start(first.end_ms - first.window_ms + 1, step_ms)
        hi = slice_start(first.end_ms, step_ms)
        n_points = (hi - lo) // step_ms + 1
        if n_points > MAX_POINTS:
            raise BadQuery(
                f"`window` / `step` gives {n_points} points; at most {MAX_POINTS}", "step", 422
            )
        lookups = [
            Lookup(first.metric, first.key, step_ms, s + step_ms - 1)
            for s in range(lo, hi + 1, step_ms)
        ]
        points = [
            {"start": a["covered_start"], "end": a["covered_end"], "value": a["value"]}
            for a in self._read(lookups)  # chart points: not logged
        ]
        return {
            "metric": first.metric,
            "key": list(first.key),
            "step_ms": step_ms,
            "start": first.end_ms - first.window_ms,
            "end": first.end_ms,
            "points": points,
        }

    def definitions(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {
                "name": m.name,
                "kind": "metric",
                "key": m.key,
                "agg": m.agg,
                "value": m.value,
                "filter": m.filter,
                "slice": format_duration_ms(m.slice),
                "retention": format_duration_ms(m.retention),
                "resolutions": [format_duration_ms(r) for r in m.slice_lengths()],
                "q": m.q,
                "slice_ms": m.slice,
                "retention_ms": m.retention,
            }
            for m in self.cfg.metrics
        ]
        for d in self.cfg.derived:
            base = self._base_metrics(d.name)
            out.append(
                {
                    "name": d.name,
                    "kind": "derived",
                    "expr": d.expr,
                    "key": base[0].key,
                    "inputs": [m.name for m in base],
                }
            )
        return out
