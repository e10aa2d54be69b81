"""Spark SQL snippets in the config (`filter`, `value`) are checked at start-up, with the field
path in the error. Real Spark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluice.errors import ConfigError
from sluice.pipeline.plan import check_expressions
from tests.conftest import make_config

pytestmark = pytest.mark.spark


def _metric(**kw: Any) -> list[dict[str, Any]]:
    base = {"name": "m", "key": ["card"], "agg": "sum", "value": "amount"}
    return [{**base, **kw}]


def test_a_mistyped_field_is_one_message_that_suggests_schema_fields(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """No kilobytes of the JVM's stack on stderr before it (PySpark's query-context loggers),
    and no suggestion of the source's own columns (`_e`, `_ts`, …), which no metric may name."""
    cfg = make_config("redis://127.0.0.1:1/0", tmp_path, metrics=_metric(value="amout"),
                      derived=[])  # fmt: skip
    with pytest.raises(ConfigError, match="amout") as info:
        check_expressions(spark, cfg)
    message = str(info.value)
    assert "`amount`" in message and "`_" not in message, message
    err = capfd.readouterr().err
    assert "QueryContextLogger" not in err and "AnalysisException" not in err, err[:500]


@pytest.mark.parametrize(
    ("metric", "path", "words"),
    [
        (_metric(filter="amount >"), "metrics[0].filter", "invalid Spark SQL filter"),
        (_metric(filter="no_such_field > 0"), "metrics[0].filter", "no_such_field"),
        (_metric(filter="amount + 1"), "metrics[0].filter", "not boolean"),
        (_metric(value="card"), "metrics[0].value", "needs a number"),
        (_metric(value="amount * "), "metrics[0].value", "invalid Spark SQL value"),
    ],
)
def test_bad_expressions_fail_at_start_up(
    spark: Any, tmp_path: Path, metric: list[dict[str, Any]], path: str, words: str
) -> None:
    cfg = make_config("redis://127.0.0.1:1/0", tmp_path, metrics=metric, derived=[])
    with pytest.raises(ConfigError, match=words) as info:
        check_expressions(spark, cfg)
    assert info.value.path == path


def test_good_expressions_report_their_value_types(spark: Any, tmp_path: Path) -> None:
    metrics = [
        *_metric(name="a", value="amount * 100", filter="merchant LIKE 'm%' AND qty > 1"),
        *_metric(name="b", value="qty"),
        {"name": "c", "key": ["card"], "agg": "count"},
    ]
    cfg = make_config("redis://127.0.0.1:1/0", tmp_path, metrics=metrics, derived=[])
    types = check_expressions(spark, cfg)
    assert types["a"].simpleString() == "double"
    assert types["b"].simpleString() == "bigint"
    assert types["c"] is None
