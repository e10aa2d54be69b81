"""sluice.config: the DESIGN §3 config loads; every bad field fails with its path and reason."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from sluice.config import Config, FieldType, SourceConfig, config_from_dict, load_config
from sluice.errors import ConfigError, SluiceError

DESIGN_YAML = textwrap.dedent(
    """\
    redis: redis://127.0.0.1:6379/0
    state_dir: .sluice
    source:
      stream: events
      shards: 1
      format: fields
      schema: {ts: long, card: string, merchant: string, amount: double}
      time_field: ts
    metrics:
      - {name: txn_count, key: [card], agg: count, slice: 1m, retention: 7d}
      - {name: amount_sum, key: [merchant], agg: sum, value: amount, filter: "amount > 0"}
      - {name: merchant_txn, key: [merchant], agg: count}
    derived:
      - {name: avg_ticket, expr: amount_sum / merchant_txn}
    spark: {master: "local[2]", trigger: 500ms}
    backpressure:
      controller: stepwise
      high_watermark: 50MB
      low_watermark: 500KB
      sensitivity: 2s
      step: 0.5
    """
)


def design() -> dict[str, Any]:
    return yaml.safe_load(DESIGN_YAML)


def bad(mutate: Callable[[dict[str, Any]], object]) -> ConfigError:
    """Apply `mutate` to a fresh DESIGN config and return the ConfigError it must raise."""
    data = design()
    mutate(data)
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return info.value


# -- the valid config ------------------------------------------------------------------------


def test_design_config_loads_with_typed_values() -> None:
    cfg = config_from_dict(design())
    assert isinstance(cfg, Config)
    assert cfg.redis == "redis://127.0.0.1:6379/0"
    assert cfg.state_dir == Path(".sluice")
    assert cfg.source.stream == "events"
    assert cfg.source.format == "fields"
    assert cfg.source.schema_ == {
        "ts": "long",
        "card": "string",
        "merchant": "string",
        "amount": "double",
    }
    assert [m.name for m in cfg.metrics] == ["txn_count", "amount_sum", "merchant_txn"]
    txn, amount, merchant = cfg.metrics
    assert (txn.agg, txn.key, txn.slice, txn.retention) == ("count", ["card"], 60_000, 604_800_000)
    assert (amount.agg, amount.value, amount.filter) == ("sum", "amount", "amount > 0")
    # Defaults: 1m slices kept for 7 days.
    assert (merchant.slice, merchant.retention) == (60_000, 7 * 86_400_000)
    assert cfg.derived[0].name == "avg_ticket"
    assert cfg.derived[0].expr == "amount_sum / merchant_txn"
    assert cfg.spark.master == "local[2]"
    assert cfg.spark.trigger == 500
    bp = cfg.backpressure
    assert (bp.controller, bp.high_watermark, bp.low_watermark) == ("stepwise", 50_000_000, 500_000)
    assert (bp.sensitivity, bp.step) == (2000, 0.5)


def test_lookup_helpers() -> None:
    cfg = config_from_dict(design())
    metric = cfg.metric("amount_sum")
    assert metric is not None
    assert metric.agg == "sum"
    assert cfg.metric("avg_ticket") is None
    derived = cfg.derived_metric("avg_ticket")
    assert derived is not None
    assert derived.expr == "amount_sum / merchant_txn"
    assert cfg.derived_metric("txn_count") is None


def test_minimal_config_takes_defaults() -> None:
    cfg = config_from_dict({"metrics": [{"name": "n", "key": ["key"], "agg": "count"}]})
    assert cfg.redis is None
    assert cfg.source.shard_keys() == ["events"]
    assert cfg.source.time_field == "ts"
    assert cfg.spark.trigger == 500
    assert cfg.backpressure.controller == "stepwise"
    assert cfg.server.port == 8000


def test_config_is_frozen() -> None:
    cfg = config_from_dict(design())
    with pytest.raises(Exception, match="frozen"):
        cfg.redis = "redis://other"  # type: ignore[misc]


def test_load_config_reads_file_and_resolves_state_dir(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text(DESIGN_YAML, encoding="utf-8")
    cfg = load_config(path)
    assert cfg.state_dir == (tmp_path / ".sluice").resolve()
    assert cfg.state_dir.is_absolute()
    assert [m.name for m in cfg.metrics] == ["txn_count", "amount_sum", "merchant_txn"]
    # A str path works too.
    assert load_config(str(path)) == cfg


def test_absolute_state_dir_is_kept(tmp_path: Path) -> None:
    data = design()
    data["state_dir"] = str(tmp_path / "state")
    cfg = config_from_dict(data, base_dir=Path("/somewhere/else"))
    assert cfg.state_dir == tmp_path / "state"


def test_config_error_is_a_sluice_error() -> None:
    err = ConfigError("boom", "a.b")
    assert isinstance(err, SluiceError)
    assert err.path == "a.b"
    assert str(err) == "config error at `a.b`: boom"
    assert str(ConfigError("plain")) == "plain"
    assert ConfigError("plain").path == ""


# -- validation errors: path and reason ------------------------------------------------------


def test_unknown_agg() -> None:
    err = bad(lambda d: d["metrics"][0].update(agg="median"))
    assert err.path == "metrics[0].agg"
    assert "config error at `metrics[0].agg`" in str(err)
    assert "unknown agg 'median'" in str(err)
    listed = "expected one of count, sum, min, max, avg, distinct, quantile, last, stddev, variance"
    assert f"{listed}, first" in str(err)


@pytest.mark.parametrize("agg", ["distinct", "quantile", "last", "first", "stddev", "variance"])
def test_aggs_beyond_count_need_a_value(agg: str) -> None:
    err = bad(lambda d: d["metrics"][2].update(agg=agg, q=0.5 if agg == "quantile" else None))
    assert err.path == "metrics[2].value"
    assert f"agg '{agg}' needs `value`" in str(err)


def test_quantile_needs_q_strictly_between_0_and_1() -> None:
    def set_q(q: Any) -> Callable[[dict[str, Any]], object]:
        return lambda d: d["metrics"][1].update(agg="quantile", q=q)

    err = bad(set_q(None))
    assert (err.path, "needs `q`" in str(err)) == ("metrics[1].q", True)
    err = bad(set_q([0.5, 1.0]))
    assert err.path == "metrics[1].q" and "strictly between 0 and 1" in str(err)
    ok = design()
    set_q([0.5, 0.99])(ok)
    ok["derived"] = []  # a formula over a quantile is refused (see below)
    assert config_from_dict(ok).metrics[1].quantiles() == [0.5, 0.99]
    err = bad(lambda d: d["metrics"][1].update(q=0.5))
    assert err.path == "metrics[1].q" and "only for agg 'quantile'" in str(err)


def test_resolutions_set_the_slice_and_must_nest() -> None:
    ok = design()
    ok["metrics"][0].pop("slice")
    ok["metrics"][0]["resolutions"] = ["1s", "1m", "1h"]
    m = config_from_dict(ok).metrics[0]
    assert (m.slice, m.slice_lengths()) == (1000, [1000, 60_000, 3_600_000])
    err = bad(lambda d: d["metrics"][0].update(resolutions=["1m", "90s"]))
    assert err.path == "metrics[0].resolutions" and "multiple of the one before" in str(err)
    err = bad(lambda d: d["metrics"][0].update(slice="10s", resolutions=["1m", "1h"]))
    assert err.path == "metrics[0].slice" and "finest resolution" in str(err)
    err = bad(
        lambda d: d["metrics"][0].update(slice="1m", resolutions=["1m", "7h"], retention="1d")
    )
    assert err.path == "metrics[0].retention" and "does not divide retention" in str(err)


def test_slice_must_divide_retention() -> None:
    err = bad(lambda d: d["metrics"][0].update(slice="1m", retention="90s"))
    # The check spans two fields; it is reported on the metric (or one of its fields).
    assert err.path.startswith("metrics[0]")
    assert "slice (60000ms) does not divide retention (90000ms)" in str(err)


def test_retention_shorter_than_slice() -> None:
    err = bad(lambda d: d["metrics"][1].update(slice="1h", retention="1m"))
    assert err.path.startswith("metrics[1]")
    assert "retention 60000ms is shorter than the slice" in str(err)


def test_slice_below_one_second() -> None:
    err = bad(lambda d: d["metrics"][0].update(slice="500ms", retention="1s"))
    assert err.path.startswith("metrics[0]")
    assert "shorter than the 1s minimum" in str(err)


@pytest.mark.parametrize("agg", ["sum", "min", "max", "avg"])
def test_value_required_unless_count(agg: str) -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["metrics"][1]["agg"] = agg
        del d["metrics"][1]["value"]

    err = bad(mutate)
    assert err.path in ("metrics[1]", "metrics[1].value")
    assert f"agg '{agg}' needs `value`" in str(err)


def test_key_field_not_in_schema() -> None:
    err = bad(lambda d: d["metrics"][1].update(key=["merchant", "country"]))
    assert err.path == "metrics[1].key"
    assert "key field 'country' is not in source.schema (ts, card, merchant, amount)" in str(err)


def test_key_field_repeated() -> None:
    err = bad(lambda d: d["metrics"][0].update(key=["card", "card"]))
    assert err.path.startswith("metrics[0]")
    assert "repeat a field" in str(err)


def test_empty_key() -> None:
    err = bad(lambda d: d["metrics"][0].update(key=[]))
    assert err.path == "metrics[0].key"
    assert "at least 1 item" in str(err)


def test_duplicate_metric_names() -> None:
    err = bad(lambda d: d["metrics"][2].update(name="txn_count"))
    assert err.path == "metrics[2].name"
    assert "metric name 'txn_count' is used twice" in str(err)


def test_derived_name_clashing_with_metric() -> None:
    err = bad(lambda d: d["derived"][0].update(name="amount_sum"))
    assert err.path == "derived[0].name"
    assert "name 'amount_sum' is already a metric" in str(err)


def test_a_formula_over_inputs_of_different_slices_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data = yaml.safe_load(DESIGN_YAML)
    data["metrics"][2]["slice"] = "10s"  # merchant_txn; amount_sum keeps the default
    data["derived"][0]["name"] = "avg_ticket_mixed"
    with caplog.at_level("WARNING", logger="sluice.config"):
        config_from_dict(data)
        config_from_dict(data)
    warned = [r for r in caplog.records if "different slices" in r.getMessage()]
    assert len(warned) == 1 and warned[0].derived == "avg_ticket_mixed"  # type: ignore[attr-defined]
    assert "merchant_txn=10s" in warned[0].slices  # type: ignore[attr-defined]
    caplog.clear()
    with caplog.at_level("WARNING", logger="sluice.config"):
        config_from_dict(yaml.safe_load(DESIGN_YAML))  # one slice length: no word
    assert not [r for r in caplog.records if "different slices" in r.getMessage()]


def test_a_formula_over_a_quantile_is_refused() -> None:
    """A quantile answers one value per quantile asked for: a formula over it passed the checks
    and every lookup of it failed with a bare 500."""
    err = bad(lambda d: (
        d["metrics"][1].update(agg="quantile", q=[0.5, 0.9], filter=None),
        d["derived"][0].update(expr="amount_sum * 2"),
    ))  # fmt: skip
    assert err.path == "derived[0].expr"
    assert "metric 'amount_sum' is a quantile" in str(err)


@pytest.mark.parametrize("name", ["1abc", "has-dash", "sp ace", ""])
def test_bad_metric_name(name: str) -> None:
    err = bad(lambda d: d["metrics"][1].update(name=name))
    assert err.path == "metrics[1].name"
    assert f"metric name {name!r} must match" in str(err)


def test_unknown_top_level_field() -> None:
    err = bad(lambda d: d.update(metrcs=[]))
    assert err.path == "metrcs"
    assert "unknown field; check its spelling against DESIGN §3" in str(err)


def test_unknown_nested_field() -> None:
    err = bad(lambda d: d["metrics"][1].update(windw="5m"))
    assert err.path == "metrics[1].windw"
    assert "unknown field" in str(err)


def test_missing_metrics() -> None:
    err = bad(lambda d: d.pop("metrics"))
    assert err.path == "metrics"
    assert "field required" in str(err)


def test_empty_metrics() -> None:
    err = bad(lambda d: d.update(metrics=[]))
    assert err.path == "metrics"
    assert "at least 1 item" in str(err)


@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("metrics", 0, "slice"), "1 minute"),
        (("metrics", 0, "retention"), "7 days"),
        (("spark", "trigger"), "fast"),
        (("backpressure", "sensitivity"), "2S"),
    ],
)
def test_bad_duration(where: tuple[Any, ...], value: str) -> None:
    def mutate(d: dict[str, Any]) -> None:
        node = d
        for part in where[:-1]:
            node = node[part]
        node[where[-1]] = value

    err = bad(mutate)
    expected_path = ".".join(str(p) for p in where).replace(".0.", "[0].")
    assert err.path == expected_path
    assert "expected a duration such as '500ms'" in str(err)
    assert repr(value) in str(err)


def test_fractional_millisecond_duration() -> None:
    err = bad(lambda d: d["spark"].update(trigger="1.5ms"))
    assert err.path == "spark.trigger"
    assert "not a whole number of milliseconds" in str(err)


def test_bad_size() -> None:
    err = bad(lambda d: d["backpressure"].update(high_watermark="50 megabytes"))
    assert err.path == "backpressure.high_watermark"
    assert "expected a size such as '500KB'" in str(err)


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379", "127.0.0.1:6379", "tcp://x", ""])
def test_bad_redis_url_scheme(url: str) -> None:
    err = bad(lambda d: d.update(redis=url))
    assert err.path == "redis"
    assert "must start with redis://, rediss:// or unix://" in str(err)
    assert repr(url) in str(err)


@pytest.mark.parametrize("url", ["redis://h:1/0", "rediss://h:1", "unix:///tmp/r.sock", None])
def test_good_redis_urls(url: str | None) -> None:
    data = design()
    data["redis"] = url
    assert config_from_dict(data).redis == url


@pytest.mark.parametrize(("low", "high"), [("50MB", "50MB"), ("60MB", "50MB"), (1001, 1000)])
def test_low_watermark_must_be_below_high(low: Any, high: Any) -> None:
    err = bad(lambda d: d["backpressure"].update(low_watermark=low, high_watermark=high))
    assert err.path in ("backpressure", "backpressure.low_watermark")
    assert "low_watermark" in str(err)
    assert "must be below high_watermark" in str(err)


@pytest.mark.parametrize("step", [0, 1, 1.5, -0.1])
def test_step_out_of_range(step: float) -> None:
    err = bad(lambda d: d["backpressure"].update(step=step))
    assert err.path == "backpressure.step"
    assert re.search(r"Input should be (greater|less) than [01]", str(err))


def test_unknown_controller() -> None:
    err = bad(lambda d: d["backpressure"].update(controller="magic"))
    assert err.path == "backpressure.controller"
    assert "stepwise" in str(err)


@pytest.mark.parametrize("spec", ["string", "double", "boolean", "string?"])
def test_time_field_must_be_long(spec: str) -> None:
    err = bad(lambda d: d["source"]["schema"].update(ts=spec))
    assert err.path in ("source", "source.time_field")
    assert f"time_field 'ts' must be a long (epoch ms), not {spec}" in str(err)


@pytest.mark.parametrize("spec", ["long", "int", "long?"])
def test_time_field_may_be_long_or_int(spec: str) -> None:
    data = design()
    data["source"]["schema"]["ts"] = spec
    assert config_from_dict(data).source.time_field == "ts"


def test_time_field_not_in_schema() -> None:
    err = bad(lambda d: d["source"].update(time_field="event_time"))
    assert err.path == "source.time_field"
    assert "'event_time' is not in the schema" in str(err)


def test_time_field_may_be_null() -> None:
    data = design()
    data["source"]["time_field"] = None
    cfg = config_from_dict(data)
    assert cfg.source.time_field is None
    assert cfg.source.field_types()["ts"] == FieldType(type="long", nullable=False)


def test_unknown_schema_type() -> None:
    err = bad(lambda d: d["source"]["schema"].update(amount="decimal"))
    assert err.path == "source.schema"
    assert "unknown field type 'decimal'" in str(err)
    assert "add '?' for a field that may be missing" in str(err)


@pytest.mark.parametrize(
    ("name", "reason"), [("_hidden", "must not start with '_'"), ("9lives", "must match")]
)
def test_bad_schema_field_name(name: str, reason: str) -> None:
    err = bad(lambda d: d["source"]["schema"].update({name: "long"}))
    assert err.path == "source.schema"
    assert reason in str(err)


@pytest.mark.parametrize("stream", ["", "ev ents", "ev{x}"])
def test_bad_stream_name(stream: str) -> None:
    err = bad(lambda d: d["source"].update(stream=stream))
    assert err.path == "source.stream"
    assert "no spaces or braces" in str(err)


@pytest.mark.parametrize("shards", [0, 1025])
def test_shards_out_of_range(shards: int) -> None:
    err = bad(lambda d: d["source"].update(shards=shards))
    assert err.path == "source.shards"
    assert re.search(r"Input should be (greater|less) than or equal to (1|1024)", str(err))


def test_bad_format() -> None:
    err = bad(lambda d: d["source"].update(format="csv"))
    assert err.path == "source.format"
    assert "'fields'" in str(err)
    assert "'jsonl'" in str(err)


def test_derived_formula_with_unknown_metric() -> None:
    err = bad(lambda d: d["derived"][0].update(expr="amount_sum / refunds"))
    assert err.path == "derived[0].expr"
    assert "unknown metric 'refunds' in formula" in str(err)
    assert "known metrics: amount_sum, merchant_txn, txn_count" in str(err)


def test_derived_formula_over_metrics_with_different_keys() -> None:
    err = bad(lambda d: d["derived"][0].update(expr="amount_sum / txn_count"))
    assert err.path == "derived[0].expr"
    assert "metrics in a formula must share one key" in str(err)
    assert "['card']" in str(err)
    assert "['merchant']" in str(err)


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("amount_sum /", "formula ends too early"),
        ("amount_sum $ 2", "unexpected character '\\$'"),
        ("1 + 2", "formula names no metric"),
        ("", "formula is empty"),
    ],
)
def test_derived_formula_that_does_not_parse(expr: str, reason: str) -> None:
    err = bad(lambda d: d["derived"][0].update(expr=expr))
    assert err.path == "derived[0].expr"
    assert re.search(reason, str(err))


def test_second_derived_is_indexed() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["derived"].append({"name": "bad_one", "expr": "nope * 2"})

    err = bad(mutate)
    assert err.path == "derived[1].expr"
    assert "unknown metric 'nope'" in str(err)


def test_several_errors_mention_the_rest() -> None:
    def mutate(d: dict[str, Any]) -> None:
        d["metrics"][0]["agg"] = "median"
        d["metrics"][1]["slice"] = "soon"

    err = bad(mutate)
    assert err.path == "metrics[0].agg"
    assert "(and 1 more error)" in str(err)


# -- not a mapping / files -------------------------------------------------------------------


@pytest.mark.parametrize("data", [None, [], ["metrics"], "metrics: []", 42])
def test_config_must_be_a_mapping(data: Any) -> None:
    with pytest.raises(ConfigError, match=r"the config must be a mapping, got "):
        config_from_dict(data)


def test_load_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"config file '.*nope\.yaml' not found"):
        load_config(path)


def test_load_config_directory_is_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file"):
        load_config(tmp_path)


def test_load_config_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text("metrics: [\n  - {name: a, key: [k]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"not valid YAML") as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert not isinstance(info.value.__cause__, yaml.YAMLError)


def test_a_formula_of_a_derived_metric_says_so() -> None:
    data = design()
    data["derived"].append({"name": "double_ticket", "expr": "avg_ticket * 2"})
    with pytest.raises(ConfigError, match=r"`derived\[1\]\.expr`: 'avg_ticket' is a derived"):
        config_from_dict(data)


def test_load_config_invalid_yaml_is_one_line_with_its_place(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text("source:\n\t- b\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: not valid YAML: line 2, column 1: found character '\\t' that cannot start any"
        " token (while scanning for the next token)"
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("metrics: []\nsource: {}\nmetrics: []\n", "line 3, column 1: key 'metrics'"),
        ("source: {format: jsonl, format: fields}\n", "line 1, column 25: key 'format'"),
        (
            "source:\n  shards: 1\n  <<: {shards: 2}\n  shards: 3\n",
            "line 4, column 3: key 'shards'",
        ),
    ],
)
def test_load_config_refuses_a_key_given_twice(tmp_path: Path, text: str, where: str) -> None:
    """The last would win, silently: a second `metrics:` would drop the first's metrics."""
    with pytest.raises(ConfigError, match=f"not valid YAML: {where} is given twice"):
        load_config(_written(tmp_path, text))


def test_load_config_keeps_yaml_merge_keys_and_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    text = DESIGN_YAML.replace("source:\n", "source:\n  <<: {format: fields}\n", 1)
    assert text != DESIGN_YAML
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_config(path) == config_from_dict(design(), tmp_path.resolve())


def test_load_config_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_bytes(DESIGN_YAML.encode("utf-16"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: not UTF-8 text (byte 0 is b'\\xff'); save it as UTF-8"


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "", "42\n"])
def test_load_config_yaml_not_a_mapping(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=r"the config must be a mapping"):
        load_config(_written(tmp_path, text))


def _written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sluice.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_load_config_validation_error_has_path(tmp_path: Path) -> None:
    path = tmp_path / "sluice.yaml"
    path.write_text(DESIGN_YAML.replace("agg: count, slice", "agg: cnt, slice"), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.path == "metrics[0].agg"
    assert "unknown agg 'cnt'" in str(info.value)


# YAML values that are neither strings nor whole numbers (inf, null, lists, fractions) must fail
# as ConfigError with the field path, never as a bare TypeError or OverflowError.
@pytest.mark.parametrize(
    ("line", "path"),
    [
        ("slice: .inf", "metrics[0].slice"),
        ("slice: null", "metrics[0].slice"),
        ("slice: [1]", "metrics[0].slice"),
        ("high_watermark: 1.5", "backpressure.high_watermark"),
    ],
)
def test_non_string_duration_or_size_raises_config_error(
    tmp_path: Path, line: str, path: str
) -> None:
    original = "slice: 1m" if line.startswith("slice") else "high_watermark: 50MB"
    assert original in DESIGN_YAML
    text = DESIGN_YAML.replace(original, line)
    p = tmp_path / "sluice.yaml"
    p.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(p)
    assert info.value.path == path


# -- SourceConfig helpers --------------------------------------------------------------------


def test_shard_keys_single_shard_is_the_stream() -> None:
    assert SourceConfig(stream="events", shards=1).shard_keys() == ["events"]


@pytest.mark.parametrize("n", [2, 3, 16])
def test_shard_keys_n_shards(n: int) -> None:
    keys = SourceConfig(stream="clicks", shards=n).shard_keys()
    assert keys == [f"clicks:{i}" for i in range(n)]
    assert len(set(keys)) == n


def test_dead_letter_stream_key() -> None:
    assert SourceConfig(stream="events").dead_letter_stream == "sluice:dead:{events}"


def test_field_types_make_time_field_nullable() -> None:
    src = SourceConfig.model_validate(
        {"schema": {"ts": "long", "card": "string", "tip": "double?"}, "time_field": "ts"}
    )
    types = src.field_types()
    assert types == {
        "ts": FieldType(type="long", nullable=True),
        "card": FieldType(type="string", nullable=False),
        "tip": FieldType(type="double", nullable=True),
    }
    # The declared schema itself is unchanged.
    assert src.schema_["ts"] == "long"


@pytest.mark.parametrize(
    ("spec", "typ", "nullable"),
    [("long", "long", False), ("string?", "string", True), ("boolean", "boolean", False)],
)
def test_field_type_parse(spec: str, typ: str, nullable: bool) -> None:
    assert FieldType.parse(spec) == FieldType(type=typ, nullable=nullable)


@pytest.mark.parametrize("spec", ["str", "long??", "", "?"])
def test_field_type_parse_rejects(spec: str) -> None:
    with pytest.raises(ValueError, match=r"unknown field type"):
        FieldType.parse(spec)


def test_single_task_events_is_auto_or_a_count() -> None:
    from sluice.pipeline.plan import MetricSpec, single_task_events

    def specs(groups: int) -> list[MetricSpec]:
        return [MetricSpec(i, f"m{i}", "count", 10_000, 3_600_000, True, group=i // 2)
                for i in range(2 * groups)]  # fmt: skip

    cfg = config_from_dict(design())
    assert cfg.spark.single_task_events == "auto"
    assert single_task_events("auto", specs(2)) == 16_000  # two groups, as measured
    assert single_task_events("auto", specs(6)) == 5_333  # each event is folded six times
    assert single_task_events("auto", []) == 32_000
    assert single_task_events(0, specs(6)) == 0 and single_task_events(20_000, specs(6)) == 20_000
    data = design()
    data["spark"]["single_task_events"] = 9000
    assert config_from_dict(data).spark.single_task_events == 9000
    assert "single_task_events" in str(bad(lambda d: d["spark"].update(single_task_events=-1)))
    assert "single_task_events" in str(bad(lambda d: d["spark"].update(single_task_events="x")))


def test_partial_aggregation_is_auto_and_follows_the_last_batch() -> None:
    from sluice.pipeline.plan import PartialAggregation

    assert config_from_dict(design()).spark.partial_aggregation == "auto"
    auto = PartialAggregation("auto")
    assert auto.on  # no batch seen: Spark's default
    auto.observe(rows=300_000, cells=214_000)  # six groups over many keys: most cells once
    assert not auto.on
    auto.observe(rows=0, cells=0)  # an empty batch says nothing
    assert not auto.on
    auto.observe(rows=200_000, cells=18_000)  # few keys, events of one moment
    assert auto.on
    auto.observe(rows=1_000, cells=299)  # just under 0.3 cells per row: on
    assert auto.on
    auto.observe(rows=1_000, cells=300)  # 0.3 cells per row: off
    assert not auto.on
    for setting, on in (("on", True), ("off", False)):
        fixed = PartialAggregation(setting)
        for rows, cells in ((300_000, 214_000), (200_000, 18_000)):
            fixed.observe(rows, cells)
            assert fixed.on is on
    assert "partial_aggregation" in str(bad(lambda d: d["spark"].update(partial_aggregation="x")))
    err = str(bad(lambda d: d["spark"].update(
        conf={"spark.sql.execution.bypassPartialAggregation": "true"})))  # fmt: skip
    assert "spark.conf" in err and "spark.partial_aggregation" in err
