"""The aggregation table (`sluice.slices.aggs`) and the stored slice state (`sluice.slices.state`):
pure logic. The Lua side of every merge is held to these in tests/integration/test_merge.py."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.config import MetricConfig
from sluice.slices.aggs import AGG_NAMES, AGGS, BLOB, HLL
from sluice.slices.state import encode_state, format_number

LUA_SOURCE = (Path(__file__).parents[2] / "src/sluice/redis/lua/_merge.lua").read_text()
finite = st.floats(allow_nan=False, allow_infinity=False)
times = st.integers(0, 5)  # few distinct event times, so ties are common
timed = st.lists(st.tuples(times, st.sampled_from([-2.0, 0.0, 1.5, 7.25])), min_size=1)


def _metric(agg: str, **extra: Any) -> MetricConfig:
    return MetricConfig(name="m", key=["k"], agg=agg, value="x", **extra)


@pytest.mark.parametrize("name", [n for n in AGG_NAMES if AGGS[n].lua])
def test_every_script_state_is_whole(name: str) -> None:
    """A Lua-merged agg encodes a folded row into `width` numbers, merges them in Python, and
    has a merge under its state's name in _merge.lua."""
    agg = AGGS[name]
    assert agg.numbers is not None and agg.merge_columns is not None
    folded = [{"t": 1, "v": 2.5} if f.column in ("last", "first") else 2.5 for f in agg.folds]
    assert len(agg.encode(3, *folded)) == agg.width
    assert f"agg == '{agg.state}'" in LUA_SOURCE


def test_the_other_states_are_a_blob_and_a_hyperloglog() -> None:
    others = {n: a.state for n, a in AGGS.items() if not a.lua}
    assert others == {"distinct": HLL, "quantile": BLOB}
    assert AGGS["quantile"].union is not None


def test_config_and_query_server_import_no_engine() -> None:
    code = (
        "import sys, sluice.config, sluice.query.engine;"
        " heavy = {'pyspark', 'datasketches'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("name", "integral", "spark_type"),
    [
        ("count", False, "long"),
        ("distinct", True, "string"),
        ("sum", True, "long"),
        ("sum", False, "double"),
        ("first", True, "long"),
        ("first", False, "double"),
        ("last", True, "long"),
        ("avg", True, "double"),
        ("quantile", True, "double"),
    ],
)
def test_value_column_types(name: str, integral: bool, spark_type: str) -> None:
    assert AGGS[name].value_type(integral) == spark_type


@given(finite)
def test_stored_numbers_read_back_exactly(x: float) -> None:
    assert float(format_number(x)) == x


def test_stored_numbers_are_written_as_the_script_writes_them() -> None:
    assert [format_number(x) for x in (3.0, -0.0, 17, 0.1, 1e15, 2.5e-7)] == [
        "3",
        "0",
        "17",
        "0.10000000000000001",
        "1000000000000000",
        "2.4999999999999999e-07",
    ]
    assert encode_state(1_000_000_000_017, [2, 20.5]) == "1000000000017:2:20.5"


def _stored(pairs: list[tuple[int, float]]) -> list[bytes | None]:
    return [encode_state(9, p).encode() for p in pairs] + [None]


_numbers = st.one_of(
    st.integers(0, 2**53 + 10),
    st.integers(-(2**60), 2**60),
    st.floats(allow_nan=False, allow_infinity=False),
)


@given(st.lists(_numbers, min_size=1, max_size=60))
def test_a_sum_is_the_script_s_doubles_added_in_slice_order(values: list[float]) -> None:
    """count and sum states merge to what read_slices.lua gives: the doubles added one by one
    in slice order, whether the stored numbers are integers (added as ints where that is exact)
    or doubles, however large, negative or mixed."""
    stored = [encode_state(9, [v]).encode() for v in values] + [None]
    want = 0.0
    for v in values:
        want += float(v)
    for name in ("count", "sum"):
        assert AGGS[name].merge(stored) == [len(values), want], name
        assert AGGS[name].merge(stored[:-1]) == [len(values), want], name  # dense: no None


@given(st.lists(st.floats(allow_nan=False), min_size=1, max_size=40))
def test_stored_texts_read_as_float_reads_them(values: list[float]) -> None:
    """Each merge reads a stored number as `float` reads its text, whichever wrote it: the
    writer (the shortest form), the script (`format_number`, 17 digits), infinities too."""
    texts = [t for v in values for t in (repr(v), format_number(v))]
    stored = [f"9:{t}".encode() for t in texts]
    read = [float(t) for t in texts]
    assert AGGS["min"].merge(stored) == [len(texts), min(read)]
    assert AGGS["max"].merge([None, *stored]) == [len(texts), max(read)]
    want = 0.0
    for x in read:
        want += x
    got = AGGS["sum"].merge(stored)[1]
    assert got == want or (got != got and want != want)  # inf + -inf is NaN either way


@given(st.lists(st.floats(), min_size=1, max_size=40))
def test_doubles_in_order_are_reduce_s_additions(values: list[float]) -> None:
    """`in_order` gives what adding the doubles one by one gives, to the bit: the sign of a
    zero, infinities and NaN included."""
    from functools import reduce
    from operator import add

    from sluice.slices.state import in_order

    got, want = in_order(values), reduce(add, values)
    assert struct.pack("<d", got) == struct.pack("<d", want) or (got != got and want != want)
    assert math.copysign(1.0, in_order([-0.0, -0.0])) == -1.0


@pytest.mark.parametrize("stored", [b"9:1:2", b"9", b"9:1:", b"9:x"])
@pytest.mark.parametrize("name", ["count", "sum"])
def test_a_malformed_one_number_state_is_refused_by_name(name: str, stored: bytes) -> None:
    """A state that is not a token and one number fails the merge with the agg's name, whether
    it has too many numbers, none, or text that is no number."""
    with pytest.raises(ValueError, match=f"for '{name}'"):
        AGGS[name].merge([b"9:5", stored])


@given(timed)
def test_first_is_the_least_time_then_the_least_value(pairs: list[tuple[int, float]]) -> None:
    merged = AGGS["first"].merge(_stored(pairs))
    assert merged == [len(pairs), *min(pairs)]
    assert AGGS["first"].merge(_stored(pairs[::-1])) == merged


@given(timed)
def test_last_is_the_greatest_time_then_the_greatest_value(pairs: list[tuple[int, float]]) -> None:
    merged = AGGS["last"].merge(_stored(pairs))
    assert merged == [len(pairs), *max(pairs)]
    assert AGGS["last"].merge(_stored(pairs[::-1])) == merged


@pytest.mark.parametrize("name", ["first", "last"])
def test_first_and_last_answer_the_value(name: str) -> None:
    agg = AGGS[name]
    assert agg.finalize([2, 1_700_000_000_000, 42.0], _metric(name), True) == 42
    assert type(agg.finalize([2, 1_700_000_000_000, 42.0], _metric(name), True)) is int
    assert agg.finalize([b"2", b"1700000000000", b"2.5"], _metric(name), False) == 2.5
    assert agg.finalize([0], _metric(name), True) is None
    assert agg.finalize([b"0"], _metric(name), False) is None


def test_answers_with_no_data() -> None:
    answers = {n: AGGS[n].finalize([0], _metric(n), False) for n in AGG_NAMES if AGGS[n].lua}
    assert answers == {
        "count": 0,
        "sum": 0,
        "min": None,
        "max": None,
        "avg": None,
        "last": None,
        "stddev": None,
        "variance": None,
        "first": None,
    }
    assert AGGS["distinct"].finalize(0, _metric("distinct"), False) == 0
    quantile = _metric("quantile", q=[0.5, 0.99])
    assert AGGS["quantile"].finalize(AGGS["quantile"].merge([None]), quantile, False) == {
        "0.5": None,
        "0.99": None,
    }


def test_variance_and_stddev_share_a_state_and_answer_apart() -> None:
    slices = [b"1:2:1:2", b"2:2:3:2"]  # (n, mean, M2) of the values 0, 2 and of 2, 4
    merged = AGGS["variance"].merge(slices)
    assert merged == AGGS["stddev"].merge(slices) == [2.0, 4.0, 2.0, 8.0]
    assert AGGS["variance"].finalize(merged, _metric("variance"), False) == pytest.approx(8 / 3)
    stddev = AGGS["stddev"].finalize(merged, _metric("stddev"), False)
    assert stddev == pytest.approx(math.sqrt(8 / 3))


@pytest.mark.parametrize("m2", [b"nan", b"inf"])
def test_moments_past_the_largest_double_answer_null_not_0(m2: bytes) -> None:
    """1e308, -1e308 and 5 fold to M2 = NaN (Spark's moments overflow): not finite, so null in
    JSON, as a sum past the largest double is; it was clamped to 0.0."""
    import orjson

    merged = AGGS["variance"].merge([b"1:3:1.67:" + m2])
    for name in ("variance", "stddev"):
        got = AGGS[name].finalize(merged, _metric(name), False)
        assert got is not None and not math.isfinite(got), (name, got)
        assert orjson.dumps({"value": got}) == b'{"value":null}'


def test_a_training_value_that_is_not_finite_is_null_as_online() -> None:
    """The service answers NaN and infinity as null (JSON has none); a training table's column
    holds null for them too, from a list of answers or a column of running totals."""
    import pyarrow as pa

    from sluice.offline.features import arrow_column

    want = [1.5, None, None, None, None]
    values = [1.5, math.nan, math.inf, -math.inf, None]
    assert arrow_column(values, "double").to_pylist() == want
    assert arrow_column(pa.array(values), "double").to_pylist() == want
    assert arrow_column([3, None], "long").to_pylist() == [3, None]


def test_a_hyperloglog_is_not_merged_here() -> None:
    with pytest.raises(ValueError, match="merged in Redis only"):
        AGGS["distinct"].merge([b"x"])


def _kll(values: list[float]) -> bytes:
    from datasketches import kll_doubles_sketch

    sketch = kll_doubles_sketch(200)
    for v in values:
        sketch.update(v)
    return b"7:" + bytes(sketch.serialize())


def test_a_quantile_of_one_sketch_is_the_sketch_s_own() -> None:
    """Gathering a single sketch's items answers exactly what the sketch answers, compacted or
    not (the query server's merge must not change an answer that needs no merge)."""
    import random

    from datasketches import kll_doubles_sketch

    qs = [0.001, 0.01, 0.25, 0.5, 0.9, 0.99, 0.999]
    m = _metric("quantile", q=qs)
    rnd = random.Random(4)
    for n in [1, 2, 199, 200, 201, 5000, 40_000]:
        blob = _kll([round(rnd.lognormvariate(3, 1.2), 2) for _ in range(n)])
        sketch = kll_doubles_sketch.deserialize(blob[2:])
        got = AGGS["quantile"].finalize(AGGS["quantile"].merge([blob]), m, False)
        assert got == {str(q): sketch.get_quantile(q) for q in qs}, n


def test_quantiles_over_many_sketches_do_not_depend_on_chance_or_order() -> None:
    """Merging KLL sketches compacts with random choices: the same slices answered twice could
    differ. The gathered sample answers the same every time and in any order."""
    import random

    rnd = random.Random(5)
    blobs = [_kll([rnd.lognormvariate(3, 1.2) for _ in range(150)]) for _ in range(60)]
    m = _metric("quantile", q=[0.5, 0.99])
    want = AGGS["quantile"].finalize(AGGS["quantile"].merge(blobs), m, False)
    for _ in range(5):
        rnd.shuffle(blobs)
        assert AGGS["quantile"].finalize(AGGS["quantile"].merge(blobs), m, False) == want
    every = sorted(x for b in blobs for x in __import__("datasketches").kll_doubles_sketch
                   .deserialize(b[2:]))  # fmt: skip
    assert len(every) == 60 * 150  # no sketch compacted: the sample is every value
    assert want["0.5"] == sorted(v for v, _ in every)[int(0.5 * len(every))]


def test_every_running_agg_answers_on_columns() -> None:
    """Training sets answer running windows on columns (`offline.answers._prefixed`)."""
    running = {"count", "sum", "avg", "min", "max", "first", "last"}
    assert {n for n, a in AGGS.items() if a.running} == running
    assert all(AGGS[n].finalize_columns is not None for n, a in AGGS.items() if a.running)


# A merged state: any slice with data, then numbers as a running-total difference gives them
# (a count first, then an integral or any sum; zero counts with data are a filtered metric's).
sums = st.one_of(st.integers(-(10**15), 10**15), finite)
merged_states = st.lists(
    st.tuples(st.booleans(), st.integers(0, 10**12), sums), min_size=1, max_size=40
)


@pytest.mark.parametrize("name", ["count", "sum", "avg", "min", "max", "first", "last"])
@pytest.mark.parametrize("integral", [False, True])
@given(states=merged_states)
def test_answers_on_columns_are_finalize_s(
    name: str, integral: bool, states: list[tuple[bool, int, float]]
) -> None:
    """`Agg.finalize_columns` answers each state exactly as `Agg.finalize`, and as the same
    column of the answer's type."""
    import numpy as np
    import pyarrow as pa

    from sluice.offline.features import arrow_column

    agg = AGGS[name]
    assert agg.finalize_columns is not None
    numbers = [[float(n)] if name == "count" else [float(x)] if name in ("sum", "min", "max")
               else [float(n), float(x)] for _, n, x in states]  # fmt: skip
    if integral and name in ("sum", "min", "max", "first", "last"):  # a long column's: a long
        longs = [float(int(max(-(2.0**62), min(x, 2.0**62)))) for _, _, x in states]
        numbers = [[*xs[:-1], x] for xs, x in zip(numbers, longs, strict=True)]
    has = np.array([h for h, _, _ in states])
    columns = [np.array(c, dtype=np.float64) for c in zip(*numbers, strict=True)]
    values, valid = agg.finalize_columns(has, columns, integral)
    valid = np.ones(len(states), bool) if valid is None else valid
    got = [v.item() if ok else None for v, ok in zip(values, valid, strict=True)]
    m = _metric(name)
    want = [agg.finalize([1.0, *xs] if h else [0], m, integral)
            for (h, _, _), xs in zip(states, numbers, strict=True)]  # fmt: skip
    assert got == want
    # As the training set's column of the answer's type (a sum with no data answers int 0).
    kind = agg.answer_type(integral)
    column = arrow_column(pa.array(values, mask=~valid), kind)
    assert column.equals(arrow_column(want, kind))
