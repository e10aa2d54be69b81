"""A backfill's new slice hashes, created with one `RESTORE` each instead of the slice script.

A backfill writes each slice hash once, with the key's whole archived history (its slices as
the text they are stored as, `sluice.offline.backfill`). For a hash that does not exist yet,
what `write_slices.lua` would leave is known in advance: the slices within retention of the
run's newest one, `_m` = "<newest>:<oldest kept>", `_b` = the seam, and the expiry of the newest
slice. That hash is sent whole, as a DUMP payload (`sluice.redis.dump`), in
`RESTORE key expiry payload ABSTTL`: one native command, where the script costs Redis three
commands from Lua (`HMGET`, `HSET`, `PEXPIREAT`). Where the C extension is built, the payload is
the compact hash (a ziplist) that Redis would itself DUMP for it, byte for byte, so that Redis
loads it as one string instead of growing it one field at a time (`_dump.c`); without it, the
plain hash type, from which Redis builds the same hash.

`RESTORE` without `REPLACE` refuses a key that exists (`BUSYKEY`): such a hash (the live fold
or an earlier run wrote it) goes through the script, which merges with what is stored, and so
does a key with more slices than one script run takes (SLICES_PER_RUN). Once half the hashes
sent so far existed (a re-run over the same archive, a store the live fold has filled), the
rest go to the script without a `RESTORE` first; and where half of a few hashes asked about
first exist (`mostly_stored`), no `RESTORE` is built at all. Both commands are
atomic, so a live fold writing at the same time sees the hash either before (and the script
path merges) or after (and keeps off the slices before `_b`). A Redis that refuses the command
itself (an ACL without `@dangerous`, a renamed command, a future DUMP format) sends the rest of
the writes through the script. A task that runs again meets its own hashes as existing ones,
and the script replaces their slices with the same texts: exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import hiredis
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from redis.exceptions import ResponseError

from sluice.pipeline.slice_writes import (
    REPLY_COUNTS,
    SLICES_PER_RUN,
    Spans,
    as_text,
    build_calls,
    expire_at_ms,
    keep_from_ms,
    read_replies,
    resp_bulks,
    send_calls,
    stored_texts,
)
from sluice.redis.dump import (
    MAX_STRING,
    ZIPLIST_LIMITS,
    hash_payload_heads,
    hash_payloads,
    rdb_strings,
)

_items_in_c: Callable[..., tuple[bytes, bytes]] | None
try:  # the RESTOREs built in C (src/sluice/redis/_dump.c), where it was built
    from sluice.redis._dump import restore_commands as _items_in_c
except ImportError:  # pragma: no cover - a build without a C compiler
    _items_in_c = None

COMMANDS_PER_ROUND_TRIP = 1024
PROBES = 64  # slice hashes asked about before a task's RESTOREs are built (`mostly_stored`)


@dataclass
class Restores:
    """A backfill's writes of one metric resolution: the RESTORE commands of its new-looking
    hashes and what the script takes instead. Built on the caller's thread (`plan_restores`),
    sent by `run`."""

    token: str
    head: tuple[str, int, int, int]
    keys: pa.Array
    starts: np.ndarray
    states: list[pa.Array]
    cluster: bool
    ref_ms: int | None = None  # the backfill's reference time (`keep_from_ms`)
    # Per command, its key's input rows: order[first[i] : first[i] + count[i]].
    order: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    first: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    key_names: list[str] = field(default_factory=list)  # per command (cluster only)
    args: list[tuple[str, bytes]] = field(default_factory=list)  # (expiry, payload), cluster
    commands: Spans | None = None  # RESP-encoded commands (one Redis)
    kept: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per command
    expired: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    scripted: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rows

    def run(self, client: Any) -> tuple[list[int], np.ndarray]:
        """Send the RESTOREs, then the rest through the script: ([applied, duplicate, expired,
        before seam], and per input row whether its write failed)."""
        totals = [0] * REPLY_COUNTS
        created = self._send(client)
        totals[0] = int(self.kept[created].sum())
        totals[2] = int(self.expired[created].sum())
        refused = ~created
        busy = self.order[_ranges(self.first[refused], self.count[refused])]
        rows = np.sort(np.concatenate([self.scripted, busy]))
        failed = np.zeros(len(self.starts), dtype=bool)
        if len(rows):
            take = pa.array(rows)
            calls = build_calls(self.token, self.head, self.keys.take(take), self.starts[rows],
                                [s.take(take) for s in self.states], self.cluster,
                                ref_ms=self.ref_ms)  # fmt: skip
            more, call_failed = send_calls(client, calls)
            totals = [a + b for a, b in zip(totals, more, strict=True)]
            failed[rows] = call_failed[calls.row_call]
        return totals, failed

    def _send(self, client: Any) -> np.ndarray:
        """Per command, whether it created its hash (False: the script takes it)."""
        n = len(self.kept)
        created = np.zeros(n, dtype=bool)
        if not n:
            return created
        if self.cluster:  # a round at a time, each split over the masters by the client
            existing = 0
            for a in range(0, n, COMMANDS_PER_ROUND_TRIP):
                b = min(n, a + COMMANDS_PER_ROUND_TRIP)
                pipe = client.pipeline(transaction=False)
                for key, (expiry, payload) in zip(self.key_names[a:b], self.args[a:b],
                                                  strict=True):  # fmt: skip
                    pipe.execute_command("RESTORE", key, expiry, payload, "ABSTTL")
                replies = pipe.execute(raise_on_error=False)
                created[a:b] = [not isinstance(r, Exception) for r in replies]
                existing += sum(isinstance(r, Exception) and _busy(r) for r in replies)
                if existing + int(created[:b].sum()) < b or existing * 2 >= b:
                    break  # refused for another reason than an existing key, or half existed
            return created
        commands = self.commands
        assert commands is not None
        pool = client.connection_pool
        conn = pool.get_connection()

        def send(a: int) -> int:  # commands [a, b) out; returns b
            b = min(n, a + COMMANDS_PER_ROUND_TRIP)
            conn.send_packed_command([commands.bytes(a, b)])
            return b

        reader = hiredis.Reader(replyError=ResponseError)
        try:
            # Each round leaves before the last one's replies are read, so that Redis has
            # the next round to run while this side reads.
            read, sent, refused, existing = 0, send(0), False, 0
            while read < sent:
                ahead = send(sent) if sent < n and not refused else sent
                for i, reply in enumerate(read_replies(conn, reader, sent - read), read):
                    if isinstance(reply, ResponseError):
                        refused = refused or not _busy(reply)
                        existing += 1
                    else:
                        created[i] = True
                read, sent = sent, ahead
                refused = refused or existing * 2 >= read
            # Once Redis refuses the command itself, or half the hashes so far existed (a
            # re-run, a store the live fold filled: a refused RESTORE costs more than the
            # script alone), nothing more is sent: the script takes the rest (the round
            # already on its way is read, and what it created counts).
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        return created


def mostly_stored(client: Any, keys: pa.Array, probes: int = PROBES) -> bool:
    """Whether at least half of `probes` of the slice hashes `keys` (spread over them) exist
    already: then `RESTORE`s would mostly be refused, and the script takes them all."""
    if not len(keys):
        return False
    at = np.unique(np.linspace(0, len(keys) - 1, min(probes, len(keys))).astype(np.int64))
    pipe = client.pipeline(transaction=False)
    for name in keys.take(pa.array(at)).to_pylist():
        pipe.exists(name)
    return sum(pipe.execute()) * 2 >= len(at)


def _busy(e: Exception) -> bool:
    return str(e).startswith("BUSYKEY")


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """starts[0] .. starts[0] + lengths[0] - 1, starts[1] .., as one array."""
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + within


def plan_restores(
    token: str,
    head: tuple[str, int, int, int],
    keys: pa.Array,
    starts: np.ndarray,
    states: list[pa.Array],
    cluster: bool = False,
    limits: tuple[int, int] = ZIPLIST_LIMITS,
    ref_ms: int | None = None,
) -> Restores:
    """The RESTOREs of a backfill's slice updates (`build_calls`'s arguments, `token` =
    `b<seam>`): one per key with at most SLICES_PER_RUN slices, the rest left to the script.
    `limits`: the server's (hash-max-ziplist-entries, hash-max-ziplist-value)."""
    _, slice_ms, retention_ms, _ = head
    plan = Restores(token, head, keys, starts, list(states), cluster, ref_ms)
    n = len(keys)
    if not n:
        return plan
    texts = stored_texts(states)
    codes = keys.dictionary_encode().indices.to_numpy()
    order = _by_key_and_start(codes, starts)
    codes_s, starts_s = codes[order], starts[order]
    first = np.flatnonzero(np.diff(codes_s, prepend=-1))  # each key's first row (sorted)
    count = np.diff(np.append(first, n))
    hi = starts_s[first + count - 1]
    keep_from = keep_from_ms(hi, slice_ms, retention_ms, ref_ms)
    key_of = np.repeat(np.arange(len(first)), count)
    keep = starts_s >= keep_from[key_of]
    kept = np.bincount(key_of, weights=keep, minlength=len(first)).astype(np.int64)
    long_text = pc.binary_length(texts).to_numpy(zero_copy_only=False)[order] > MAX_STRING
    too_long = np.bincount(key_of, weights=long_text, minlength=len(first)) > 0
    restore = (count <= SLICES_PER_RUN) & ~too_long
    plan.scripted = np.sort(order[~restore[key_of]])
    if not restore.any():
        return plan
    rows = order[keep & restore[key_of]]  # kept rows of the restored keys, by key then start
    ks = np.flatnonzero(restore)
    expiry = expire_at_ms(hi[ks], slice_ms, retention_ms)
    names = keys.take(pa.array(order[first[ks]]))
    bounds = np.append(0, np.cumsum(kept[ks]))
    items = restore_items(names, expiry, bounds, starts[rows], texts.take(pa.array(rows)),
                          token[1:], limits, resp=not cluster)  # fmt: skip
    plan.kept, plan.expired = kept[ks], (count - kept)[ks]
    plan.order, plan.first, plan.count = order, first[ks], count[ks]
    if cluster:
        plan.key_names = names.to_pylist()
        plan.args = list(zip(as_text(expiry).to_pylist(), items.to_pylist(), strict=True))
    else:
        plan.commands = Spans(items)
    return plan


def restore_items(
    names: pa.Array,
    expiry: np.ndarray,
    bounds: np.ndarray,
    starts: np.ndarray,
    texts: pa.Array,
    seam: str,
    limits: tuple[int, int] = ZIPLIST_LIMITS,
    resp: bool = True,
) -> pa.Array:
    """Per hash, `RESTORE name expiry payload ABSTTL` RESP-encoded (with `resp` False, the
    payload alone). Hash i is `_b` = `seam`, `_m` = "<newest>:<oldest>" and the slices
    `starts[bounds[i]:bounds[i + 1]]` (oldest first) with their `texts`; it expires at
    `expiry[i]` (ms). Built in C where the extension is (`_dump.c`: the ziplist payload Redis
    itself would DUMP for the hash, within `limits`), else here with Arrow (the plain hash type,
    from which Redis builds the same hash)."""
    if _items_in_c is not None:
        names = names.cast(pa.binary())
        texts = texts.cast(pa.binary())
        if isinstance(texts, pa.ChunkedArray):
            texts = texts.combine_chunks()
        data, offsets = _items_in_c(
            _offsets(names), names.buffers()[2] or b"", expiry.astype(np.int64),
            bounds.astype(np.int64), starts.astype(np.int64), _offsets(texts),
            texts.buffers()[2] or b"", seam.encode(), limits[0], limits[1], resp,
        )  # fmt: skip
        return pa.Array.from_buffers(
            pa.large_binary(), len(names), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
        )
    pairs = pc.binary_join_element_wise(rdb_strings(as_text(starts)), rdb_strings(texts), b"")
    lo, hi = starts[bounds[:-1]], starts[bounds[1:] - 1]
    m = pc.binary_join_element_wise(as_text(hi), as_text(lo), ":")
    fixed = b"".join(rdb_strings(pa.array(["_b", seam, "_m"])).to_pylist())
    head_pairs = pc.binary_join_element_wise(pa.scalar(fixed), rdb_strings(m), b"")
    heads = hash_payload_heads(np.diff(bounds) + 2, head_pairs)
    payloads = hash_payloads(heads, pairs, bounds)
    return _resp_restores(names, as_text(expiry), payloads) if resp else payloads


def _offsets(values: pa.Array) -> np.ndarray:
    """A binary column's int32 offsets, from its own first value (its data buffer's)."""
    return np.frombuffer(values.buffers()[1], dtype=np.int32)[
        values.offset : values.offset + len(values) + 1
    ]


def _by_key_and_start(codes: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The order of the rows by key code, then slice start: one sort of a composite number
    (code, start) where it fits in 63 bits, else a sort on the two columns."""
    lo = int(starts.min())
    span = int(starts.max()) - lo + 1
    if (int(codes.max()) + 1) * span < (1 << 63):
        composite = codes.astype(np.int64) * span + (starts - lo)
        return np.argsort(composite, kind="stable")
    return np.lexsort((starts, codes))


def _resp_restores(names: pa.Array, expiry: pa.Array, payloads: pa.Array) -> pa.Array:
    """`RESTORE name expiry payload ABSTTL`, RESP-encoded, one value per command."""
    out = pc.binary_join_element_wise(
        b"*5\r\n$7\r\nRESTORE\r\n", resp_bulks(names), resp_bulks(expiry), resp_bulks(payloads),
        b"$6\r\nABSTTL\r\n", b"",
    )  # fmt: skip
    return out.combine_chunks() if isinstance(out, pa.ChunkedArray) else out
