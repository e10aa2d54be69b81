"""The write_slices.lua calls built on columns (`pipeline.slice_writes.build_calls`): whatever
the rows, every update is carried by exactly one call, under its own key, with its key's count
(written only when over one) and expiry, and a call's keys fit the limits (and one slot on a
cluster)."""

from __future__ import annotations

from typing import Any

import hiredis
import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.pipeline import slice_writes
from sluice.pipeline.slice_writes import build_calls, expire_at_ms, expiry_step_ms
from sluice.redis.keys import key_slot
from sluice.redis.scripts import WRITE_SLICES, script_sha

SLICE_MS, RETENTION_MS = 10_000, 3_600_000


def _parse(payload: bytes) -> list[Any]:
    reader = hiredis.Reader()
    reader.feed(payload)
    command = reader.gets()
    assert reader.gets() is False, "one command per payload"
    return [x.decode() for x in command]


@st.composite
def updates(draw: Any) -> tuple[list[str], list[int], list[list[str]]]:
    keys = draw(st.lists(st.sampled_from([f"k{i}" for i in range(40)] + ["a|b", "{x}", ""]),
                         max_size=120))  # fmt: skip
    cells = sorted({(k, draw(st.integers(0, 30)) * SLICE_MS) for k in keys})
    width = draw(st.integers(1, 3))
    states = [[str(draw(st.integers(-5, 5))) for _ in cells] for _ in range(width)]
    return [k for k, _ in cells], [s for _, s in cells], states


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(updates(), st.booleans(), st.sampled_from([1, 3, 500]))
def test_every_update_is_in_exactly_one_call(
    data: tuple[list[str], list[int], list[list[str]]], cluster: bool, per_call: int
) -> None:
    keys, starts, states = data
    rng = np.random.default_rng(len(keys))
    perm = rng.permutation(len(keys))  # rows come in any order
    keys = [keys[i] for i in perm]
    starts = [starts[i] for i in perm]
    states = [[col[i] for i in perm] for col in states]
    width = len(states)
    old = slice_writes.KEYS_PER_CALL
    slice_writes.KEYS_PER_CALL = per_call
    try:
        calls = build_calls(
            7, ("sum", SLICE_MS, RETENTION_MS, width), pa.array(keys, pa.string()),
            np.array(starts, dtype=np.int64), [pa.array(c, pa.string()) for c in states], cluster,
        )  # fmt: skip
    finally:
        slice_writes.KEYS_PER_CALL = old
    seen: dict[tuple[str, int], tuple[int, list[str]]] = {}
    step = str(expiry_step_ms(SLICE_MS, RETENTION_MS))
    for c, slices in enumerate(calls.slices):
        if cluster:
            call_keys, args = calls.argv[c]
        else:
            payload = calls.payloads[c]
            assert payload is not None
            argv = _parse(payload)
            assert argv[:2] == ["EVALSHA", script_sha(WRITE_SLICES)]
            nk = int(argv[2])
            call_keys, args = argv[3 : 3 + nk], argv[3 + nk :]
        assert 1 <= len(call_keys) <= per_call and len(set(call_keys)) == len(call_keys)
        if cluster:
            assert len({key_slot(k) for k in call_keys}) == 1
        assert args[:6] == ["7", "sum", str(SLICE_MS), str(RETENTION_MS), str(width), step]
        heads = args[6 : 6 + len(call_keys)]
        body = args[6 + len(call_keys) :]
        # A key's head is its expiry, or "n:expiry" when it carries n > 1 slices.
        per_key = [h.split(":") if ":" in h else ["1", h] for h in heads]
        assert all(int(h.split(":")[0]) > 1 for h in heads if ":" in h)
        assert sum(int(n) for n, _ in per_key) == slices == len(body) // (width + 1)
        at = 0
        for key, (n, expire) in zip(call_keys, per_key, strict=True):
            mine = [body[at + i * (width + 1) : at + (i + 1) * (width + 1)] for i in range(int(n))]
            at += int(n) * (width + 1)
            newest = max(int(s[0]) for s in mine)
            assert int(expire) == expire_at_ms(newest, SLICE_MS, RETENTION_MS)
            for s in mine:
                assert (key, int(s[0])) not in seen
                seen[(key, int(s[0]))] = (c, s[1:])
    assert len(seen) == len(keys)
    for row, (k, s) in enumerate(zip(keys, starts, strict=True)):
        call, values = seen[(k, s)]
        assert call == calls.row_call[row]
        assert values == [col[row] for col in states]


def test_expiry_is_rounded_up_to_its_step() -> None:
    step = expiry_step_ms(SLICE_MS, RETENTION_MS)
    assert step == RETENTION_MS // 16
    due = 1_700_000_000_000 + SLICE_MS + RETENTION_MS
    at = expire_at_ms(1_700_000_000_000, SLICE_MS, RETENTION_MS)
    assert at % step == 0 and due <= at < due + step
    assert expiry_step_ms(60_000, 600_000) == 60_000  # never finer than a slice
