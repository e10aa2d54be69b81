"""Lua scripts shipped with Sluice, loaded once per client (EVALSHA, compatible with Redis 6.2)."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def script_source(name: str) -> str:
    return (resources.files("sluice.redis") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


WRITE_SLICES = "write_slices"
READ_SLICES = "read_slices"
DEAD_LETTERS = "dead_letters"
ADVANCE = "advance"
RECORD_BATCH = "record_batch"
