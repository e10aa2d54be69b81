"""Lua scripts shipped with Sluice, loaded once per client (EVALSHA, compatible with Redis 6.2)."""

from __future__ import annotations

from functools import cache
from importlib import resources

# Scripts that merge slice states start with the shared definitions in _merge.lua.
_WITH_MERGE = ("write_slices", "read_slices")


@cache
def script_source(name: str) -> str:
    lua = resources.files("sluice.redis") / "lua"
    body = (lua / f"{name}.lua").read_text(encoding="utf-8")
    if name in _WITH_MERGE:
        return (lua / "_merge.lua").read_text(encoding="utf-8") + "\n" + body
    return body


WRITE_SLICES = "write_slices"
READ_SLICES = "read_slices"
DEAD_LETTERS = "dead_letters"
ADVANCE = "advance"
RECORD_BATCH = "record_batch"
