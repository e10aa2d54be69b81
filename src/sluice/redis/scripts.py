"""Lua scripts shipped with Sluice, run with EVALSHA (compatible with Redis 6.2)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any, TypeVar

import redis

WRITE_SLICES = "write_slices"
READ_SLICES = "read_slices"
DEAD_LETTERS = "dead_letters"
RECORD_BATCH = "record_batch"
RECORD_SAMPLE = "record_sample"
EMIT = "emit"
RELEASE = "release"
RELEASE_OFFSET = "release_offset"
LEASE = "lease"
SWAP_FIELD = "swap_field"
PRODUCE = "produce"

# Scripts that merge slice states start with the shared definitions in _merge.lua.
_WITH_MERGE = (WRITE_SLICES, READ_SLICES)
T = TypeVar("T")


@cache
def script_source(name: str) -> str:
    lua = resources.files("sluice.redis") / "lua"
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    if name in _WITH_MERGE:
        return (lua / "_merge.lua").read_text(encoding="utf-8") + "\n" + body
    return body


@cache
def script_sha(name: str) -> str:
    return hashlib.sha1(script_source(name).encode("utf-8")).hexdigest()


def evalsha_on(pipe: Any, name: str, keys: list[str], args: list[Any]) -> None:
    """Queue script `name` on a pipeline by its SHA alone (no SCRIPT EXISTS round trip).

    Run the pipeline with `execute_loading`, which loads the scripts if Redis lost them. On a
    cluster pipeline the call goes to the master of its keys' slot, so `keys` must share one
    (a CROSSSLOT call raises RedisClusterException before anything is sent). It is queued as a
    plain command: redis-py's cluster pipeline refuses its `evalsha` method, not the command.
    """
    pipe.execute_command("EVALSHA", script_sha(name), len(keys), *keys, *args)


def execute_loading(client: Any, run: Callable[[], T], names: tuple[str, ...]) -> T:
    """Call `run` (which queues and executes a pipeline); if Redis does not know one of the
    scripts (a restart, SCRIPT FLUSH, a failover), load `names` and call it once more."""
    try:
        return run()
    except redis.exceptions.NoScriptError:
        for name in names:
            client.script_load(script_source(name))
        return run()
