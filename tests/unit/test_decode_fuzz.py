"""Bad input, hardened: the decoder's event-count rule, the cases it must survive, and fuzzing.

Whatever the entries, `Decoder.decode` never raises, yields exactly `entry_event_count` rows per
entry, and flags each row with a known reason or gives it valid values. An event also gets the
same verdict whichever path decodes it: the vectorised one (a clean chunk) or the event-by-event
one (a chunk with a bad neighbour).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.config import config_from_dict
from sluice.graph import StreamsSpec
from sluice.source.decode import (
    DECODE_REASONS,
    RAW_LIMIT,
    Decoder,
    entry_event_count,
    output_schema,
)
from sluice.source.options import SourceOptions

FUZZ = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
REF_MS = 1_700_000_999_000
T0 = 1_700_000_000_000
MAX_STRING = 64
MAX_ENTRY = 2_000
# Every field type, nullable and not.
FIELDS = (
    ("ts", "long", True),
    ("card", "string", False),
    ("amount", "double", False),
    ("n", "int", True),
    ("f", "float", True),
    ("ok", "boolean", True),
)
NON_NULLABLE = [n for n, _, nullable in FIELDS if not nullable]
INT_RANGE = {"long": (-(2**63), 2**63 - 1), "int": (-(2**31), 2**31 - 1)}


def options(fmt: str, max_entry_bytes: int = MAX_ENTRY) -> SourceOptions:
    return SourceOptions(
        url="redis://127.0.0.1:6379/0",
        log=StreamsSpec(("events",)),
        format=fmt,
        fields=FIELDS,
        time_field="ts",
        max_events_per_batch=None,
        max_string_bytes=MAX_STRING,
        max_entry_bytes=max_entry_bytes,
    )


def decode(entries: list[list[Any]], opts: SourceOptions) -> list[dict[str, Any]]:
    batches = list(Decoder(opts, REF_MS, "events:0").decode(entries))
    for b in batches:
        assert b.schema == output_schema(opts)
        b.validate(full=True)
    return [row for b in batches for row in b.to_pylist()]


def field_map(entry: list[Any]) -> dict[bytes, bytes]:
    fl = entry[1]
    return dict(zip(fl[0::2], fl[1::2], strict=False))


def eid(k: int) -> bytes:
    return f"{T0 + k}-{k % 3}".encode()


GOOD = json.dumps({"ts": T0, "card": "a", "amount": 1.5}).encode()
GOOD2 = json.dumps({"ts": T0 + 1, "card": "b", "amount": 2.5}).encode()


def check_rows(entries: list[list[Any]], rows: list[dict[str, Any]], opts: SourceOptions) -> None:
    """Every property a decoded batch must have, whatever went in."""
    counts = [entry_event_count(field_map(e), opts.format, opts.max_entry_bytes) for e in entries]
    assert len(rows) == sum(counts)
    at = 0
    for entry, count in zip(entries, counts, strict=True):
        ms = int(entry[0].split(b"-")[0])
        for i in range(count):
            row = rows[at + i]
            assert (row["_ems"], row["_idx"], row["_ref"]) == (ms, i, REF_MS), row
            check_row(row, entry[0].decode())
        at += count


def check_row(row: dict[str, Any], entry_id: str) -> None:
    if row["_err"] is not None:
        assert row["_err"] in DECODE_REASONS, row
        assert row["_field"] in (None, "d", *(n for n, _, _ in FIELDS)), row
        assert row["_eid"] == entry_id
        assert row["_raw"] and len(row["_raw"]) <= RAW_LIMIT + 1, row
        return
    assert (row["_field"], row["_eid"], row["_raw"]) == (None, None, None), row
    assert row["_ts"] is not None
    for name, typ, nullable in FIELDS:
        v = row[name]
        if v is None:
            assert nullable, (name, row)
        elif typ == "string":
            assert len(v.encode("utf-8")) <= MAX_STRING, row
        elif typ in ("double", "float"):
            assert math.isfinite(v), row
        elif typ in INT_RANGE:
            lo, hi = INT_RANGE[typ]
            assert lo <= v <= hi, row


def verdicts(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must not depend on the decoding path: a bad row's reason, field and raw input, a
    good row's values. (A bad row's values may differ: they are not used.)"""
    out: list[tuple[Any, ...]] = []
    for r in rows:
        if r["_err"] is not None:
            out.append((r["_idx"], r["_err"], r["_field"], r["_raw"]))
        else:
            out.append((r["_idx"], r["_ts"], *(r[n] for n, _, _ in FIELDS)))
    return out


# -- the event-count rule ----------------------------------------------------------------------


COUNT_CASES: list[tuple[str, dict[bytes, bytes], int]] = [
    ("one line", {b"d": GOOD}, 1),
    ("two lines", {b"d": GOOD + b"\n" + GOOD2}, 2),
    ("trailing newline", {b"d": GOOD + b"\n"}, 1),
    ("trailing newlines", {b"d": GOOD + b"\n\n\n"}, 1),
    ("leading newline", {b"d": b"\n" + GOOD}, 1),
    ("CRLF", {b"d": GOOD + b"\r\n" + GOOD2 + b"\r\n"}, 2),
    ("bare CR does not split", {b"d": GOOD + b"\r" + GOOD2}, 1),
    ("spaces-only line between", {b"d": GOOD + b"\n  \n" + GOOD2}, 2),
    ("tab, VT, FF, CR-only lines", {b"d": b"\t\n" + GOOD + b"\n\x0b\n\x0c\n\r\n" + GOOD2}, 2),
    ("VT after a line keeps it", {b"d": GOOD + b"\x0b\n" + GOOD2}, 2),
    ("only blank lines", {b"d": b" \n\t\r\n\x0b\x0c\n"}, 1),
    ("empty d", {b"d": b""}, 1),
    ("no d", {b"x": b"1"}, 1),
    ("no fields", {}, 1),
    ("junk lines count", {b"d": b"nope\n[1]\nnull\n" + GOOD}, 4),
    ("extra stream fields", {b"d": GOOD + b"\n" + GOOD2, b"n": b"7", b"meta": b"x"}, 2),
    ("oversize", {b"d": (GOOD + b"\n") * 200}, 1),
]


@pytest.mark.parametrize(
    ("fields", "expected"), [c[1:] for c in COUNT_CASES], ids=[c[0] for c in COUNT_CASES]
)
def test_jsonl_rows_per_entry_follow_the_rule(fields: dict[bytes, bytes], expected: int) -> None:
    assert entry_event_count(fields, "jsonl", MAX_ENTRY) == expected
    entry = [eid(1), [x for kv in fields.items() for x in kv]]
    rows = decode([entry], options("jsonl"))
    check_rows([entry], rows, options("jsonl"))
    # The same entry among good neighbours, and after a bad one (the event-by-event path).
    good = [eid(0), [b"d", GOOD]]
    bad = [eid(2), [b"d", b"{nope"]]
    for chunk in ([good, entry, good], [bad, entry]):
        check_rows(chunk, decode(chunk, options("jsonl")), options("jsonl"))


def test_a_blank_line_between_events_is_not_an_event() -> None:
    rows = decode([[eid(0), [b"d", GOOD + b"\n  \n" + GOOD2]]], options("jsonl"))
    assert [(r["_idx"], r["card"], r["_err"]) for r in rows] == [(0, "a", None), (1, "b", None)]


def test_idx_counts_kept_lines_only() -> None:
    payload = b"\n" + GOOD + b"\n\n \n{nope\n\t\n" + GOOD2 + b"\n"
    rows = decode([[eid(0), [b"d", payload]]], options("jsonl"))
    assert [(r["_idx"], r["_err"]) for r in rows] == [(0, None), (1, "bad_json"), (2, None)]
    assert rows[1]["_raw"] == "{nope"


def test_fields_entries_are_one_event_each() -> None:
    for fields in ({b"card": b"c", b"amount": b"1"}, {}, {b"d": GOOD + b"\n" + GOOD2}):
        assert entry_event_count(fields, "fields", MAX_ENTRY) == 1


def test_the_rule_knows_only_the_two_formats() -> None:
    with pytest.raises(ValueError, match="unknown source format 'csv'"):
        entry_event_count({b"d": GOOD}, "csv", MAX_ENTRY)


def test_size_counts_names_and_values() -> None:
    fields = {b"d": b"x" * 98, b"n": b"1"}  # 1 + 98 + 1 + 1 = 101 bytes, one line
    assert entry_event_count(fields, "jsonl", 101) == 1
    assert entry_event_count({b"d": b"x\ny"}, "jsonl", 4) == 2  # exactly at the limit: fine
    assert entry_event_count({b"d": b"x\ny"}, "jsonl", 3) == 1  # one byte over: oversize


# -- oversize entries --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fields", "jsonl"])
def test_an_oversize_entry_is_one_dead_letter_and_its_neighbours_survive(fmt: str) -> None:
    huge = b"\n".join([GOOD] * 2000)  # ~80 KB against a 2 KB limit
    if fmt == "fields":
        good = [b"card", b"a", b"amount", b"1.5", b"ts", str(T0).encode()]
        big = [b"card", b"x" * 5000, b"amount", b"1", b"blob", huge]
    else:
        good = [b"d", GOOD]
        big = [b"d", huge, b"n", b"2000"]
    entries = [[eid(0), good], [eid(1), big], [eid(2), good]]
    rows = decode(entries, options(fmt))
    check_rows(entries, rows, options(fmt))
    assert [r["_err"] for r in rows] == [None, "oversize_entry", None]
    dead = rows[1]
    assert dead["_field"] is None
    assert dead["_eid"] == eid(1).decode()
    # The raw input of the dead letter describes the entry; it never holds the payload.
    assert eid(1).decode() in dead["_raw"]
    assert str(sum(len(x) for x in big)) in dead["_raw"]
    assert "max_entry_bytes 2000" in dead["_raw"]
    assert ("fields: card, amount, blob" if fmt == "fields" else "fields: d, n") in dead["_raw"]
    assert len(dead["_raw"]) < 300


def test_oversize_raw_is_short_even_with_huge_field_names() -> None:
    entry = [eid(0), [b"k" * 5000, b"v", *(x for i in range(40) for x in (b"f%d" % i, b"v"))]]
    (row,) = decode([entry], options("fields"))
    assert row["_err"] == "oversize_entry"
    assert len(row["_raw"]) <= RAW_LIMIT + 1
    assert "…" in row["_raw"]


def test_default_limit_is_eight_megabytes() -> None:
    opts = SourceOptions(
        url="redis://127.0.0.1:6379/0",
        log=StreamsSpec(("events",)),
        format="jsonl",
        fields=FIELDS,
        time_field="ts",
        max_events_per_batch=None,
        max_string_bytes=MAX_STRING,
    )
    assert opts.max_entry_bytes == 8_000_000
    assert SourceOptions.from_spark(options("jsonl", 1234).to_spark()).max_entry_bytes == 1234
    cfg = config_from_dict(
        {
            "source": {"max_entry_bytes": "1MiB"},
            "metrics": [{"name": "n", "key": ["key"], "agg": "count"}],
        }
    )
    assert SourceOptions.from_config(cfg, "redis://x").max_entry_bytes == 1 << 20


# -- jsonl lines that Arrow's reader and the event-by-event path could read differently ----------


JSONL_CASES: list[tuple[str, bytes, str | None, str | None]] = [
    ("NaN amount", b'{"card": "a", "amount": NaN}', "non_finite", "amount"),
    ("Infinity amount", b'{"card": "a", "amount": Infinity}', "non_finite", "amount"),
    ("-Infinity amount", b'{"card": "a", "amount": -Infinity}', "non_finite", "amount"),
    ("1e400 amount", b'{"card": "a", "amount": 1e400}', "non_finite", "amount"),
    ("NaN in an ignored key", b'{"card": "a", "amount": 1, "x": NaN}', None, None),
    ("NaN as a string", b'{"card": NaN, "amount": 1}', "bad_type", "card"),
    ("Inf (Arrow only)", b'{"card": "a", "amount": Inf}', "bad_json", None),
    ("-Inf (Arrow only)", b'{"card": "a", "amount":-Inf}', "bad_json", None),
    ("-NaN (Arrow only)", b'{"card": "a", "amount": -NaN}', "bad_json", None),
    ("Inf far after the colon", b'{"card": "a", "x":      Inf, "amount": 1}', "bad_json", None),
    ("Info in a string is fine", b'{"card": "Info:Inf", "amount": 1}', None, None),
    ("null line", b"null", "not_object", None),
    ("two objects on a line", GOOD + b" " + GOOD2, "bad_json", None),
    ("object split over lines", b'{"card": "a",', "bad_json", None),
    ("lone surrogate in a field", b'{"card": "\\ud800", "amount": 1}', "invalid_utf8", "card"),
    ("lone surrogate in an ignored key", b'{"card": "a", "amount": 1, "x": "\\udc00"}', None, None),
    ("nesting in an ignored key", b'{"card": "a", "amount": 1, "x": [[[[[[1]]]]]]}', None, None),
    ("too big for long", b'{"ts": 9223372036854775808, "card": "", "amount": 1}', "out_of_range",
     "ts"),
    ("too big for int", b'{"n": 2147483648, "card": "a", "amount": 1}', "out_of_range", "n"),
    ("past 64 bits for long", b'{"ts": 99999999999999999999, "card": "a", "amount": 1}',
     "out_of_range", "ts"),
    ("past 64 bits below for long", b'{"ts": -99999999999999999999, "card": "a", "amount": 1}',
     "out_of_range", "ts"),
    ("one below long", b'{"ts": -9223372036854775809, "card": "a", "amount": 1}',
     "out_of_range", "ts"),
    ("float for long", b'{"ts": 1.0, "card": "a", "amount": 1}', "bad_type", "ts"),
    ("string for boolean", b'{"ok": "true", "card": "a", "amount": 1}', "bad_type", "ok"),
    ("missing before bad", b'{"amount": "x"}', "missing_field", "card"),
    ("object for string", b'{"card": {"a": [1, {"b": null}]}, "amount": 1}', "bad_type", "card"),
    ("duplicate key, last wins", b'{"card": 1, "card": "a", "amount": 1}', None, None),
    ("CR at the end", b'{"card": "a", "amount": 1}\r', None, None),
    ("VT at the end", b'{"card": "a", "amount": 1}\x0b', "bad_json", None),
    ("non-UTF-8 in a key", b'{"\xff": 1, "card": "a", "amount": 1}', "invalid_utf8", None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "reason", "field"), [c[1:] for c in JSONL_CASES], ids=[c[0] for c in JSONL_CASES]
)
def test_jsonl_line_gets_one_verdict_on_either_path(
    line: bytes, reason: str | None, field: str | None
) -> None:
    opts = options("jsonl", 1_000_000)
    alone = decode([[eid(1), [b"d", line]]], opts)  # vectorised when Arrow can be trusted
    among = decode([[eid(1), [b"d", GOOD + b"\n" + line + b"\n" + GOOD2]]], opts)
    slow = decode([[eid(0), [b"d", b"{nope"]], [eid(1), [b"d", line]]], opts)[1:]
    assert [(r["_err"], r["_field"]) for r in alone] == [(reason, field)]
    assert [(r["_err"], r["_field"]) for r in among] == [
        (None, None),
        (reason, field),
        (None, None),
    ]
    assert verdicts(slow) == verdicts(alone)
    assert verdicts(among)[1][1:] == verdicts(alone)[0][1:]


def test_a_payload_of_null_lines_does_not_crash_arrow() -> None:
    # pyarrow's JSON reader segfaults on a buffer of only `null` lines; it must never see one.
    rows = decode([[eid(0), [b"d", b"null\nnull"]], [eid(1), [b"d", b"null"]]], options("jsonl"))
    assert [r["_err"] for r in rows] == ["not_object"] * 3


@pytest.mark.parametrize("text", [b"0x10", b"0X10", b"0xFFFFFFFFFFFFFFFF", b"0x7fffffff"])
def test_hex_text_is_not_an_integer_in_fields(text: bytes) -> None:
    """Arrow's cast reads hex (even "0xFFFFFFFFFFFFFFFF", as -1); the text path does not."""
    (row,) = decode([[eid(0), [b"ts", text, b"card", b"a", b"amount", b"1"]]], options("fields"))
    assert (row["_err"], row["_field"]) == ("bad_type", "ts")


def test_missing_field_is_reported_before_a_later_bad_value_in_fields() -> None:
    entry = [eid(0), [b"amount", b"nan"]]  # card (earlier in the schema) is missing
    alone = decode([entry], options("fields"))
    slow = decode([[eid(1), [b"card", b"a", b"amount", b"lots"]], entry], options("fields"))[1:]
    assert [(r["_err"], r["_field"]) for r in alone] == [("missing_field", "card")]
    assert verdicts(slow) == verdicts(alone)


# -- fuzzing -----------------------------------------------------------------------------------


def _near(n: int) -> st.SearchStrategy[int]:
    return st.integers(min_value=max(0, n - 2), max_value=n + 2)


TEXT = st.text(max_size=12)
NUMBER_TEXT = st.sampled_from(
    ["1", "-0", "1.5", "1e3", "1e400", "-1e400", "nan", "NaN", "inf", "-Infinity", "Infinity",
     "0x10", "1_000", " 7 ", "+5", "9223372036854775808", "-9223372036854775809", "2147483648",
     "true", "False", " 1", "yes", "", "١٢", "1.", ".5", "3.5e38", "1e39"]
)  # fmt: skip
FIELD_VALUE = st.one_of(
    NUMBER_TEXT.map(str.encode),
    TEXT.map(lambda s: s.encode("utf-8", "surrogatepass")),  # incl. lone surrogates: not UTF-8
    st.binary(max_size=12),
    _near(MAX_STRING).map(lambda n: b"x" * n),
    _near(MAX_STRING // 2).map(lambda n: "é".encode() * n),
    st.integers(min_value=-(2**70), max_value=2**70).map(lambda i: str(i).encode()),
    st.floats().map(lambda f: repr(f).encode()),
)
FIELD_NAME = st.one_of(
    st.sampled_from([n.encode() for n, _, _ in FIELDS]), st.binary(min_size=1, max_size=6)
)
FIELDS_ENTRY = st.one_of(
    st.dictionaries(FIELD_NAME, FIELD_VALUE, max_size=8),
    # Mostly complete entries, so the vectorised path runs too.
    st.fixed_dictionaries(
        {
            b"card": st.one_of(TEXT.map(str.encode), FIELD_VALUE),
            b"amount": st.floats().map(lambda f: repr(f).encode()),
        },
        optional={b"ts": NUMBER_TEXT.map(str.encode), b"n": NUMBER_TEXT.map(str.encode),
                  b"f": NUMBER_TEXT.map(str.encode), b"ok": NUMBER_TEXT.map(str.encode),
                  b"extra": FIELD_VALUE},
    ),
    st.just({}),
    _near(MAX_ENTRY).map(lambda n: {b"card": b"x" * (n - len(b"card"))}),  # around the limit
)  # fmt: skip

JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**65), max_value=2**65),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
    _near(MAX_STRING).map(lambda n: "y" * n),
)
JSON_VALUE = st.recursive(
    JSON_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
EVENT_OBJECT = st.fixed_dictionaries(
    {"card": st.one_of(st.text(max_size=10), JSON_VALUE), "amount": JSON_VALUE},
    optional={"ts": JSON_VALUE, "n": JSON_VALUE, "f": JSON_VALUE, "ok": JSON_VALUE,
              "extra": JSON_VALUE},
)  # fmt: skip
GOOD_OBJECT = st.fixed_dictionaries(
    {
        "card": st.text(max_size=10),
        "amount": st.floats(allow_nan=False, allow_infinity=False),
        "ts": st.integers(min_value=0, max_value=2**62),
    }
)
JSON_LINE = st.one_of(
    GOOD_OBJECT.map(lambda o: json.dumps(o).encode()),
    EVENT_OBJECT.map(lambda o: json.dumps(o).encode()),
    JSON_VALUE.map(lambda v: json.dumps(v).encode()),  # often not an object
    st.sampled_from(
        [b"null", b"{nope", b"[1, 2]", b'"s"', b"{}", b'{"card": "a", "amount": NaN}',
         b'{"card": "a", "amount": Infinity}', b'{"card": "a", "amount": Inf}',
         b'{"card": "a", "amount": -NaN}', b'{"card": "\xff", "amount": 1}',
         b'{"card": "a", "amount": 1} {"card": "b", "amount": 2}', b'{"card": "\\ud800"}',
         b'{"card": "a",', b'"amount": 1}', GOOD + b"\r", b"\xfe\xff", b" " + GOOD]
    ),
    st.binary(max_size=20),
    _near(MAX_STRING).map(lambda n: b'{"card": "' + b"z" * n + b'", "amount": 1}'),
    st.integers(min_value=200, max_value=700).map(lambda n: b'{"card": "' + b"w" * n + b'"}'),
)  # fmt: skip
BLANK = st.sampled_from([b"", b" ", b"\t", b"\r", b"\x0b", b"\x0c", b" \r\t"])
PAYLOAD = st.builds(
    lambda lines, sep, tail: sep.join(lines) + tail,
    st.lists(st.one_of(JSON_LINE, JSON_LINE, BLANK), max_size=6),
    st.sampled_from([b"\n", b"\r\n"]),
    st.sampled_from([b"", b"\n", b"\n\n", b"\r\n", b"\x0c"]),
)
JSONL_ENTRY = st.one_of(
    st.fixed_dictionaries({b"d": PAYLOAD}, optional={b"n": st.binary(max_size=3)}),
    st.dictionaries(FIELD_NAME, st.binary(max_size=20), max_size=3),  # no `d`, mostly
    st.just({}),
)


def as_entries(maps: list[dict[bytes, bytes]]) -> list[list[Any]]:
    return [[eid(k), [x for kv in m.items() for x in kv]] for k, m in enumerate(maps)]


@FUZZ
@given(st.lists(FIELDS_ENTRY, max_size=12))
def test_fuzz_fields_entries(maps: list[dict[bytes, bytes]]) -> None:
    entries = as_entries(maps)
    opts = options("fields")
    check_rows(entries, decode(entries, opts), opts)


@FUZZ
@given(st.lists(JSONL_ENTRY, max_size=8))
def test_fuzz_jsonl_entries(maps: list[dict[bytes, bytes]]) -> None:
    entries = as_entries(maps)
    opts = options("jsonl")
    check_rows(entries, decode(entries, opts), opts)


@FUZZ
@given(st.sampled_from(["fields", "jsonl"]), st.data())
def test_fuzz_each_entry_gets_the_same_verdict_alone_and_after_a_bad_one(
    fmt: str, data: st.DataObject
) -> None:
    m = data.draw(FIELDS_ENTRY if fmt == "fields" else JSONL_ENTRY)
    (entry,) = as_entries([m])
    opts = options(fmt)
    bad = [f"{T0 - 1}-0".encode(), [b"amount", b"lots"] if fmt == "fields" else [b"d", b"{nope"]]
    alone = decode([entry], opts)
    after_bad = decode([bad, entry], opts)[1:]
    check_rows([entry], alone, opts)
    assert verdicts(after_bad) == verdicts(alone)


@settings(max_examples=25, deadline=None, database=None)
@given(st.lists(st.one_of(JSON_LINE, BLANK), min_size=1, max_size=200))
def test_fuzz_long_payloads_and_long_lines(lines: list[bytes]) -> None:
    payload = b"\n".join(lines)
    entry = [eid(0), [b"d", payload, b"pad", b"p" * 3000]]
    size = len(b"d") + len(payload) + len(b"pad") + 3000
    for limit in (size, size - 1):  # at the limit, and one byte under it (oversize)
        opts = options("jsonl", limit)
        check_rows([entry], decode([entry], opts), opts)
