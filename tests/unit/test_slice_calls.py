"""The write_slices.lua calls built on columns (`pipeline.slice_writes.build_calls`): whatever
the rows, every update is carried by exactly one call, under its own key, with its run's count
(written only when over one) and expiry, and a call's keys and slices fit the limits (and one
slot on a cluster)."""

from __future__ import annotations

from typing import Any

import hiredis
import numpy as np
import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.pipeline import slice_writes
from sluice.pipeline.slice_writes import build_calls, expire_at_ms, expiry_step_ms, split_runs
from sluice.redis.keys import key_slot
from sluice.redis.scripts import WRITE_SLICES, script_sha

SLICE_MS, RETENTION_MS = 10_000, 3_600_000
REF_MS = 1_700_000_012_345  # the writer's reference time (write_slices.lua's ARGV[7])


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
@given(updates(), st.booleans(), st.sampled_from([1, 3, 500]), st.sampled_from([1, 4, 1024]),
       st.sampled_from([5, 16_384]), st.sampled_from([7, "b1700000000000"]))  # fmt: skip
def test_every_update_is_in_exactly_one_call(
    data: tuple[list[str], list[int], list[list[str]]],
    cluster: bool,
    per_call: int,
    per_run: int,
    slices_per_call: int,
    token: int | str,
) -> None:
    """A backfill's slices (token `b<seam>`) go as their stored text, `0:v1:..`, each key's in
    ascending order of start; the live fold's as numbers, in any order."""
    keys, starts, states = data
    rng = np.random.default_rng(len(keys))
    perm = rng.permutation(len(keys))  # rows come in any order
    keys = [keys[i] for i in perm]
    starts = [starts[i] for i in perm]
    states = [[col[i] for i in perm] for col in states]
    width = len(states)
    backfill = token != 7
    limits = {"KEYS_PER_CALL": per_call, "SLICES_PER_RUN": per_run,
              "SLICES_PER_CALL": slices_per_call}  # fmt: skip
    old = {name: getattr(slice_writes, name) for name in limits}
    for name, value in limits.items():
        setattr(slice_writes, name, value)
    try:
        calls = build_calls(
            token, ("sum", SLICE_MS, RETENTION_MS, width), pa.array(keys, pa.string()),
            np.array(starts, dtype=np.int64), [pa.array(c, pa.string()) for c in states], cluster,
            REF_MS,
        )  # fmt: skip
    finally:
        for name, value in old.items():
            setattr(slice_writes, name, value)
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
        assert 1 <= len(call_keys) <= per_call
        assert slices < slices_per_call + per_run
        if cluster:
            assert len({key_slot(k) for k in call_keys}) == 1
        assert args[:7] == [str(token), "sum", str(SLICE_MS), str(RETENTION_MS), str(width), step,
                            str(REF_MS)]  # fmt: skip
        heads = args[7 : 7 + len(call_keys)]
        body = args[7 + len(call_keys) :]
        # A key's head is its expiry, or "n:expiry" when it carries n > 1 slices.
        per_key = [h.split(":") if ":" in h else ["1", h] for h in heads]
        assert all(int(h.split(":")[0]) > 1 for h in heads if ":" in h)
        stride = 2 if backfill else width + 1
        assert sum(int(n) for n, _ in per_key) == slices == len(body) // stride
        at = 0
        firsts = [k for j, k in enumerate(call_keys) if j == 0 or call_keys[j - 1] != k]
        assert len(set(firsts)) == len(firsts)  # a key's runs come one after another
        for j, (n, _) in enumerate(per_key):
            assert 1 <= int(n) <= per_run
            if j + 1 < len(call_keys) and call_keys[j + 1] == call_keys[j]:
                assert int(n) == per_run  # only a full run is followed by more of its key
        for key, (n, expire) in zip(call_keys, per_key, strict=True):
            mine = [body[at + i * stride : at + (i + 1) * stride] for i in range(int(n))]
            at += int(n) * stride
            if backfill:
                assert [int(s[0]) for s in mine] == sorted(int(s[0]) for s in mine)
                assert all(s[1].startswith("0:") for s in mine)
                mine = [[s[0], *s[1].split(":")[1:]] for s in mine]
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


def test_long_runs_are_cut_into_runs_of_at_most_the_limit() -> None:
    assert split_runs(np.array([0, 3, 10]), 12, 4).tolist() == [0, 3, 7, 10]
    assert split_runs(np.array([0]), 9, 3).tolist() == [0, 3, 6]
    assert split_runs(np.array([0, 1]), 2, 3).tolist() == [0, 1]


def test_expiry_is_rounded_up_to_its_step() -> None:
    step = expiry_step_ms(SLICE_MS, RETENTION_MS)
    assert step == RETENTION_MS // 16
    due = 1_700_000_000_000 + SLICE_MS + RETENTION_MS
    at = expire_at_ms(1_700_000_000_000, SLICE_MS, RETENTION_MS)
    assert at % step == 0 and due <= at < due + step
    assert expiry_step_ms(60_000, 600_000) == 60_000  # never finer than a slice
