"""A metric redefined under its name while slices of the old definition are stored is refused
(`pipeline.definitions`): by the writers, which record each definition, and by the readers."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import yaml
from click.testing import CliRunner

from sluice.cli import main
from sluice.config import config_from_dict
from sluice.errors import ConfigError
from sluice.pipeline.definitions import check_definitions, definition
from sluice.redis.keys import DEFINITIONS_KEY, slice_hash_key
from sluice.redis.local_cluster import LocalCluster
from tests.conftest import config_data


def changed(data: dict[str, Any], name: str, **fields: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    metric = next(m for m in out["metrics"] if m["name"] == name)
    metric.update(fields)
    return out


def test_a_definition_is_recorded_once_and_a_change_refused_while_its_slices_are_stored(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    data = config_data(redis_url, tmp_path)
    cfg = config_from_dict(data)
    check_definitions(r, cfg)
    stored = {k.decode(): orjson.loads(v) for k, v in r.hgetall(DEFINITIONS_KEY).items()}
    assert stored == {m.name: definition(m) for m in cfg.metrics}
    r.hset(slice_hash_key("qty_sum", "m-1"), "60000", "1:5")  # a slice of the old definition
    for fields, path, said in [
        ({"agg": "max"}, "agg", "agg 'sum', and this config says 'max'"),
        ({"slice": "10s"}, "slice", "slice 1m, and this config says 10s"),
        ({"filter": "qty > 0"}, "filter", "filter none, and this config says 'qty > 0'"),
        ({"key": ["card"]}, "key", "key merchant, and this config says card"),
    ]:
        other = config_from_dict(changed(data, "qty_sum", **fields))
        i = [m.name for m in other.metrics].index("qty_sum")
        with pytest.raises(ConfigError) as e:
            check_definitions(r, other)
        assert e.value.path == f"metrics[{i}].{path}", e.value
        assert f"metric 'qty_sum' has slices stored with {said}" in str(e.value)
        assert "a name of its own" in str(e.value) and "expire with the retention, 1d" in str(
            e.value
        )
        with pytest.raises(ConfigError):  # a reader refuses it too, and records nothing
            check_definitions(r, other, register=False)
    # A longer retention reads the same slices; another metric's change is not this one's.
    check_definitions(r, config_from_dict(changed(data, "qty_sum", retention="2d")))
    check_definitions(r, config_from_dict(changed(data, "card_max", agg="min")))
    assert orjson.loads(r.hget(DEFINITIONS_KEY, "card_max"))["agg"] == "min"  # none stored
    # Once the old slices are gone, the name is free for the new definition.
    r.delete(slice_hash_key("qty_sum", "m-1"))
    check_definitions(r, config_from_dict(changed(data, "qty_sum", agg="max")))
    assert orjson.loads(r.hget(DEFINITIONS_KEY, "qty_sum"))["agg"] == "max"


def test_an_expression_written_otherwise_is_the_same_definition(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    """Spacing and the case of words are not part of a `value` or `filter`; quoted text is."""
    data = config_data(redis_url, tmp_path)
    data["metrics"].append({"name": "visa_sum", "key": ["card"], "agg": "sum",
                            "value": "coalesce(amount, 0) * 2", "slice": "1m",
                            "filter": "merchant = 'VISA' and amount > 0"})  # fmt: skip
    check_definitions(r, config_from_dict(data))
    r.hset(slice_hash_key("visa_sum", "c-1"), "60000", "1:5")
    r.hset(slice_hash_key("amount_sum", "m-1"), "60000", "1:5")
    same = changed(data, "visa_sum", value="COALESCE( amount,0 )*2",
                   filter="merchant='VISA'  AND amount>0")  # fmt: skip
    check_definitions(r, config_from_dict(changed(same, "amount_sum", filter="AMOUNT>0")))
    kept = orjson.loads(r.hget(DEFINITIONS_KEY, "visa_sum"))
    assert kept["filter"] == "merchant = 'VISA' and amount > 0"  # as first written
    for fields, path in [({"filter": "merchant = 'visa' and amount > 0"}, "filter"),
                         ({"value": "coalesce(amount, 1) * 2"}, "value")]:  # fmt: skip
        other = config_from_dict(changed(data, "visa_sum", **fields))
        with pytest.raises(ConfigError) as e:
            check_definitions(r, other)
        assert e.value.path.endswith(f".{path}"), e.value


def test_the_query_command_refuses_a_redefined_metric_in_one_line(
    r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    data = config_data(redis_url, tmp_path)
    check_definitions(r, config_from_dict(data))
    r.hset(slice_hash_key("amount_sum", "m-1"), "60000", "1:5")
    path = tmp_path / "sluice.yaml"
    path.write_text(yaml.safe_dump(changed(data, "amount_sum", agg="min")))
    res = CliRunner().invoke(main, ["query", "-c", str(path), "amount_sum", "--key", "m-1",
                                    "--window", "1h"])  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "has slices stored with agg 'sum', and this config says 'min'" in res.output
    assert "Traceback" not in res.output and res.output.count("\n") == 1
    path.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(main, ["query", "-c", str(path), "amount_sum", "--key", "m-1",
                                    "--window", "1h"])  # fmt: skip
    assert res.exit_code == 0, res.output
    # A derived metric is answered from its inputs' slices: checked as they are.
    path.write_text(yaml.safe_dump(changed(data, "amount_sum", filter="amount > 1")))
    res = CliRunner().invoke(main, ["query", "-c", str(path), "avg_ticket", "--key", "m-1",
                                    "--window", "1h"])  # fmt: skip
    assert res.exit_code == 1 and "has slices stored with filter 'amount > 0'" in res.output


def test_on_a_redis_cluster_the_scan_finds_slices_on_any_master(
    rc: Any, redis_cluster: LocalCluster, tmp_path: Path
) -> None:
    data = config_data(redis_cluster.url, tmp_path)
    check_definitions(rc, config_from_dict(data))
    key = slice_hash_key("amount_sum", "m-7")
    rc.hset(key, "60000", "1:5")  # one slice hash, on one of the three masters
    with pytest.raises(ConfigError, match="has slices stored with agg 'sum'"):
        check_definitions(rc, config_from_dict(changed(data, "amount_sum", agg="max")))
    rc.delete(key)
    check_definitions(rc, config_from_dict(changed(data, "amount_sum", agg="max")))


def test_a_training_set_from_the_store_refuses_a_redefined_metric(
    spark: Any, r: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    from sluice.offline.training import training_set

    data = config_data(redis_url, tmp_path)
    check_definitions(r, config_from_dict(data))
    r.hset(slice_hash_key("qty_sum", "m-1"), "60000", "1:5")
    spine = spark.createDataFrame([("m-1", 120_000)], "merchant string, t long")
    other = config_from_dict(changed(data, "qty_sum", slice="10s"))
    with pytest.raises(ConfigError, match="has slices stored with slice 1m, and this config says"):
        training_set(spark, other, spine, {"qty_sum": ["1m"]}, "t")
