"""The calls of `write_slices.lua`: built from Arrow columns, sent as raw commands.

One call carries up to KEYS_PER_CALL slice hashes of one metric resolution (on Redis Cluster,
of one slot): per key its expiry (`n:expiry` when it carries n > 1 slices), then the slices
(start and the state's numbers as text; from a backfill, start and the text as stored).

A key's slices go in runs of at most SLICES_PER_RUN (the script hands a run's fields to one
HMGET or HSET, and Lua unpacks at most about 8,000 values), a long run of one key as several
runs in a row, and a call closes once it carries SLICES_PER_CALL slices: Redis 6.2 refuses a
command of more than 1,048,576 arguments, and a call blocks every other client while it runs.
A backfill hands a key's whole history to one call, and a replay after an outage can carry
hours of one key.

`build_calls` makes every call of a partition's updates with Arrow kernels: rows grouped by
key, the RESP encoding of every argument done on whole columns, and a call's bytes cut out of
those buffers; nothing runs per row in Python.
The calls go out pipelined on one connection, CALLS_PER_ROUND_TRIP at a time, the next round
sent before the replies of the last are read, and each reply must account for every slice its
call carried (applied + duplicate + expired), or the call counts as failed and the audit sees
its rows as not applied.

`run_write_script` takes the same calls as Python lists, one item per key, for the few writes
that are not made from columns (sketch blobs) and for tools that write slices directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.redis.keys import key_slot
from sluice.redis.scripts import WRITE_SLICES, evalsha_on, script_sha, script_source

KEYS_PER_CALL = 500
BACKFILL_TOKEN = "0"  # the token a backfill's slices are stored under (write_slices.lua)
SLICES_PER_RUN = 1024
SLICES_PER_CALL = 16_384
CALLS_PER_ROUND_TRIP = 8


def expiry_step_ms(slice_ms: int, retention_ms: int) -> int:
    """How finely a slice hash's expiry moves (see write_slices.lua): a sixteenth of the
    retention, at least a slice, so that a key lives at most that much past its retention."""
    return max(slice_ms, retention_ms // 16)


def expire_at_ms(newest_ms: Any, slice_ms: int, retention_ms: int) -> Any:
    """When a slice hash whose newest slice starts at `newest_ms` expires (ints or an int64
    array): newest + slice + retention, rounded up to a multiple of `expiry_step_ms`."""
    step = expiry_step_ms(slice_ms, retention_ms)
    return -(-(newest_ms + slice_ms + retention_ms) // step) * step


def keep_from_ms(newest_ms: Any, slice_ms: int, retention_ms: int, ref_ms: int | None) -> Any:
    """The first slice start a hash whose newest slice starts at `newest_ms` keeps (ints or an
    int64 array), as write_slices.lua decides it: a retention before its newest slice, or before
    the slice of the writer's reference time `ref_ms` where the newest is ahead of that (an
    event stamped in the future); None: the newest slice's."""
    if ref_ms is None:
        return newest_ms - retention_ms
    return np.minimum(newest_ms, ref_ms - ref_ms % slice_ms) - retention_ms


def script_head(
    token: int | str, state: str, slice_ms: int, retention_ms: int, width: int, ref_ms: int | None
) -> list[str]:
    """write_slices.lua's ARGV[1..7]: the token, the state, slice_ms, retention_ms, width, the
    expiry step and the writer's reference time (`keep_from_ms`; empty for none)."""
    step = expiry_step_ms(slice_ms, retention_ms)
    ref = "" if ref_ms is None else str(ref_ms)
    return [str(token), state, str(slice_ms), str(retention_ms), str(width), str(step), ref]


def as_text(values: np.ndarray) -> pa.Array:
    return pc.cast(pa.array(values), pa.string())


def _key_heads(counts: np.ndarray, expire: np.ndarray) -> pa.Array:
    """Each key's argument: its expiry, or `n:expiry` when it carries n > 1 slices."""
    expire_s = as_text(expire)
    return pc.if_else(
        pa.array(counts == 1), expire_s, pc.binary_join_element_wise(as_text(counts), expire_s, ":")
    )


def key_head(n: int, expire_ms: int) -> str:
    """`_key_heads` for one key."""
    return str(expire_ms) if n == 1 else f"{n}:{expire_ms}"


def _interleave(columns: Sequence[pa.Array]) -> pa.Array:
    """[a0, b0, .., a1, b1, ..]: the columns' values row by row."""
    if len(columns) == 1:
        return columns[0]
    n = len(columns[0])
    order = (np.arange(len(columns))[None, :] * n + np.arange(n)[:, None]).ravel()
    return pa.concat_arrays([c.cast(pa.string()) for c in columns]).take(pa.array(order))


def resp_bulks(values: pa.Array) -> pa.Array:
    """Each value (text or binary) RESP-encoded as a bulk string, `$<len>\\r\\n<value>\\r\\n`."""
    values = values.cast(pa.binary())
    lens = pc.cast(pc.binary_length(values), pa.string()).cast(pa.binary())
    enc = pc.binary_join_element_wise(b"$", lens, b"\r\n", values, b"\r\n", b"")
    return enc.combine_chunks() if isinstance(enc, pa.ChunkedArray) else enc


def stored_texts(states: Sequence[pa.Array]) -> pa.Array:
    """A backfill's slice states (one text column per number) as the texts they are stored as,
    `0:v1:..:v_width` (BACKFILL_TOKEN first)."""
    return pc.binary_join_element_wise(pa.scalar(BACKFILL_TOKEN), *states, ":")


class Spans:
    """A binary (or string) column whose runs of values are cut out as bytes without a copy per
    value: RESP-encoded arguments or whole commands, sent as they lie."""

    def __init__(self, values: pa.Array) -> None:
        self.data = values.buffers()[2]
        wide = pa.types.is_large_binary(values.type) or pa.types.is_large_string(values.type)
        self.offsets = np.frombuffer(values.buffers()[1], dtype=np.int64 if wide else np.int32)[
            values.offset : values.offset + len(values) + 1
        ]

    def bytes(self, a: int, b: int) -> bytes:
        start, end = int(self.offsets[a]), int(self.offsets[b])
        return self.data[start:end].to_pybytes()


def _bulk(*values: str) -> bytes:
    return b"".join(b"$%d\r\n%s\r\n" % (len(v.encode()), v.encode()) for v in values)


@dataclass
class Calls:
    """The calls of one metric resolution. `payloads` holds each call's RESP command (None on
    a cluster), `argv` its (keys, args) as Python lists (on a cluster only), `slices` how many
    slices it carries, and `row_call` the call that writes each input row."""

    payloads: list[bytes | None]
    argv: list[tuple[list[Any], list[Any]]]
    slices: list[int]
    row_call: np.ndarray


def _key_runs(
    keys: pa.Array, cluster: bool, starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, run_start, key_call): the rows grouped by key (by slot first, on a cluster; each
    key's by `starts` when given), where each run of rows starts in that order (a key's rows,
    cut every SLICES_PER_RUN), and
    the call of each run: a new call every KEYS_PER_CALL runs, wherever the slot changes, and
    once a call carries SLICES_PER_CALL slices. Keys are grouped by their codes in a
    dictionary encoding (a hash table), not sorted as strings: a call needs a key's rows
    together, not the keys in order."""
    n = len(keys)
    coded = keys.dictionary_encode()
    codes = coded.indices.to_numpy()
    row_slot = None
    if cluster:
        slots = np.array([key_slot(k) for k in coded.dictionary.to_pylist()], dtype=np.int64)
        row_slot = slots[codes]
        order = np.lexsort((codes, row_slot) if starts is None else (starts, codes, row_slot))
    elif starts is None:
        order = np.argsort(codes, kind="stable")
    else:
        order = np.lexsort((starts, codes))
    codes_s = codes[order]
    new_key = np.ones(n, dtype=bool)
    new_key[1:] = codes_s[1:] != codes_s[:-1]
    run_start = split_runs(np.flatnonzero(new_key), n, SLICES_PER_RUN)
    boundary = np.zeros(len(run_start), dtype=bool)
    boundary[0] = True
    if row_slot is not None:
        run_slot = row_slot[order][run_start]
        boundary[1:] = run_slot[1:] != run_slot[:-1]
    block = run_start // SLICES_PER_CALL  # rows are contiguous: run_start counts the slices
    boundary[1:] |= block[1:] != block[:-1]
    local = np.arange(len(run_start)) - np.flatnonzero(boundary)[np.cumsum(boundary) - 1]
    key_call = np.cumsum(boundary | (local % KEYS_PER_CALL == 0)) - 1
    return order, run_start, key_call


def split_runs(run_start: np.ndarray, n: int, most: int) -> np.ndarray:
    """The starts of runs (`run_start`, over `n` rows) with each run longer than `most` cut
    into runs of `most` (the last one shorter)."""
    lengths = np.diff(np.append(run_start, n))
    pieces = np.maximum(1, -(-lengths // most))
    if (pieces == 1).all():
        return run_start
    first = np.cumsum(pieces) - pieces
    within = np.arange(int(pieces.sum())) - np.repeat(first, pieces)
    return np.repeat(run_start, pieces) + within * most


def build_calls(
    token: int | str,
    head: tuple[str, int, int, int],
    keys: pa.Array,
    starts: np.ndarray,
    states: Sequence[pa.Array],
    cluster: bool = False,
    ref_ms: int | None = None,
) -> Calls:
    """The write_slices.lua calls for slice updates of one metric resolution: per row its slice
    hash `keys`, its slice `starts` (ms) and its state's numbers as text (`states`, one column
    per number). `head` is (state, slice_ms, retention_ms, width); a (key, slice) pair appears
    once (the fold's rows are unique per (group, key, slice)). `token` is a writer token, or a
    backfill's `b<seam>` (write_slices.lua), whose slices go as the text they are stored as,
    each key's in ascending order. `ref_ms` is the writer's reference time (`keep_from_ms`)."""
    state, slice_ms, retention_ms, width = head
    n = len(keys)
    if not n:
        return Calls([], [], [], np.zeros(0, dtype=np.int64))
    backfill = str(token).startswith("b")
    if backfill:
        states = [stored_texts(states)]
    order, run_start, key_call = _key_runs(keys, cluster, starts if backfill else None)
    take = pa.array(order)
    run_keys = keys.take(take).take(pa.array(run_start))
    starts_s = starts[order]
    counts = np.diff(np.append(run_start, n))
    expire = expire_at_ms(np.maximum.reduceat(starts_s, run_start), slice_ms, retention_ms)
    per_key = _key_heads(counts, expire)
    slice_args = _interleave([as_text(starts_s), *[st.take(take) for st in states]])
    head_args = script_head(token, state, slice_ms, retention_ms, width, ref_ms)
    call_keys = np.append(np.flatnonzero(np.diff(key_call, prepend=-1)), len(run_keys))
    call_rows = np.append(run_start, n)[call_keys]
    calls = Calls([], [], [], np.repeat(key_call, counts)[np.argsort(order)])
    stride = len(states) + 1
    enc = None if cluster else [Spans(resp_bulks(x)) for x in (run_keys, per_key, slice_args)]
    head_bytes = _bulk(*head_args)
    for c in range(len(call_keys) - 1):
        ka, kb = int(call_keys[c]), int(call_keys[c + 1])
        ra, rb = int(call_rows[c]), int(call_rows[c + 1])
        calls.slices.append(rb - ra)
        if enc is None:
            args = [*head_args, *per_key.slice(ka, kb - ka).to_pylist(),
                    *slice_args.slice(stride * ra, stride * (rb - ra)).to_pylist()]  # fmt: skip
            calls.argv.append((run_keys.slice(ka, kb - ka).to_pylist(), args))
            calls.payloads.append(None)
            continue
        nk = kb - ka
        size = 3 + nk + len(head_args) + nk + stride * (rb - ra)
        calls.payloads.append(
            b"*%d\r\n" % size
            + _bulk("EVALSHA", script_sha(WRITE_SLICES), str(nk))
            + enc[0].bytes(ka, kb)
            + head_bytes
            + enc[1].bytes(ka, kb)
            + enc[2].bytes(stride * ra, stride * rb)
        )
    return calls


REPLY_COUNTS = 4  # write_slices.lua's reply: applied, duplicate, expired, before the seam


def send_calls(client: Any, calls: Calls) -> tuple[list[int], np.ndarray]:
    """Run `calls`: ([applied, duplicate, expired, before seam] summed, and per call whether it
    failed, i.e.
    its reply did not account for every slice it carried). Raises on an error reply (after
    reading every reply sent) or a lost connection, as the pipeline would."""
    totals = [0] * REPLY_COUNTS
    failed = np.zeros(len(calls.slices), dtype=bool)
    if not calls.slices:
        return totals, failed
    client.script_load(script_source(WRITE_SLICES))  # then EVALSHA only
    if calls.payloads[0] is None:
        replies = _run_pipelined(client, calls.argv)
    else:
        replies = _run_raw(client, [p for p in calls.payloads if p is not None])
    for c, res in enumerate(replies):
        for j in range(REPLY_COUNTS):
            totals[j] += int(res[j])
        failed[c] = sum(int(x) for x in res[:REPLY_COUNTS]) != calls.slices[c]
    return totals, failed


def _run_raw(client: Any, payloads: list[bytes]) -> list[Any]:
    pool = client.connection_pool
    conn = pool.get_connection()
    replies: list[Any] = []
    error: Exception | None = None
    parts = [payloads[i : i + CALLS_PER_ROUND_TRIP]
             for i in range(0, len(payloads), CALLS_PER_ROUND_TRIP)]  # fmt: skip
    reader = hiredis.Reader(replyError=ResponseError)
    try:
        conn.send_packed_command(parts[0])
        for j, part in enumerate(parts):
            # The next round leaves before this one's replies are read, so Redis, which never
            # waits on a client to read, always has a call to run (replies are 3 integers).
            if j + 1 < len(parts):
                conn.send_packed_command(parts[j + 1])
            for reply in read_replies(conn, reader, len(part)):
                if isinstance(reply, ResponseError):
                    error = error or reply
                    reply = [0] * REPLY_COUNTS
                replies.append(reply)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    if error is not None:
        raise error
    return replies


def read_replies(conn: Any, reader: Any, n: int) -> list[Any]:
    """The next `n` replies on `conn` (a redis-py connection that nothing else reads from),
    parsed by `reader` (a `hiredis.Reader` whose `replyError` is ResponseError, kept for the
    connection's next read) straight from its socket: an error reply comes back as a
    ResponseError, not raised. redis-py's own read costs about 1 µs of Python per reply, as
    much as building a backfill's `RESTORE`. Raises redis' ConnectionError or TimeoutError."""
    replies: list[Any] = []
    gets = reader.gets
    while len(replies) < n:
        reply = gets()
        if reply is not False:
            replies.append(reply)
            continue
        try:
            data = conn._sock.recv(1 << 20)  # raw bytes, as `source.xrange` reads them
        except TimeoutError as e:  # socket.timeout
            raise RedisTimeoutError(f"reading replies from redis: {e}") from e
        except OSError as e:
            raise RedisConnectionError(f"reading replies from redis: {e}") from e
        if not data:
            raise RedisConnectionError("redis closed the connection")
        reader.feed(data)
    return replies


def _run_pipelined(client: Any, argv: list[tuple[list[Any], list[Any]]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for keys, args in argv:
        evalsha_on(pipe, WRITE_SLICES, keys, args)
    return list(pipe.execute())


def _stored_texts(body: list[Any], width: int) -> list[Any]:
    """A backfill's (start, v1 .. v_width) slices as (start, text as stored), in ascending
    order of start (write_slices.lua). Values are text, or bytes (a sketch's blob)."""
    slices = sorted(
        (int(body[i]), body[i + 1 : i + 1 + width]) for i in range(0, len(body), width + 1)
    )
    out: list[Any] = []
    for start, values in slices:
        if isinstance(values[0], bytes):
            text: Any = b":".join([BACKFILL_TOKEN.encode(), *values])
        else:
            text = ":".join([BACKFILL_TOKEN, *map(str, values)])
        out += [str(start), text]
    return out


def run_write_script(
    client: Any,
    token: int | str,
    calls: list[tuple[str, list[Any], tuple[Any, ...]]],
    failed: set[tuple[Any, ...]],
    cluster: bool = False,
    ref_ms: int | None = None,
) -> list[int]:
    """Run write_slices.lua over (key, args, dep) items, one per slice hash: `args` is
    `state, slice_ms, retention_ms, n, width` then n times `slice_start, v1 .. v_width`. Items
    with the same head share calls (of one slot on a cluster), cut as `build_calls` cuts them
    (SLICES_PER_RUN, KEYS_PER_CALL, SLICES_PER_CALL), pipelined. A call whose reply does not
    account for every slice it carried puts the deps of its keys in `failed`. Returns
    [applied, duplicate, expired, before seam]. `token` is a writer token, or a backfill's
    `b<seam>` (write_slices.lua); `ref_ms` the writer's reference time (`keep_from_ms`)."""
    client.script_load(script_source(WRITE_SLICES))
    backfill = str(token).startswith("b")
    groups: dict[tuple[Any, ...], list[tuple[str, list[Any], tuple[Any, ...]]]] = {}
    for key, args, dep in calls:
        state, slice_ms, retention_ms, _, width = args[:5]
        slot = key_slot(key) if cluster else 0
        runs = groups.setdefault((state, int(slice_ms), int(retention_ms), int(width), slot), [])
        body = _stored_texts(args[5:], int(width)) if backfill else args[5:]
        stride = (1 if backfill else int(width)) + 1
        at = stride * SLICES_PER_RUN
        runs += [(key, body[j : j + at], dep) for j in range(0, len(body), at)]
    argv: list[tuple[list[Any], list[Any]]] = []
    deps: list[tuple[int, list[tuple[Any, ...]]]] = []
    for (state, slice_ms, retention_ms, width, _), runs in groups.items():
        head = script_head(token, state, slice_ms, retention_ms, width, ref_ms)
        stride = (1 if backfill else width) + 1
        j = 0
        while j < len(runs):
            chunk: list[tuple[str, list[Any], tuple[Any, ...]]] = []
            slices = 0
            while j < len(runs) and len(chunk) < KEYS_PER_CALL and slices < SLICES_PER_CALL:
                chunk.append(runs[j])
                slices += len(runs[j][1]) // stride
                j += 1
            per_key: list[Any] = []
            flat: list[Any] = []
            for _, body, _ in chunk:
                newest = max(int(s) for s in body[0::stride])
                expire = expire_at_ms(newest, slice_ms, retention_ms)
                per_key.append(key_head(len(body) // stride, expire))
                flat += body
            argv.append(([key for key, _, _ in chunk], [*head, *per_key, *flat]))
            deps.append((slices, [d for _, _, d in chunk]))
    totals = [0] * REPLY_COUNTS
    for res, (expected, call_deps) in zip(_run_pipelined(client, argv), deps, strict=True):
        for j in range(REPLY_COUNTS):
            totals[j] += int(res[j])
        if sum(int(x) for x in res[:REPLY_COUNTS]) != expected:
            failed.update(call_deps)
    return totals
