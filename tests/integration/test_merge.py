"""Slice states merged in the server (`Agg.merge`, from HMGET) against the same slices merged
in Redis by read_slices.lua: identical for every state but `var`, whose two-pass merge agrees to
rounding. And the engine's switch between the two at RAW_MAX_SLICES keeps the answers."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import redis

from sluice.query import engine as engine_module
from sluice.query.engine import QueryEngine
from sluice.redis.keys import encode_key, slice_hash_key
from sluice.redis.scripts import READ_SLICES, script_source
from sluice.slices.aggs import AGGS, Agg
from sluice.slices.state import encode_state
from tests.conftest import make_config

SLICE = 60_000
T0 = 1_700_000_000_000 // SLICE * SLICE
# One agg per state merged by the slice scripts (stddev and variance share `var`).
BY_STATE: dict[str, Agg] = {a.state: a for a in AGGS.values() if a.lua}


def _state(agg: str, rng: random.Random) -> str:
    if agg == "count":
        vals = [rng.randint(1, 50)]
    elif agg in ("sum", "min", "max"):
        vals = [rng.choice([rng.uniform(-1e6, 1e6), rng.randint(-99, 99), rng.random() / 7])]
    elif agg == "avg":
        vals = [rng.randint(1, 30), rng.uniform(-1e3, 1e3)]
    elif agg in ("last", "first"):  # few distinct times, so ties are common
        vals = [T0 + rng.randint(0, 5), rng.choice([1.5, -2.0, rng.uniform(0, 9)])]
    elif agg == "var":  # count, mean, M2
        vals = [rng.randint(1, 40), rng.uniform(1e5, 1e5 + 10), rng.uniform(0, 500)]
    else:
        raise AssertionError(f"no random states for {agg!r}: add them here")
    return encode_state(rng.randint(1, 10**12), vals)


@pytest.mark.parametrize("agg", sorted(BY_STATE))
def test_server_merge_equals_the_scripts(r: redis.Redis, agg: str) -> None:
    rng = random.Random(agg)
    sha = r.script_load(script_source(READ_SLICES))
    for trial in range(40):
        key = f"h:{agg}:{trial}"
        n = rng.choice([1, 2, 7, 60, 300])
        fields = {str(T0 + i * SLICE): _state(agg, rng) for i in range(n) if rng.random() < 0.8}
        if fields:
            r.hset(key, mapping=fields)
        last = T0 + (n - 1) * SLICE
        script = r.evalsha(sha, 1, key, agg, T0, last, SLICE)
        raw = r.hmget(key, [str(T0 + i * SLICE) for i in range(n)])
        mine = BY_STATE[agg].merge(raw)
        assert int(mine[0]) == int(script[0]) == len(fields)
        want = [float(v) for v in script[1:]]
        if agg == "var" and fields:
            assert mine[1] == want[0]
            assert mine[2] == pytest.approx(want[1], rel=1e-12)
            assert mine[3] == pytest.approx(want[2], rel=1e-9, abs=1e-6)
        else:
            assert mine[1:] == want


def test_malformed_state_is_refused() -> None:
    with pytest.raises(ValueError, match="2 numbers for 'avg'"):
        AGGS["avg"].merge([b"1:2:3", b"1:2"])


def test_answers_agree_on_both_sides_of_the_raw_limit(
    r: redis.Redis, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same lookups read raw (HMGET, merged here) and through read_slices.lua answer alike."""
    rng = random.Random(5)
    now = time.time_ns() // 1_000_000
    newest = now // 10_000 * 10_000
    cfg = make_config(redis_url, tmp_path)
    for name in ("txn_count", "card_min", "card_last", "card_first", "avg_amount"):
        m = cfg.metric(name)
        assert m is not None
        agg = AGGS[m.agg].state
        for card in ("c1", "c2"):
            key = slice_hash_key(name, encode_key([card] * len(m.key)))
            states = {
                str(newest - m.slice * i): _state(agg, rng) for i in range(50) if rng.random() < 0.6
            }
            r.hset(key, mapping={**states, "_m": f"{newest}:0"})
    q = QueryEngine(cfg, r)
    lookups = [
        q.lookup(name, [card] * len(cfg.metric(name).key), w, str(now))  # type: ignore[union-attr]
        for name in ("txn_count", "card_min", "card_last", "card_first", "avg_amount")
        for card in ("c1", "c2", "nobody")
        for w in ("10s", "1m", "3m", "8m")
    ]
    raw = q.run(lookups)
    monkeypatch.setattr(engine_module, "RAW_MAX_SLICES", 0)
    merged_in_redis = q.run(lookups)
    assert raw == merged_in_redis
    assert any(a["value"] not in (0, None) for a in raw)


def test_prepacked_hmget_is_the_command_its_arguments_make() -> None:
    import hiredis

    from sluice.query.wire import Commands

    for first, last, step in [
        (T0, T0, SLICE),
        (T0, T0 + 83 * SLICE, SLICE),
        (0, 9_000, 1_000),
        (T0, T0 + 1_999 * SLICE, SLICE),  # longer than the cached pieces
    ]:
        packed, args = Commands(resp=True), Commands()
        for commands in (packed, args):
            commands.hmget_slices("sluice:s:{m|k\u00e9}", first, last, step)
        assert packed == [hiredis.pack_command(args[0])]
        assert len(args[0]) == 2 + (last - first) // step + 1


def test_a_batch_reads_a_repeated_lookup_once(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Lookups of one batch with the same metric, key and cover (a hot key asked twice, ends in
    the same slice, a derived metric over a base asked on its own) read once and answer as each
    would alone; the answers keep their own `end`."""
    rng = random.Random(8)
    now = time.time_ns() // 1_000_000
    newest = now // 60_000 * 60_000
    cfg = make_config(redis_url, tmp_path)
    for name in ("amount_sum", "merchant_txn"):
        m = cfg.metric(name)
        assert m is not None
        states = {str(newest - m.slice * i): _state(AGGS[m.agg].state, rng) for i in range(30)}
        r.hset(slice_hash_key(name, encode_key(["m1"])), mapping={**states, "_m": f"{newest}:0"})
    q = QueryEngine(cfg, r)
    asks = [("amount_sum", "5m", newest + 100), ("amount_sum", "5m", newest + 200),
            ("merchant_txn", "5m", newest + 300), ("avg_ticket", "5m", newest + 400),
            ("amount_sum", "10m", newest + 100), ("amount_sum", "5m", newest + 200)]  # fmt: skip
    lookups = [q.lookup(name, ["m1"], w, str(end)) for name, w, end in asks]
    alone = [q.run([lk])[0] for lk in lookups]
    before = r.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)
    together = q.run(lookups)
    hmgets = r.info("commandstats")["cmdstat_hmget"]["calls"] - before
    assert together == alone
    assert [a["end"] for a in together] == [end for _, _, end in asks]
    assert together[3]["inputs"] == {"amount_sum": alone[0]["value"],
                                      "merchant_txn": alone[2]["value"]}  # fmt: skip
    # Three (metric, cover) reads: amount_sum 5m, merchant_txn 5m, amount_sum 10m.
    assert hmgets == 3, hmgets
