"""Key layout in Redis, and Redis Cluster slot arithmetic.

Every key of one (metric, key) shares the hash tag `{metric|key}`, so the slice hash and anything
written with it atomically live in one cluster slot. Key values are percent-escaped so that a
value containing `|`, `{`, `}` or `%` can neither break the tag nor collide with another key.

    sluice:s:{txn_count|card-17}   hash: field <slice_start_ms> -> "<writer token>:<a>[:<b>]",
                                         plus `_m` = "<newest slice start>:<oldest kept>" and,
                                         once a backfill wrote it, `_b` = its seam (ms)
    sluice:s:{txn_count|card-17}:r3600000   the same for a coarser resolution (here 1h)
    sluice:h:{uniq_dev|acct-3}:[r<res>:]<slice_start_ms>  HyperLogLog of one `distinct` slice
    sluice:{stats}                 hash: pipeline counters and the last batch record
    sluice:{stats}:batches         list: the newest batch records (JSON), for rates and freshness
    sluice:{stats}:health          hash: the supervisor's state, failures, last error, heartbeat
    sluice:{stats}:freshness       hash: the freshness histogram (bucket counts, count, sum)
    sluice:{stats}:history         list: per-second samples for the dashboard (JSON, newest first)
    sluice:{stats}:history:t       string: the second of the newest sample
    sluice:{stats:<stage>}[:batches|:freshness]  the same three for each other stage
    sluice:{stats[:<stage>]}:log   hash: whether a stage's log can be read (state, reason, since)
    sluice:{stats[:<stage>]}:timings  list: each batch's time breakdown (JSON, newest first)
    sluice:{stats[:<stage>]}:decode   sorted set: per batch (its reference ms), the longest read
                                   and decode of one partition, in ms (written by the executors)
    sluice:{stats}:folding         hash: metric -> when the live fold first folded it (ms)
    sluice:{stats}:writes          counter: batch writes begun and ended (redis.marks)
    sluice:{stats}:writing         hash: <writer token>:<partition> -> until when it counts
                                   (ms), per write task in flight (redis.marks)
    sluice:{backfill}:seams        hash: metric -> the newest backfill seam (ms; docs/offline.md)
    sluice:{backfill}:runs         list: the newest backfill summaries (JSON, newest first)
    sluice:{backfill}:<run>        hash: a backfill's progress (events, slices, partitions)
    sluice:{backfill}:<run>:done   set: the partitions a backfill has written (for a re-run)
    sluice:{consistency}:answers   stream: a sample of the answers the server gave (for
                                   `sluice consistency`), bounded
    sluice:{consistency}:last      string: the newest consistency report (JSON)
    sluice:epoch                   counter: writer epochs: one per fresh checkpoint, one per
                                   leadership term (see pipeline.lease)
    sluice:{lease}:q:<query>       hash: the leadership lease of one streaming query (owner,
                                   epoch, expiry, the holder's host, pid and checkpoint)
    sluice:{lease}:terms:<query>   hash: which epoch each batch of its checkpoint writes with
    sluice:{lease}:processes       hash: process id -> its role and heartbeat (JSON)
    sluice:{lease}:arm:<owner>:<query>:<n>  list: `go` or `stop`, for a standby's query started
                                   ahead of a takeover (see source.arm); short-lived
    sluice:{flow}:state            hash: task id -> published stage state (seed /taskstate)
    sluice:{flow}:signals          stream: overload/underload signals to tasks (seed /taskmessage)
    sluice:{flow}:timeline         list: the newest stage-state changes (JSON)
    sluice:dead:{<stream>}         stream: dead letters, bounded
    sluice:dlm:{<stream>}:<token>:<digest>  marker: these dead letters are already written
    sluice:audit:{<stream>#<n>}    hash: the audit ledger, one of `audit.ledger_shards`
    sluice:rd:{<shard>}            hash: reader name -> its committed entry id in that shard
    sluice:rd:{kafka:<topic>:<p>}  hash: reader name -> its committed offset in a Kafka partition
    sluice:emit:{<shard>}:<token>:<part>:<chunk>  marker: a stage already wrote this chunk
                                   (`{<shard>}` stands for the shard's own tag when it has one)

The input shards are `<stream>` (one shard) or `<stream>:0` .. `<stream>:<N-1>`; with
`source.hash_tags` (the default on a Redis Cluster) each also carries a tag that pins it to its
own N-th of the slot space, `<stream>:<i>:{<t>}`, so that the shards spread over the masters
(see `shard_keys`). Every script and every MULTI touches keys of one tag only.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import NamedTuple

PREFIX = "sluice"
SLICE_PREFIX = f"{PREFIX}:s:"
STATS_KEY = f"{PREFIX}:{{stats}}"
BATCHES_KEY = f"{PREFIX}:{{stats}}:batches"
HEALTH_KEY = f"{PREFIX}:{{stats}}:health"
FRESHNESS_KEY = f"{PREFIX}:{{stats}}:freshness"
HISTORY_KEY = f"{PREFIX}:{{stats}}:history"
HISTORY_SECOND_KEY = f"{PREFIX}:{{stats}}:history:t"
WRITES_KEY = f"{PREFIX}:{{stats}}:writes"
WRITING_KEY = f"{PREFIX}:{{stats}}:writing"
EPOCH_KEY = f"{PREFIX}:epoch"
FLOW_STATE_KEY = f"{PREFIX}:{{flow}}:state"
FLOW_SIGNALS_KEY = f"{PREFIX}:{{flow}}:signals"
FLOW_TIMELINE_KEY = f"{PREFIX}:{{flow}}:timeline"
LEASE_PREFIX = f"{PREFIX}:{{lease}}"
PROCESSES_KEY = f"{LEASE_PREFIX}:processes"
KEY_SEP = "|"
FOLDING_KEY = f"{PREFIX}:{{stats}}:folding"
DEFINITIONS_KEY = f"{PREFIX}:{{stats}}:definitions"  # per metric: what its slices were folded as
BACKFILL_PREFIX = f"{PREFIX}:{{backfill}}"
SEAMS_KEY = f"{BACKFILL_PREFIX}:seams"
STARTS_KEY = f"{BACKFILL_PREFIX}:starts"  # per metric: the earliest start (before SPANS_KEY)
SPANS_KEY = f"{BACKFILL_PREFIX}:spans"  # per metric: the time spans backfills wrote, merged
BACKFILL_RUNS_KEY = f"{BACKFILL_PREFIX}:runs"
ANSWERS_KEY = f"{PREFIX}:{{consistency}}:answers"
CONSISTENCY_KEY = f"{PREFIX}:{{consistency}}:last"


class StatsKeys(NamedTuple):
    """Where one streaming query records its batches (see `lua/record_batch.lua`)."""

    stats: str
    batches: str
    freshness: str


def stats_keys(stage: str = "spark") -> StatsKeys:
    """The source's fold (`spark`) keeps the keys of a pipeline without stages; any other stage
    has its own, `sluice:{stats:<stage>}`, so the batch records of two stages never mix."""
    if stage == "spark":
        return StatsKeys(STATS_KEY, BATCHES_KEY, FRESHNESS_KEY)
    base = f"{PREFIX}:{{stats:{stage}}}"
    return StatsKeys(base, f"{base}:batches", f"{base}:freshness")


def timings_key(stage: str = "spark") -> str:
    """Each batch's time breakdown, newest first (see `pipeline.timing`)."""
    return f"{stats_keys(stage).stats}:timings"


def decode_times_key(stage: str = "spark") -> str:
    """Per batch, the longest read-and-decode of one of its partitions (see `pipeline.timing`)."""
    return f"{stats_keys(stage).stats}:decode"


def lease_key(query: str) -> str:
    """The leadership lease of one streaming query (`pipeline.lease`). Every lease key shares
    the tag `{lease}`, so one script can take the leases of all of a process's queries."""
    return f"{LEASE_PREFIX}:q:{query}"


def arm_key(owner: str, query: str, n: int) -> str:
    """Where a standby's query started ahead of a takeover waits for its word (`source.arm`):
    one key per process (`owner`), query and arming."""
    return f"{LEASE_PREFIX}:arm:{owner}:{query}:{n}"


def terms_key(query: str) -> str:
    """The epochs a query's batches write with, per leadership term (`pipeline.lease`)."""
    return f"{LEASE_PREFIX}:terms:{query}"


def log_state_key(stage: str = "spark") -> str:
    """Whether the log a stage reads can be read now (see `source.waiting.LogState`)."""
    return f"{stats_keys(stage).stats}:log"


# Order matters: '%' first, so that the escapes themselves are not escaped again.
ESCAPES = (("%", "%25"), ("|", "%7C"), ("{", "%7B"), ("}", "%7D"))


def escape_part(value: str) -> str:
    if "%" not in value and "|" not in value and "{" not in value and "}" not in value:
        return value  # most keys: four scans, no copies
    for raw, esc in ESCAPES:
        value = value.replace(raw, esc)
    return value


def unescape_part(value: str) -> str:
    for raw, esc in reversed(ESCAPES):
        value = value.replace(esc, raw)
    return value


def encode_key(parts: Sequence[str]) -> str:
    """The stored form of a metric key (one or more field values)."""
    if len(parts) == 1:
        return escape_part(parts[0])
    return KEY_SEP.join([escape_part(p) for p in parts])


def decode_key(encoded: str) -> list[str]:
    return [unescape_part(p) for p in encoded.split(KEY_SEP)]


def slice_hash_key(metric: str, encoded_key: str, resolution_ms: int | None = None) -> str:
    """The slice hash of (metric, key); a coarser resolution is a suffix after the same tag."""
    before, after = slice_hash_affixes(metric, resolution_ms)
    return before + encoded_key + after


def slice_hash_affixes(metric: str, resolution_ms: int | None = None) -> tuple[str, str]:
    """What comes before and after the encoded key in `slice_hash_key` (for callers that make
    many keys of one metric and resolution)."""
    after = "}" if resolution_ms is None else f"}}:r{resolution_ms}"
    return f"{SLICE_PREFIX}{{{metric}{KEY_SEP}", after


def slice_hll_key(
    metric: str, encoded_key: str, slice_start: int, resolution_ms: int | None = None
) -> str:
    """The HyperLogLog of one slice of a `distinct` metric (same hash tag as its slice hash)."""
    res = "" if resolution_ms is None else f"r{resolution_ms}:"
    return f"{PREFIX}:h:{{{metric}{KEY_SEP}{encoded_key}}}:{res}{slice_start}"


def dead_letter_stream_key(stream: str) -> str:
    return f"{PREFIX}:dead:{{{stream}}}"


def dead_letter_marker_key(stream: str, token: int, digest: str) -> str:
    return f"{PREFIX}:dlm:{{{stream}}}:{token}:{digest}"


@cache
def shard_tags(shards: int) -> tuple[str, ...]:
    """Per shard i, the smallest integer tag whose slot s has s * shards // 16384 == i: the i-th
    of `shards` equal parts of the slot space.

    Masters usually serve contiguous, equal slot ranges (`redis-cli --cluster create` makes them
    so), so N >= masters shards put at least one shard on every master; plain `events:0`,
    `events:1`, ... do not (for N = 3 on 3 masters two of them share one master).
    """
    tags: list[str | None] = [None] * shards
    left, t = shards, 0
    while left:
        i = (_crc16_xmodem(str(t).encode()) % 16384) * shards // 16384
        if tags[i] is None:
            tags[i] = str(t)
            left -= 1
        t += 1
    return tuple(tag for tag in tags if tag is not None)


def shard_keys(stream: str, shards: int, hash_tags: bool = False) -> list[str]:
    """The input stream keys, in shard order: `events`, or `events:0` ..; with `hash_tags`,
    `events:0:{<t>}` .. (see `shard_tags`). One shard is always the bare stream name."""
    if shards == 1:
        return [stream]
    if not hash_tags:
        return [f"{stream}:{i}" for i in range(shards)]
    return [f"{stream}:{i}:{{{tag}}}" for i, tag in enumerate(shard_tags(shards))]


def shard_side_key(kind: str, shard: str, *parts: object) -> str:
    """A key that lives in the same cluster slot as the stream `shard` (for scripts that touch
    both): `sluice:<kind>:<shard>[:parts]` when the shard carries a hash tag, else the shard's
    whole name becomes the tag, `sluice:<kind>:{<shard>}[:parts]`."""
    tail = "".join(f":{p}" for p in parts)
    return f"{PREFIX}:{kind}:{_tagged(shard)}{tail}"


def _tagged(shard: str) -> str:
    start = shard.find("{")
    if start != -1 and shard.find("}", start + 1) > start + 1:
        return shard
    return f"{{{shard}}}"


def _crc16_xmodem(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key: str | bytes) -> int:
    """Redis Cluster slot: CRC16-XMODEM of the key, or of its non-empty `{...}` tag, mod 16384."""
    raw = key.encode() if isinstance(key, str) else key
    start = raw.find(b"{")
    if start != -1:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return _crc16_xmodem(raw) % 16384
