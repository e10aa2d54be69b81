"""How the query engine's reads go over the wire.

The engine decides what to read (query meaning); this module encodes it. A batch of reads is
queued on `Commands` like on a pipeline, then sent by `aexecute` in one round trip: through a
`MuxClient` as pre-encoded RESP (the HMGETs of a cover's slice fields come from caches, since
lookups in the same minute share their covers), or through one of redis-py's asyncio pipelines.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

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


def hmget_resp(key: str, first: int, last: int, step: int) -> bytes:
    """The HMGET of the slices first, first + step, ..., last of `key`, RESP-encoded, from the
    cached fields."""
    k = key.encode()
    head = b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % ((last - first) // step + 3, len(k), k)
    return head + _fields_resp(first, last, step)


class Commands(list[Any]):
    """Commands queued like on a pipeline, to be sent by `aexecute`: argument tuples, and for a
    `MuxClient` (`commands_for`) the HMGETs of slices already RESP-encoded as they are queued."""

    def __init__(self, resp: bool = False) -> None:
        super().__init__()
        self.resp = resp

    def execute_command(self, *args: Any) -> None:
        self.append(args)

    def hmget_slices(self, key: str, first: int, last: int, step: int) -> None:
        if self.resp:
            self.append(hmget_resp(key, first, last, step))
        else:
            self.append(("HMGET", key, *slice_fields(first, last, step)))


def commands_for(aclient: Any) -> Commands:
    """An empty batch of commands for `aclient` (see `Commands`)."""
    return Commands(resp=isinstance(aclient, MuxClient))


async def aexecute(aclient: Any, commands: Sequence[Any]) -> list[Any]:
    """The replies to `commands` in one round trip. Pre-encoded commands go to a `MuxClient`
    only (`commands_for`)."""
    if isinstance(aclient, MuxClient):
        return await aclient.execute(commands)
    pipe = aclient.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return list(await pipe.execute())
