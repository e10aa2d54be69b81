"""Bad input over HTTP, and the dead letters read back. Real Redis behind the app.

`POST /v1/events` is fuzzed with generated bodies: it never answers 500, refuses what is not
JSON (or not objects) with 400, and accepts a JSON array of objects with 202 and its count;
every accepted event is then one event of the stream, by the decoder's own count rule.

Dead letters are written by the real script (`pipeline.writer.write_dead_letters`) and
counted by the real batch-record script, then listed by `sluice dead-letters` and
`GET /v1/dead-letters`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis
import yaml
from click.testing import CliRunner
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.cli import main
from sluice.config import Config
from sluice.pipeline import writer
from sluice.pipeline.query import Role
from sluice.pipeline.writer import WriterContext, write_dead_letters
from sluice.redis.keys import BATCHES_KEY, STATS_KEY
from sluice.redis.scripts import RECORD_BATCH, script_source
from sluice.server.app import create_app
from sluice.source.decode import Decoder, entry_event_count
from sluice.source.options import SourceOptions
from tests.conftest import make_config

HTTP = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
T0 = 1_700_000_000_000


@pytest.fixture
def cfg(redis_url: str, tmp_path: Path) -> Config:
    return make_config(redis_url, tmp_path)


@pytest.fixture
def api(r: redis.Redis, cfg: Config) -> TestClient:
    return TestClient(create_app(cfg, r))


def _error(resp: httpx.Response, status: int, word: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"code", "message"}
    assert word in err["message"], err


def _stream_events(r: redis.Redis, cfg: Config) -> int:
    """Events in the input streams, counted as the decoder counts them."""
    n = 0
    for key in cfg.source.shard_keys():
        for _, fields in r.xrange(key):
            n += entry_event_count(fields, cfg.source.format, cfg.source.max_entry_bytes)
    return n


# -- POST /v1/events, fuzzed -------------------------------------------------------------------

JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
JSON_VALUE = st.recursive(
    JSON_SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# Events as producers get them wrong: right fields with wrong types, missing, extra, nested.
EVENT = st.one_of(
    st.fixed_dictionaries(
        {"ts": st.integers(min_value=T0, max_value=T0 + 10**6), "card": st.text(max_size=8),
         "merchant": st.text(max_size=8), "amount": st.floats(allow_nan=False,
                                                               allow_infinity=False)},
        optional={"qty": st.integers(min_value=-(2**63), max_value=2**63 - 1)},
    ),
    st.dictionaries(st.sampled_from(["ts", "card", "merchant", "amount", "qty", "x"]), JSON_VALUE,
                    max_size=6),
    st.dictionaries(st.text(max_size=6), JSON_VALUE, max_size=4),
)  # fmt: skip


@HTTP
@given(st.lists(EVENT, max_size=30))
def test_a_json_array_of_objects_is_accepted_whole(
    api: TestClient, r: redis.Redis, cfg: Config, events: list[dict[str, Any]]
) -> None:
    before = _stream_events(r, cfg)
    resp = api.post("/v1/events", content=orjson.dumps(events))
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": len(events)}
    assert _stream_events(r, cfg) == before + len(events)


@HTTP
@given(st.lists(EVENT, max_size=10), st.data())
def test_an_array_with_a_non_object_is_refused_whole(
    api: TestClient, r: redis.Redis, cfg: Config, events: list[Any], data: st.DataObject
) -> None:
    bad = data.draw(JSON_VALUE.filter(lambda v: not isinstance(v, dict)))
    at = data.draw(st.integers(min_value=0, max_value=len(events)))
    events.insert(at, bad)
    before = _stream_events(r, cfg)
    _error(api.post("/v1/events", content=orjson.dumps(events)), 400, f"event {at} ")
    assert _stream_events(r, cfg) == before  # nothing half-written


@HTTP
@given(
    st.lists(st.one_of(EVENT.map(orjson.dumps), st.sampled_from([b"", b"  ", b"\r"])), max_size=8),
    st.sampled_from([b"\n", b"\r\n"]),
)
def test_ndjson_with_blank_lines_is_accepted(
    api: TestClient, r: redis.Redis, cfg: Config, lines: list[bytes], sep: bytes
) -> None:
    body = sep.join(lines)
    n = sum(1 for ln in lines if ln.strip())
    before = _stream_events(r, cfg)
    resp = api.post("/v1/events", content=body)
    if n == 0:
        _error(resp, 400, "empty")
        return
    assert resp.status_code == 202, resp.text
    assert resp.json() == {"accepted": n}
    assert _stream_events(r, cfg) == before + n


JUNK_LINE = st.one_of(
    st.sampled_from([b"{nope", b"{'a': 1}", b"NaN", b'{"amount": NaN}', b"\xff\xfe", b"{} {}"]),
    st.binary(min_size=1, max_size=12).filter(lambda b: b"\n" not in b and _not_json(b)),
)


def _not_json(b: bytes) -> bool:
    try:
        orjson.loads(b)
    except orjson.JSONDecodeError:
        return bool(b.strip())
    return False


@HTTP
@given(st.lists(EVENT.map(orjson.dumps), max_size=5), JUNK_LINE, st.data())
def test_ndjson_with_a_junk_line_is_refused_naming_the_line(
    api: TestClient, r: redis.Redis, cfg: Config, lines: list[bytes], junk: bytes, data: Any
) -> None:
    at = data.draw(st.integers(min_value=0, max_value=len(lines)))
    lines.insert(at, junk)
    body = b"\n".join(lines)
    before = _stream_events(r, cfg)
    resp = api.post("/v1/events", content=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    if body.strip()[:1] != b"[":  # else it was read as one (broken) JSON array
        assert f"line {at + 1} " in err["message"] or "not a JSON object" in err["message"], err
    assert _stream_events(r, cfg) == before


@HTTP
@given(st.one_of(JSON_VALUE.map(orjson.dumps), st.binary(max_size=40)))
def test_no_body_gives_a_server_error(api: TestClient, body: bytes) -> None:
    resp = api.post("/v1/events", content=body)
    assert resp.status_code in (202, 400), (body, resp.status_code, resp.text)
    if resp.status_code == 400:
        assert set(resp.json()["error"]) == {"code", "message"}


def test_bodies_that_are_not_json_are_400(api: TestClient) -> None:
    for body in (b"hello", b"[1, 2", b"\xff\xfe\x00", b"{nope}", b"[{}] trailing"):
        resp = api.post("/v1/events", content=body)
        assert resp.status_code == 400, (body, resp.text)
    _error(api.post("/v1/events", content=b""), 400, "empty")
    _error(api.post("/v1/events", content=b"[1]"), 400, "event 0 is not a JSON object")
    _error(api.post("/v1/events", content=b"NaN"), 400, "line 1")


def test_a_deeply_nested_event_is_not_a_server_error(r: redis.Redis, cfg: Config) -> None:
    """orjson reads 1023 levels of nesting but writes 254: such a body is refused whole."""
    api = TestClient(create_app(cfg, r), raise_server_exceptions=False)
    body = b'[{"card": "c", "x": ' + b"[" * 300 + b"]" * 300 + b"}]"
    resp = api.post("/v1/events", content=body)
    assert resp.status_code == 400 and "re-encoded" in resp.json()["error"]["message"]
    assert r.xlen("events:0") + r.xlen("events:1") == 0  # nothing half-written


# -- listing dead letters ----------------------------------------------------------------------


def _record(eid: str, reason: str, field: str | None = None, raw: str = "{}", idx: int = 0) -> str:
    """One dead-letter record as the plan hands it to the writer (plan.explode_updates)."""
    ms = int(eid.rpartition("@")[2].split("-")[0])  # `<stream>@<entry id>` or the entry id
    rec = {"id": eid, "idx": idx, "reason": reason, "field": field, "raw": raw, "ts": ms}
    return orjson.dumps(rec).decode()


def _write_batch(
    r: redis.Redis, redis_url: str, cfg: Config, token: int, records: list[str]
) -> None:
    """Write one batch's dead letters with the real script and count them as the job does."""
    ctx = WriterContext(
        url=redis_url,
        token=token,
        specs=(),
        source_stream=cfg.source.stream,
        dead_letter_maxlen=cfg.source.dead_letter_maxlen,
    )
    reasons = write_dead_letters(r, ctx, list(records))
    counters: list[Any] = ["dead_letters", len(records)]
    for reason, n in reasons.items():
        counters += [f"dead_{reason}", n]
    record = r.register_script(script_source(RECORD_BATCH))
    record(keys=[STATS_KEY, BATCHES_KEY], args=[token, orjson.dumps({"batch": token}), *counters])


LONG_RAW = '{"card": "' + "é" * 600 + '"}'
BATCHES = [
    (1, [_record(f"{T0}-0", "missing_field", "card", '{"amount": 1}'),
         _record(f"{T0}-1", "bad_json", None, "{nope", idx=2)]),
    (2, [_record(f"{T0 + 5}-0", "bad_type", "amount", '{"amount": "x"}'),
         _record(f"{T0 + 5}-1", "bad_json", None, "line one\nline two\ttab")]),
    (3, [_record(f"{T0 + 9}-0", "oversize_entry", None, f"entry {T0 + 9}-0 is 9000000 bytes"),
         _record(f"{T0 + 9}-1", "too_long", "card", LONG_RAW)]),
]  # fmt: skip
ALL = [rec for _, recs in BATCHES for rec in recs]


@pytest.fixture
def dead(r: redis.Redis, redis_url: str, cfg: Config) -> list[dict[str, Any]]:
    """Three batches of dead letters; returns the records, newest first as listed."""
    for token, records in BATCHES:
        _write_batch(r, redis_url, cfg, token, records)
    # Within a batch the script writes the records in sorted order (as JSON strings).
    out = []
    for _, records in BATCHES:
        out += [orjson.loads(rec) for rec in sorted(records)]
    return out[::-1]


def test_api_lists_the_newest_first_with_totals(
    api: TestClient, dead: list[dict[str, Any]]
) -> None:
    body = api.get("/v1/dead-letters").json()
    assert body["total"] == len(ALL)
    assert body["by_reason"] == {
        "bad_json": 2, "bad_type": 1, "missing_field": 1, "oversize_entry": 1, "too_long": 1,
    }  # fmt: skip
    items = body["items"]
    assert [
        (i["entry_id"], i["idx"], i["reason"], i["field"], i["raw"], i["ts"]) for i in items
    ] == [(d["id"], d["idx"], d["reason"], d["field"], d["raw"], d["ts"]) for d in dead]
    ids = [i["dead_id"] for i in items]
    assert ids == sorted(ids, key=lambda s: tuple(map(int, s.split("-"))), reverse=True)
    assert all(i["written_ms"] == int(i["dead_id"].split("-")[0]) for i in items)
    assert [i["token"] for i in items] == [3, 3, 2, 2, 1, 1]


def test_api_limit_and_reason(api: TestClient, dead: list[dict[str, Any]]) -> None:
    items = api.get("/v1/dead-letters", params={"limit": 2}).json()["items"]
    assert [i["entry_id"] for i in items] == [d["id"] for d in dead[:2]]
    body = api.get("/v1/dead-letters", params={"reason": "bad_json"}).json()
    assert [i["entry_id"] for i in body["items"]] == [f"{T0 + 5}-1", f"{T0}-1"]
    assert body["total"] == len(ALL)  # the total is the stream's, whatever the filter
    one = api.get("/v1/dead-letters", params={"reason": "bad_json", "limit": 1}).json()
    assert [i["entry_id"] for i in one["items"]] == [f"{T0 + 5}-1"]
    none = api.get("/v1/dead-letters", params={"reason": "expired"}).json()
    assert none["items"] == [] and none["total"] == len(ALL)
    for twice in ("limit=1&limit=2", "reason=bad_json&reason=expired"):  # not one of them
        resp = api.get(f"/v1/dead-letters?{twice}")
        assert resp.status_code == 400 and "is given more than once" in resp.text, resp.text


def test_reason_filter_pages_back_through_the_stream(
    api: TestClient, dead: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sluice.status.dead_letters as dl

    monkeypatch.setattr(dl, "PAGE_ENTRIES", 1)
    body = api.get("/v1/dead-letters", params={"reason": "missing_field"}).json()
    assert [i["entry_id"] for i in body["items"]] == [f"{T0}-0"]  # the oldest record
    body = api.get("/v1/dead-letters", params={"reason": "bad_json", "limit": 5}).json()
    assert len(body["items"]) == 2


def test_a_second_reader_records_only_its_own_reasons(
    r: redis.Redis, redis_url: str, cfg: Config
) -> None:
    """A stream read by several readers: the first records an entry nobody can decode, the
    others count it but do not record it again; a fold's own reasons are recorded by it, and
    so is each reader's `lost_records` (found by its own lag)."""
    undecodable = _record(f"{T0}-0", "bad_type", "amount", '{"amount": "x"}')
    too_late = _record(f"{T0}-1", "expired", None, '{"amount": 1}')
    lost = _record(f"{T0}-2", "lost_records", None, "")
    ctx = WriterContext(
        url=redis_url,
        token=5,
        specs=(),
        source_stream=cfg.source.stream,
        dead_letter_maxlen=cfg.source.dead_letter_maxlen,
        recorded_shards=frozenset(),
    )
    got = write_dead_letters(r, ctx, [undecodable, too_late, lost])
    assert got == {"bad_type": 1, "expired": 1, "lost_records": 1}
    stream = cfg.source.dead_letter_stream
    assert sorted(f[b"reason"] for _, f in r.xrange(stream)) == [b"expired", b"lost_records"]
    assert write_dead_letters(r, ctx, [undecodable]) == {"bad_type": 1}  # nothing to record
    first = dataclasses.replace(ctx, token=6, recorded_shards=None)
    write_dead_letters(r, first, [undecodable])
    assert [f[b"reason"] for _, f in r.xrange(stream)][-1] == b"bad_type"


@pytest.mark.parametrize(
    ("shards", "eid", "recorded"),
    [
        (None, "1-0", True),  # the first reader of all it reads
        (frozenset(), "1-0", False),  # of one shard, read first by another
        (frozenset({"sb"}), "sb@1-0", True),  # of several: per entry's shard
        (frozenset({"sb"}), "sa@1-0", False),
        (frozenset({"*"}), "events:3@17", True),  # a Kafka record: its topic's shards are one
        (frozenset({"*"}), "events:3@1-0", False),  # a stream entry of a shard it is not first of
    ],
)  # fmt: skip
def test_which_reader_records_an_undecodable_entry(
    shards: frozenset[str] | None, eid: str, recorded: bool
) -> None:
    assert writer.records(shards, {"id": eid, "reason": "bad_json"}) is recorded
    assert writer.records(shards, {"id": eid, "reason": "future"}) is True


def test_a_stage_of_two_inputs_records_the_entries_of_the_one_it_reads_first() -> None:
    """`both` reads `sa` after `onlya`, and `sb` (two shards) alone: it records `sb`'s."""
    readers = {"sa": ("onlya", "both"), "sb:0": ("both",), "sb:1": ("both",)}
    role = Role(None, "both", readers)  # type: ignore[arg-type] # its flow stage is not read
    assert role.recorded_shards == {"sb:0", "sb:1"}
    assert Role(None, "onlya", readers).recorded_shards == {"sa"}  # type: ignore[arg-type]
    assert Role(None, "", {"events": ("",)}).recorded_shards is None  # type: ignore[arg-type]


def test_api_empty(api: TestClient) -> None:
    assert api.get("/v1/dead-letters").json() == {"total": 0, "by_reason": {}, "items": []}
    _error(api.get("/v1/dead-letters", params={"reason": "bad_jsn"}), 400,
           "'bad_jsn' is not a dead-letter reason; the reasons are")  # fmt: skip


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"limit": ""}, "limit"),
        ({"limit": "-5"}, "limit"),
        ({"limit": "1_0"}, "limit"),
        ({"limit": "+10"}, "limit"),
        ({"limit": "\u0661"}, "limit"),
        ({"reason": ""}, "reason"),
        ({"reason": "Bad Json!"}, "reason"),
        ({"reason": "x" * 65}, "reason"),
    ],
)
def test_api_bad_parameters_are_400_naming_them(
    api: TestClient, params: dict[str, str], name: str
) -> None:
    _error(api.get("/v1/dead-letters", params=params), 400, f"`{name}`")


def test_api_limit_bounds_are_inclusive(api: TestClient, dead: list[dict[str, Any]]) -> None:
    assert len(api.get("/v1/dead-letters", params={"limit": 1}).json()["items"]) == 1
    assert len(api.get("/v1/dead-letters", params={"limit": 1000}).json()["items"]) == len(ALL)


def test_api_needs_the_token(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    app = create_app(make_config(redis_url, tmp_path, server={"token": "s3cret"}), r)
    client = TestClient(app)
    _error(client.get("/v1/dead-letters"), 401, "token")
    ok = client.get("/v1/dead-letters", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


def test_dead_letters_of_decoded_bad_input_are_listed(
    api: TestClient, r: redis.Redis, redis_url: str, cfg: Config
) -> None:
    """Decoder rows -> dead-letter records (as the plan builds them) -> the real script."""
    opts = dataclasses.replace(SourceOptions.from_config(cfg, redis_url), max_entry_bytes=1000)
    good = orjson.dumps({"ts": T0, "card": "c", "merchant": "m", "amount": 1.0, "qty": 1})
    entries = [
        [f"{T0}-0".encode(), [b"d", good + b"\n{nope\n  \n[1]\n" + good]],
        [f"{T0}-1".encode(), [b"d", b"x" * 2000, b"n", b"1"]],
        [f"{T0}-2".encode(), [b"other", b"1"]],
    ]
    rows = [row for b in Decoder(opts, T0, "events:0").decode(entries) for row in b.to_pylist()]
    assert len(rows) == sum(
        entry_event_count(dict(zip(fl[0::2], fl[1::2], strict=True)), "jsonl", 1000)
        for _, fl in entries
    )
    records = [
        _record(row["_eid"], row["_err"], row["_field"], row["_raw"], row["_idx"])
        for row in rows
        if row["_err"]
    ]
    _write_batch(r, redis_url, cfg, 7, records)
    items = api.get("/v1/dead-letters").json()["items"]
    got = sorted((i["entry_id"], i["idx"], i["reason"], i["field"]) for i in items)
    assert got == [  # the config's two streams: each id says its stream
        (f"events:0@{T0}-0", 1, "bad_json", None),
        (f"events:0@{T0}-0", 2, "not_object", None),
        (f"events:0@{T0}-1", 0, "oversize_entry", None),
        (f"events:0@{T0}-2", 0, "missing_field", "d"),
    ]
    oversize = next(i for i in items if i["reason"] == "oversize_entry")
    assert "2003 bytes" in oversize["raw"] and "x" * 20 not in oversize["raw"]


# -- sluice dead-letters -----------------------------------------------------------------------


def _config_file(tmp_path: Path, redis_url: str) -> str:
    path = tmp_path / "sluice.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "redis": redis_url,
                "state_dir": str(tmp_path / "state"),
                "source": {"stream": "events", "format": "jsonl", "shards": 2,
                           "schema": {"ts": "long", "card": "string", "amount": "double"}},
                "metrics": [{"name": "txn_count", "key": ["card"], "agg": "count"}],
            }
        )
    )  # fmt: skip
    return str(path)


def test_cli_empty_is_a_clear_message(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["dead-letters", "-c", _config_file(tmp_path, redis_url)])
    assert out.exit_code == 0, out.output
    assert out.output.strip() == "no dead letters in sluice:dead:{events} (0 in all)"


def test_cli_table_fits_the_terminal(
    r: redis.Redis, redis_url: str, tmp_path: Path, dead: list[dict[str, Any]]
) -> None:
    path = _config_file(tmp_path, redis_url)
    out = CliRunner().invoke(main, ["dead-letters", "-c", path], env={"COLUMNS": "100"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0] == (
        f"{len(ALL)} dead letters in sluice:dead:{{events}}; the newest {len(ALL)}, newest first"
    )
    assert lines[1] == (
        "counted since the start, by reason: bad_json 2, bad_type 1, missing_field 1,"
        " oversize_entry 1, too_long 1"
    )
    assert lines[2].split() == ["time", "(UTC)", "entry", "id", "idx", "reason", "field", "raw"]
    rows = lines[3:]
    assert len(rows) == len(ALL)  # a raw newline is escaped, never a line break
    assert all(len(line) <= 100 for line in lines[2:]), lines
    assert [row.split()[2] for row in rows] == [d["id"] for d in dead]
    assert [row.split()[4] for row in rows] == [d["reason"] for d in dead]
    too_long = next(row for row in rows if "too_long" in row)
    assert too_long.endswith("…") and "éééé" in too_long
    assert any("line one\\nline two\\ttab" in row for row in rows)
    assert any(row.endswith('{"amount": "x"}') for row in rows)  # quotes as they were sent


def test_cli_limit_reason_and_json(
    r: redis.Redis, redis_url: str, tmp_path: Path, dead: list[dict[str, Any]]
) -> None:
    path = _config_file(tmp_path, redis_url)
    runner = CliRunner()
    out = runner.invoke(main, ["dead-letters", "-c", path, "--limit", "1", "--reason", "bad_json"])
    assert out.exit_code == 0, out.output
    assert "the newest 1 with reason `bad_json`" in out.output
    assert len(out.output.splitlines()) == 4  # summary, counts, header, one row
    out = runner.invoke(main, ["dead-letters", "-c", path, "--json", "--limit", "3"])
    assert out.exit_code == 0, out.output
    items = [json.loads(line) for line in out.stdout.splitlines()]
    assert [i["entry_id"] for i in items] == [d["id"] for d in dead[:3]]
    assert items[0]["raw"] == dead[0]["raw"]
    assert f"{len(ALL)} dead letters" in out.stderr
    out = runner.invoke(main, ["dead-letters", "-c", path, "--reason", "expired"])
    assert out.exit_code == 0
    assert out.output.startswith(
        f"no dead letters with reason `expired` in sluice:dead:{{events}} ({len(ALL)} in all)"
    )


def test_cli_bad_options(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    path = _config_file(tmp_path, redis_url)
    out = CliRunner().invoke(main, ["dead-letters", "-c", path, "--limit", "0"])
    assert out.exit_code == 2 and "--limit" in out.output
    out = CliRunner().invoke(main, ["dead-letters", "-c", path, "--reason", "No Such"])
    assert out.exit_code == 2 and "--reason" in out.output and "bad_json" in out.output
    # A well-formed name that no dead letter is written with is a usage error too, not "none".
    out = CliRunner().invoke(main, ["dead-letters", "-c", path, "--reason", "bad_jsn"])
    assert out.exit_code == 2, out.output
    assert "'bad_jsn' is not a dead-letter reason; the reasons are missing_field," in out.output
    assert "future, expired" in out.output
    out = CliRunner().invoke(main, ["dead-letters", "-c", path, "--reason", "future"])
    assert out.exit_code == 0, out.output


def test_a_fields_event_with_nothing_to_write_is_refused_and_blocks_nothing(
    r: redis.Redis, cfg: Config
) -> None:
    """A stream entry cannot be empty: an event with no field, or only nulls, is refused by
    `send` (BadEvent), so the events buffered with it still flush; over HTTP the request is a
    400 naming the event, and nothing of it is written (it was a 503 that a retry never ended)."""
    from sluice.errors import BadEvent
    from sluice.source.producer import Producer

    fields = cfg.model_copy(update={"source": cfg.source.model_copy(update={"format": "fields"})})
    producer = Producer.from_config(fields, r, flow=False)
    producer.send({"ts": T0, "card": "c1", "merchant": "m1", "amount": 1.0})
    for empty in ({}, {"card": None}):
        with pytest.raises(BadEvent, match="needs a field with a value"):
            producer.send(empty)
    assert producer.pending() == 1
    before = _stream_events(r, fields)
    assert producer.flush() == 1 and _stream_events(r, fields) == before + 1
    api = TestClient(create_app(fields, r))
    body = [{"ts": T0, "card": "c2", "merchant": "m1", "amount": 1.0}, {}]
    _error(api.post("/v1/events", json=body), 400, "event 1: an event in the `fields` format")
    assert _stream_events(r, fields) == before + 1  # nothing of it
    assert api.post("/v1/events", json=body[:1]).status_code == 202
