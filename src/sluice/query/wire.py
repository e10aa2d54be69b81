"""How the query engine's reads go over the wire.

The engine decides what to read (query meaning); this module encodes it. A batch of reads is
queued on `Commands` like on a pipeline, then sent by `aexecute` in one round trip: through a
`MuxClient` as pre-encoded RESP (the HMGETs of a cover's slice fields come from caches, since
lookups in the same minute share their covers), or through one of redis-py's asyncio pipelines.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

from sluice.redis.mux import MuxClient

# Pieces of up to this many slices have their fields cached (at most 1,024 of them, a few MB).
CACHED_PIECE_SLICES = 256


def slice_fields(first: int, last: int, step: int) -> tuple[str, ...]:
    """The hash fields of the slices first, first + step, ..., last. Lookups in the same minute
    share their covers, so the fields of short pieces repeat, and are made once."""
    if (last - first) // step < CACHED_PIECE_SLICES:
        return _cached_fields(first, last, step)
    return _make_fields(first, last, step)


def _make_fields(first: int, last: int, step: int) -> tuple[str, ...]:
    return tuple(map(str, range(first, last + 1, step)))


_cached_fields = functools.lru_cache(maxsize=1024)(_make_fields)


def _fields_resp(first: int, last: int, step: int) -> bytes:
    """slice_fields as RESP bulk strings: the tail of an HMGET command."""
    if (last - first) // step < CACHED_PIECE_SLICES:
        return _cached_resp(first, last, step)
    return _make_resp(first, last, step)


def _make_resp(first: int, last: int, step: int) -> bytes:
    return b"".join(
        b"$%d\r\n%s\r\n" % (len(f), f.encode()) for f in slice_fields(first, last, step)
    )


_cached_resp = functools.lru_cache(maxsize=1024)(_make_resp)


class Hmget(NamedTuple):
    key: str
    first: int
    last: int
    step: int

    def resp(self) -> bytes:
        """The whole command, RESP-encoded, from the cached fields."""
        key = self.key.encode()
        n = (self.last - self.first) // self.step + 1
        head = b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (n + 2, len(key), key)
        return head + _fields_resp(self.first, self.last, self.step)

    def args(self) -> tuple[str, ...]:
        return ("HMGET", self.key, *slice_fields(self.first, self.last, self.step))


class Commands(list[Any]):
    """Commands queued like on a pipeline (argument tuples, or `Hmget`s), to be sent by
    `aexecute`."""

    def execute_command(self, *args: Any) -> None:
        self.append(args)

    def hmget_slices(self, key: str, first: int, last: int, step: int) -> None:
        self.append(Hmget(key, first, last, step))


async def aexecute(aclient: Any, commands: Sequence[Any]) -> list[Any]:
    if isinstance(aclient, MuxClient):
        return await aclient.execute([c.resp() if isinstance(c, Hmget) else c for c in commands])
    pipe = aclient.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*(command.args() if isinstance(command, Hmget) else command))
    return list(await pipe.execute())
