"""sluice.source.decode.Decoder: raw XRANGE replies -> Arrow batches, bad events flagged."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.errors import ConfigError
from sluice.graph import StreamsSpec
from sluice.source.decode import META_FIELDS, Decoder, output_schema, spark_schema_ddl
from sluice.source.options import SourceOptions

FAST = settings(max_examples=40, deadline=None, database=None)
REF_MS = 1_700_000_999_000
T0 = 1_700_000_000_000
META = [n for n, _ in META_FIELDS]


def options(fmt: str = "fields", max_string_bytes: int = 64) -> SourceOptions:
    return SourceOptions(
        url="redis://127.0.0.1:6379/0",
        log=StreamsSpec(("events",)),
        format=fmt,
        fields=(("ts", "long", True), ("card", "string", False), ("amount", "double", False)),
        time_field="ts",
        max_events_per_batch=None,
        max_string_bytes=max_string_bytes,
    )


def decode(
    entries: list[list[Any]], fmt: str = "fields", max_string_bytes: int = 64
) -> list[dict[str, Any]]:
    opts = options(fmt, max_string_bytes)
    batches = list(Decoder(opts, REF_MS, "events:0").decode(entries))
    for b in batches:
        assert b.schema == output_schema(opts)
    return [row for b in batches for row in b.to_pylist()]


def entry(eid: str, *pairs: bytes) -> list[Any]:
    return [eid.encode(), list(pairs)]


def good(i: int) -> list[Any]:
    """A well-formed `fields` entry with ts = T0 + i, card c<i>, amount i + 0.5."""
    return entry(
        f"{T0 + i}-0",
        b"ts",
        str(T0 + i).encode(),
        b"card",
        f"c{i}".encode(),
        b"amount",
        f"{i}.5".encode(),
    )


def assert_good(row: dict[str, Any], i: int) -> None:
    assert row["ts"] == T0 + i
    assert row["card"] == f"c{i}"
    assert row["amount"] == i + 0.5
    assert row["_ts"] == T0 + i
    assert row["_ems"] == T0 + i
    assert row["_ref"] == REF_MS
    assert row["_err"] is None
    assert row["_field"] is None
    assert row["_eid"] is None
    assert row["_raw"] is None
    assert row["_idx"] == 0


def assert_bad(row: dict[str, Any], reason: str, field: str | None, eid: str) -> None:
    assert row["_err"] == reason, row
    assert row["_field"] == field, row
    assert row["_eid"] == eid, row
    assert row["_raw"], row
    assert row["_ref"] == REF_MS


# -- schema ----------------------------------------------------------------------------------


def test_output_schema_is_fields_then_meta() -> None:
    schema = output_schema(options())
    assert schema.names == ["ts", "card", "amount", *META]
    assert schema.field("ts").type == pa.int64()
    assert schema.field("card").type == pa.string()
    assert schema.field("amount").type == pa.float64()
    assert schema.field("_idx").type == pa.int32()
    assert schema.field("_err").type == pa.string()


def test_spark_ddl_matches_schema() -> None:
    ddl = spark_schema_ddl(options())
    assert ddl.startswith("`ts` bigint, `card` string, `amount` double, `_ts` bigint")
    assert ddl.count("`") == 2 * len(output_schema(options()).names)


def test_options_round_trip_through_spark_strings() -> None:
    opts = options("jsonl")
    assert SourceOptions.from_spark(opts.to_spark()) == opts


def test_reader_names_round_trip_through_spark_strings() -> None:
    opts = dataclasses.replace(options(), reader="enrich", readers={"s": ("", "enrich")})
    back = SourceOptions.from_spark(opts.to_spark())
    assert back == opts
    assert back.readers_of("s") == ("", "enrich") and back.readers_of("t") == ("enrich",)


def test_a_reader_must_be_among_the_readers() -> None:
    with pytest.raises(ConfigError, match="`reader` 'enrich' is not among the readers"):
        dataclasses.replace(options(), reader="enrich", readers={"s": ("",)})


# -- fields format ---------------------------------------------------------------------------


def test_good_rows_decode_with_types() -> None:
    rows = decode([good(i) for i in range(5)])
    assert len(rows) == 5
    for i, row in enumerate(rows):
        assert_good(row, i)
        assert isinstance(row["ts"], int)
        assert isinstance(row["amount"], float)


def test_no_entries_no_batches() -> None:
    assert list(Decoder(options(), REF_MS, "events:0").decode([])) == []


def test_missing_time_field_falls_back_to_entry_time() -> None:
    rows = decode([entry(f"{T0 + 7}-3", b"card", b"c", b"amount", b"2")])
    (row,) = rows
    assert row["ts"] is None
    assert row["_err"] is None
    assert row["_ts"] == row["_ems"] == T0 + 7


def test_event_time_differs_from_entry_time() -> None:
    (row,) = decode([entry(f"{T0}-0", b"ts", b"12345", b"card", b"c", b"amount", b"1")])
    assert row["_ts"] == 12345
    assert row["_ems"] == T0


def test_extra_fields_are_ignored() -> None:
    (row,) = decode([entry(f"{T0}-0", b"card", b"c", b"amount", b"1", b"colour", b"red")])
    assert row["_err"] is None
    assert "colour" not in row


BAD_FIELDS: list[tuple[str, list[bytes], str, str | None]] = [
    ("missing card", [b"ts", b"1", b"amount", b"1"], "missing_field", "card"),
    ("missing amount", [b"card", b"c"], "missing_field", "amount"),
    ("amount not a number", [b"card", b"c", b"amount", b"lots"], "bad_type", "amount"),
    ("ts not an integer", [b"ts", b"1.5", b"card", b"c", b"amount", b"1"], "bad_type", "ts"),
    # Numerals only Python reads: an underscore, other scripts' digits
    ("ts with _", [b"ts", b"1_700", b"card", b"c", b"amount", b"1"], "bad_type", "ts"),
    ("amount with _", [b"card", b"c", b"amount", b"1_0.5"], "bad_type", "amount"),
    ("full-width ts", [b"ts", "５".encode(), b"card", b"c", b"amount", b"1"], "bad_type", "ts"),
    ("Arabic-Indic amount", [b"card", b"c", b"amount", "١.٥".encode()], "bad_type", "amount"),
    ("non-UTF-8 card", [b"card", b"\xff\xfe", b"amount", b"1"], "invalid_utf8", "card"),
    ("NaN amount", [b"card", b"c", b"amount", b"nan"], "non_finite", "amount"),
    ("inf amount", [b"card", b"c", b"amount", b"inf"], "non_finite", "amount"),
    ("-inf amount", [b"card", b"c", b"amount", b"-inf"], "non_finite", "amount"),
    ("huge card", [b"card", b"x" * 65, b"amount", b"1"], "too_long", "card"),
    (
        "ts overflow",
        [b"ts", b"9223372036854775808", b"card", b"c", b"amount", b"1"],
        "out_of_range",
        "ts",
    ),
    ("empty entry", [], "empty_entry", None),
]


@pytest.mark.parametrize(
    ("pairs", "reason", "field"), [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS]
)
def test_bad_event_is_flagged_and_neighbours_survive(
    pairs: list[bytes], reason: str, field: str | None
) -> None:
    bad_id = f"{T0 + 1}-9"
    rows = decode([good(0), [bad_id.encode(), pairs], good(2)])
    assert len(rows) == 3
    assert_good(rows[0], 0)
    assert_good(rows[2], 2)
    assert_bad(rows[1], reason, field, bad_id)
    assert rows[1]["_ems"] == T0 + 1


@pytest.mark.parametrize(
    ("pairs", "reason", "field"), [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS]
)
def test_bad_event_alone(pairs: list[bytes], reason: str, field: str | None) -> None:
    (row,) = decode([[b"5-1", pairs]])
    assert_bad(row, reason, field, "5-1")


def test_all_bad_reasons_in_one_chunk() -> None:
    entries = [good(0)]
    for k, (_, pairs, _, _) in enumerate(BAD_FIELDS):
        entries += [[f"{T0 + 100 + k}-0".encode(), pairs], good(k + 1)]
    rows = decode(entries)
    assert len(rows) == 1 + 2 * len(BAD_FIELDS)
    assert_good(rows[0], 0)
    for k, (_, _, reason, field) in enumerate(BAD_FIELDS):
        assert_bad(rows[1 + 2 * k], reason, field, f"{T0 + 100 + k}-0")
        assert_good(rows[2 + 2 * k], k + 1)


def test_raw_shows_the_offending_entry() -> None:
    (row,) = decode([entry("9-0", b"card", b"c", b"amount", b"lots")])
    assert json.loads(row["_raw"]) == {"card": "c", "amount": "lots"}
    (row,) = decode([entry("9-1", b"card", b"\xff", b"amount", b"1")])
    assert json.loads(row["_raw"])["amount"] == "1"  # readable despite the bad bytes


def test_string_at_the_byte_limit_is_fine() -> None:
    rows = decode(
        [
            entry("1-0", b"card", "é".encode() * 8, b"amount", b"1"),  # 16 bytes
            entry("2-0", b"card", "é".encode() * 8 + b"x", b"amount", b"1"),  # 17 bytes
        ],
        max_string_bytes=16,
    )
    assert rows[0]["_err"] is None
    assert rows[0]["card"] == "é" * 8
    assert_bad(rows[1], "too_long", "card", "2-0")


def test_raw_is_truncated() -> None:
    (row,) = decode([entry("1-0", b"card", b"c", b"amount", b"y" * 5000)])
    assert row["_err"] == "bad_type"
    assert len(row["_raw"]) <= 1025
    assert row["_raw"].endswith("…")


def test_large_input_is_chunked_and_keeps_order() -> None:
    n = 4096 + 10
    entries = [good(i) for i in range(n)]
    entries[4100] = entry(f"{T0 + 4100}-0", b"card", b"c")
    batches = list(Decoder(options(), REF_MS, "events:0").decode(entries))
    assert [b.num_rows for b in batches] == [4096, 10]
    rows = [r for b in batches for r in b.to_pylist()]
    assert [r["_ems"] for r in rows] == [T0 + i for i in range(n)]
    assert [r["_err"] for r in rows if r["_err"]] == ["missing_field"]
    assert rows[4100]["_eid"] == f"{T0 + 4100}-0"


@FAST
@given(st.lists(st.booleans(), min_size=1, max_size=30))
def test_bad_events_never_blame_neighbours(pattern: list[bool]) -> None:
    """Whatever mix of good and bad entries, exactly the bad ones are flagged."""
    entries = [
        good(i) if ok else entry(f"{T0 + i}-0", b"card", b"c", b"amount", b"?")
        for i, ok in enumerate(pattern)
    ]
    rows = decode(entries)
    assert len(rows) == len(pattern)
    for i, (ok, row) in enumerate(zip(pattern, rows, strict=True)):
        if ok:
            assert_good(row, i)
        else:
            assert_bad(row, "bad_type", "amount", f"{T0 + i}-0")


# -- jsonl format ----------------------------------------------------------------------------


def jl(eid: str, *objs: Any, extra: list[bytes] | None = None) -> list[Any]:
    lines = [o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs]
    payload = b"\n".join(lines)
    return [eid.encode(), [b"d", payload, b"n", str(len(lines)).encode(), *(extra or [])]]


def test_jsonl_several_events_per_entry() -> None:
    objs = [{"ts": T0 + i, "card": f"c{i}", "amount": i + 0.5} for i in range(4)]
    rows = decode([jl(f"{T0}-0", *objs[:3]), jl(f"{T0 + 5}-0", objs[3])], "jsonl")
    assert len(rows) == 4
    assert [r["_idx"] for r in rows] == [0, 1, 2, 0]
    assert [r["_ems"] for r in rows] == [T0, T0, T0, T0 + 5]
    for i, r in enumerate(rows):
        assert (r["ts"], r["card"], r["amount"]) == (T0 + i, f"c{i}", i + 0.5)
        assert r["_ts"] == T0 + i
        assert r["_err"] is None
        assert r["_ref"] == REF_MS


def test_jsonl_integer_amount_and_missing_ts() -> None:
    (row,) = decode([jl(f"{T0 + 3}-1", {"card": "c", "amount": 2})], "jsonl")
    assert row["amount"] == 2.0
    assert row["ts"] is None
    assert row["_ts"] == row["_ems"] == T0 + 3
    assert row["_err"] is None


JSONL_BAD: list[tuple[str, bytes, str, str | None]] = [
    ("not JSON", b"{nope", "bad_json", None),
    ("not an object", b"[1, 2]", "not_object", None),
    ("scalar", b'"hello"', "not_object", None),
    ("string amount", b'{"card": "c", "amount": "1.5"}', "bad_type", "amount"),
    ("number card", b'{"card": 7, "amount": 1}', "bad_type", "card"),
    ("float ts", b'{"ts": 1.5, "card": "c", "amount": 1}', "bad_type", "ts"),
    ("bool amount", b'{"card": "c", "amount": true}', "bad_type", "amount"),
    ("missing card", b'{"amount": 1}', "missing_field", "card"),
    ("non-UTF-8 outside strings", b'\xff{"card": "c", "amount": 1}', "invalid_utf8", None),
    ("huge card", b'{"card": "' + b"x" * 65 + b'", "amount": 1}', "too_long", "card"),
]


@pytest.mark.parametrize(
    ("line", "reason", "field"), [c[1:] for c in JSONL_BAD], ids=[c[0] for c in JSONL_BAD]
)
def test_jsonl_bad_line_among_good_lines(line: bytes, reason: str, field: str | None) -> None:
    before = {"ts": T0, "card": "a", "amount": 1.0}
    after = {"ts": T0 + 2, "card": "b", "amount": 3.0}
    rows = decode([jl(f"{T0}-4", before, line, after)], "jsonl")
    assert len(rows) == 3
    assert [r["_idx"] for r in rows] == [0, 1, 2]
    assert (rows[0]["card"], rows[0]["_err"]) == ("a", None)
    assert (rows[2]["card"], rows[2]["_err"]) == ("b", None)
    assert rows[0]["_eid"] is None and rows[2]["_eid"] is None
    assert_bad(rows[1], reason, field, f"{T0}-4")
    # The dead letter shows the offending line, not the whole entry.
    assert rows[1]["_raw"] == line.decode("utf-8", "replace")


# pyarrow's JSON reader does not validate UTF-8 inside strings: the decoder must catch a
# non-UTF-8 byte in a string value itself, as the `fields` format does.
def test_jsonl_non_utf8_inside_a_string_is_flagged() -> None:
    good_line = json.dumps({"ts": T0, "card": "a", "amount": 1.0}).encode()
    payload = good_line + b'\n{"card": "\xff", "amount": 1}'
    (batch,) = Decoder(options("jsonl"), REF_MS, "events:0").decode([[b"5-0", [b"d", payload]]])
    assert batch.column("_err").to_pylist() == [None, "invalid_utf8"]
    batch.validate(full=True)


def test_jsonl_entry_without_d() -> None:
    rows = decode(
        [
            jl(f"{T0}-0", {"ts": T0, "card": "a", "amount": 1}),
            entry(f"{T0}-1", b"x", b"1"),
            entry(f"{T0}-2"),
        ],
        "jsonl",
    )
    assert len(rows) == 3
    assert rows[0]["_err"] is None
    assert_bad(rows[1], "missing_field", "d", f"{T0}-1")
    assert json.loads(rows[1]["_raw"]) == {"x": "1"}
    assert_bad(rows[2], "empty_entry", None, f"{T0}-2")


def test_jsonl_unknown_keys_ignored() -> None:
    (row,) = decode([jl("1-0", {"card": "c", "amount": 1, "colour": "red"})], "jsonl")
    assert row["_err"] is None
    assert row["card"] == "c"


def test_jsonl_matches_fields_format() -> None:
    """The same events give the same columns in both formats."""
    objs = [{"ts": T0 + i, "card": f"c{i}", "amount": i + 0.5} for i in range(6)]
    via_json = decode([jl(f"{T0 + i}-0", o) for i, o in enumerate(objs)], "jsonl")
    via_fields = decode([good(i) for i in range(6)])
    assert via_json == via_fields


def test_jsonl_blank_lines_and_trailing_newline_are_not_events() -> None:
    line = json.dumps({"ts": T0, "card": "a", "amount": 1.0}).encode()
    for payload in (line + b"\n", line + b"\n\n" + line, b"\n" + line + b"\r\n"):
        rows = decode([entry(f"{T0}-0", b"d", payload)], fmt="jsonl")
        assert all(r["_err"] is None for r in rows), payload
        assert len(rows) == payload.count(b'"card"')


def test_jsonl_entry_of_only_blank_lines_is_an_empty_entry() -> None:
    rows = decode([entry(f"{T0}-0", b"d", b"\n\n")], fmt="jsonl")
    assert [(r["_err"], r["_field"]) for r in rows] == [("empty_entry", None)]


@pytest.mark.parametrize("fmt", ["fields", "jsonl"])
def test_events_the_fold_will_find_out_of_time_are_named_as_bad_ones_are(fmt: str) -> None:
    """An event more than `max_future` ahead of the batch's time (`future`), or more than the
    longest retention behind it (`expired`, or close), is dead-lettered by the fold's plan, not
    here. The decoder names it all the same, so that its dead letter says where it is."""
    opts = dataclasses.replace(options(fmt), named_ahead_ms=3_600_000, named_behind_ms=86_400_000)
    times = {"ahead": REF_MS + 3_600_001, "behind": REF_MS - 86_400_001, "now": REF_MS,
             "edges": REF_MS + 3_600_000}  # fmt: skip
    entries = []
    for i, (name, ts) in enumerate(times.items()):
        fields = {"ts": ts, "card": name, "amount": 1.0}
        if fmt == "fields":
            pairs = [x for k, v in fields.items() for x in (k.encode(), str(v).encode())]
            entries.append(entry(f"{T0 + i}-0", *pairs))
        else:
            entries.append(entry(f"{T0 + i}-0", b"d", json.dumps(fields).encode()))
    rows = [r for b in Decoder(opts, REF_MS, "events:0").decode(entries) for r in b.to_pylist()]
    named = {r["card"]: r["_eid"] for r in rows}
    assert named == {"ahead": f"{T0}-0", "behind": f"{T0 + 1}-0", "now": None, "edges": None}
    assert all(r["_err"] is None and r["_raw"] is None for r in rows)
    # Without the bounds (an archive read with no reference time), none is named.
    rows = [r for b in Decoder(options(fmt), REF_MS, "events:0").decode(entries)
            for r in b.to_pylist()]  # fmt: skip
    assert all(r["_eid"] is None for r in rows)


@pytest.mark.parametrize("fmt", ["fields", "jsonl"])
def test_an_entry_of_one_of_several_streams_is_named_with_its_stream(fmt: str) -> None:
    """Entry ids repeat across a source's streams: with several, a dead letter's id says which
    stream (`events:1@<entry id>`, as a Kafka record's says its topic and partition), from the
    hiredis rows and from the columnar reply alike; with one stream it is the entry id."""
    from sluice.source.resp import parse_xrange
    from tests.unit.test_resp import encode

    bad = entry(f"{T0}-0", b"card", b"c") if fmt == "fields" else entry(f"{T0}-0", b"d", b"{x")
    sharded = dataclasses.replace(options(fmt), log=StreamsSpec(("events:0", "events:1")))
    reply = parse_xrange(encode([bad]))
    assert reply is not None
    for opts, want in [(sharded, f"events:1@{T0}-0"), (options(fmt), f"{T0}-0")]:
        decoder = Decoder(opts, REF_MS, "events:1")
        for batches in (decoder.decode([bad]), decoder.decode_reply(reply)):
            (row,) = [r for b in batches for r in b.to_pylist()]
            assert row["_err"] is not None and row["_eid"] == want, row


def test_the_sdk_writes_a_non_finite_value_that_the_decoder_refuses_as_non_finite() -> None:
    """orjson writes NaN and ±infinity as `null`: the producer's line for such an event keeps
    them (`NaN`, `Infinity`), so the event is the `non_finite` dead letter of the value it had,
    not an event missing it (or, in an optional field, an event with no value)."""
    from sluice.source.producer import event_line

    lines = [event_line({"ts": T0 + i, "card": f"c{i}", "amount": v})
             for i, v in enumerate([float("nan"), float("inf"), -float("inf"), 2.5])]  # fmt: skip
    assert b"null" not in b"".join(lines)
    rows = decode([[f"{T0}-0".encode(), [b"d", b"\n".join(lines)]]], "jsonl")
    assert [(r["_err"], r["_field"]) for r in rows] == [("non_finite", "amount")] * 3 + [
        (None, None)
    ]
    assert rows[3]["amount"] == 2.5
    assert event_line({"card": None}) == b'{"card":null}'  # a null as such stays one
