"""Reading ranges of a Redis stream: XRANGE in chunks, parsed by hiredis or read as raw bytes.

Two ways to read, both over (lo, hi] in chunks of at most `count` entries:

- `read_range`: replies parsed by hiredis into nested lists of bytes (a Python object per
  field), on the process's client for the URL (`raw_client`: replies left unparsed by redis-py).
- `read_replies`: replies as columnar `StreamReply`s (`source.resp`), read as raw bytes on a
  connection of their own (`RawReplies`), so no Python object is made per entry or per field.
  A reply the columnar parser does not take (a value holding a CRLF) is parsed by hiredis
  instead, and one that is an error (a cluster's MOVED after a failover, say) is read
  again through the client, which follows redirections; so the caller sees the same entries
  either way.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import hiredis
import redis

from sluice.collector import paused
from sluice.redis.cluster import node_clients
from sluice.redis.connection import client_for
from sluice.redis.loading import wait_while_loading
from sluice.source.resp import StreamReply, parse_xrange

_clients: dict[str, Any] = {}
_raw: dict[tuple[str, str], RawReplies] = {}
_raw_lock = threading.Lock()


def _unparsed(reply: Any, **kw: Any) -> Any:
    return reply


def raw_client(url: str) -> Any:
    """A per-process client whose XRANGE replies are left unparsed (nested lists of bytes).

    Python workers are reused across tasks, so the client (and its pool) is kept per URL. On a
    cluster the replies are parsed by the client of the node that served them, so the callback
    is set on each node's client; `read_range` copes with a node added later (a failover).
    """
    client = _clients.get(url)
    if client is None:
        client = client_for(url, timeout_s=30, connect_timeout_s=10)
        for c in {id(n): n for n in [client, *node_clients(client)]}.values():
            c.set_response_callback("XRANGE", _unparsed)
            c.set_response_callback("XREVRANGE", _unparsed)
        _clients[url] = client
    return client


def forget_client(url: str) -> None:
    _clients.pop(url, None)
    with _raw_lock:
        stale = [_raw.pop(k) for k in list(_raw) if k[0] == url]
    for raw in stale:
        raw.close()


def _raw_entries(chunk: Any) -> Any:
    """Entries as XRANGE sends them, [[id, [k, v, ...]], ...], also from a client that parsed
    them into (id, {k: v}) pairs (a cluster node whose client was made after `raw_client`)."""
    if chunk and isinstance(chunk[0], tuple):
        return [[eid, [x for kv in fields.items() for x in kv]] for eid, fields in chunk]
    return chunk


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def xrange_chunk(client: Any, shard: str, after: str, hi: str, count: int) -> Any:
    """Entries (after, hi], at most `count`, parsed by hiredis (see `_raw_entries`)."""
    with paused():
        reply = client.execute_command("XRANGE", shard, f"({after}", hi, "COUNT", count)
        return _raw_entries(reply)


def _chunk(
    client: Any,
    shard: str,
    after: str,
    hi: str,
    count: int,
    on_loading: Callable[[str], None] | None,
) -> Any:
    if on_loading is None:
        return xrange_chunk(client, shard, after, hi, count)
    return wait_while_loading(
        lambda: xrange_chunk(client, shard, after, hi, count), f"XRANGE of {shard!r}", on_loading
    )


def read_range(
    client: Any,
    shard: str,
    lo: str,
    hi: str,
    count: int = 2000,
    on_loading: Callable[[str], None] | None = None,
) -> Iterator[list[Any]]:
    """Yield raw XRANGE chunks covering (lo, hi]. With `on_loading`, a chunk read while Redis
    loads its dataset is read again once it has loaded (`redis.loading.wait_while_loading`,
    which calls `on_loading(message)` meanwhile); without, LOADING is raised."""
    cursor = lo
    while True:
        chunk = _chunk(client, shard, cursor, hi, count, on_loading)
        if not chunk:
            return
        yield chunk
        if len(chunk) < count:
            return
        cursor = _text(chunk[-1][0])


class RawReplies:
    """XRANGE replies as bytes, on one connection (made like the client's, so with its auth,
    database and TLS) to the node that holds `shard`. Not for concurrent use: `fetch` holds a
    lock."""

    def __init__(self, url: str, shard: str) -> None:
        client = raw_client(url)
        if hasattr(client, "get_node_from_key"):  # a cluster: the node of the shard's slot
            client = client.get_redis_connection(client.get_node_from_key(shard))
        self.conn = client.connection_pool.make_connection()
        self.lock = threading.Lock()

    def fetch(self, shard: str, after: str, hi: str, count: int) -> bytes:
        """The raw reply of `XRANGE shard (after hi COUNT count`. Its end is found by an ECHO
        of a random token sent behind it: the bytes end with the ECHO's reply exactly when both
        replies are in (the token cannot be in the data, which was written before it existed).
        Raises redis' ConnectionError or TimeoutError (the connection is then closed)."""
        token = os.urandom(8).hex().encode()
        tail = b"$%d\r\n%s\r\n" % (len(token), token)
        with self.lock:
            conn = self.conn
            xrange = ("XRANGE", shard, f"({after}", hi, "COUNT", count)
            conn.send_packed_command(
                conn.pack_commands([xrange, ("ECHO", token)]), check_health=False
            )
            buf = bytearray()
            try:
                while not buf.endswith(tail):
                    data = conn._sock.recv(1 << 20)  # the raw bytes: see the docstring
                    if not data:
                        raise redis.exceptions.ConnectionError("redis closed the connection")
                    buf += data
                    if _both_errors(buf):  # e.g. LOADING: the ECHO failed too, no tail comes
                        return bytes(buf[: buf.index(b"\r\n") + 2])
            except TimeoutError as e:  # socket.timeout
                conn.disconnect()
                raise redis.exceptions.TimeoutError(f"reading XRANGE of {shard!r}: {e}") from e
            except OSError as e:
                conn.disconnect()
                raise redis.exceptions.ConnectionError(f"reading XRANGE of {shard!r}: {e}") from e
            except BaseException:
                conn.disconnect()
                raise
        return bytes(buf[: -len(tail)])

    def close(self) -> None:
        self.conn.disconnect()


def _both_errors(buf: bytearray) -> bool:
    """Whether `buf` holds two error replies: the XRANGE's and the ECHO's."""
    if buf[:1] != b"-":
        return False
    end = buf.find(b"\r\n")
    return buf[end + 2 : end + 3] == b"-" and buf.endswith(b"\r\n") and buf.count(b"\r\n") >= 2


def _raw_for(url: str, shard: str) -> RawReplies:
    with _raw_lock:
        raw = _raw.get((url, shard))
        if raw is None:
            raw = _raw[(url, shard)] = RawReplies(url, shard)
        return raw


def _parse(raw: bytes) -> StreamReply | list[Any] | None:
    """A columnar reply, hiredis' entries when the columnar parser declines, or None for an
    error reply (or anything that is not an XRANGE reply)."""
    reply = parse_xrange(raw)
    if reply is not None:
        return reply
    reader = hiredis.Reader()
    reader.feed(raw)
    with paused():
        entries = reader.gets()
    return entries if isinstance(entries, list) else None


def _drop_raw(url: str, shard: str) -> None:
    with _raw_lock:
        stale = _raw.pop((url, shard), None)
    if stale is not None:
        stale.close()


def read_replies(
    url: str,
    shard: str,
    lo: str,
    hi: str,
    count: int,
    on_loading: Callable[[str], None] | None = None,
) -> Iterator[StreamReply | list[Any]]:
    """Chunks covering (lo, hi] in order: columnar replies, or hiredis' entries where the
    columnar parser declined (see the module docstring). A chunk whose raw read fails (an
    error reply, a lost connection) is read through the client instead, which redirects,
    retries as it is configured to, or raises; with `on_loading`, it waits while Redis loads
    (as `read_range`)."""
    cursor = lo
    while True:
        try:
            part = _parse(_raw_for(url, shard).fetch(shard, cursor, hi, count))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            part = None
        if part is None:
            _drop_raw(url, shard)
            part = _chunk(raw_client(url), shard, cursor, hi, count, on_loading)
        n = len(part)
        if not n:
            return
        yield part
        if n < count:
            return
        last = part.last_id() if isinstance(part, StreamReply) else part[-1][0]
        cursor = _text(last)
