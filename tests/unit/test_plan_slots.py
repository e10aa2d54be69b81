"""Metrics of different groups that fold alike share their columns (`plan.assign_slots`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql.types import DoubleType, LongType

from sluice.pipeline.plan import MetricSpec, assign_slots, metric_specs
from tests.conftest import make_config


def _metric(name: str, key: list[str], agg: str, slice_: str, value: str | None = None,
            **extra: Any) -> dict[str, Any]:  # fmt: skip
    out = {"name": name, "key": key, "agg": agg, "slice": slice_, "retention": "1h", **extra}
    return out | ({"value": value} if value else {})


def _specs(tmp_path: Path, metrics: list[dict[str, Any]]) -> list[MetricSpec]:
    cfg = make_config("redis://unused", tmp_path, metrics=metrics, derived=[])
    types = {m["name"]: LongType() if m.get("value") == "qty" else DoubleType() for m in metrics}
    return metric_specs(cfg, types)


def test_six_metrics_in_six_groups_fold_in_three_slots(tmp_path: Path) -> None:
    specs = _specs(tmp_path, [
        _metric("txn_count", ["card"], "count", "10s"),
        _metric("card_amount", ["card"], "sum", "1m", "amount"),
        _metric("merchant_count", ["merchant"], "count", "10s"),
        _metric("merchant_amount", ["merchant"], "sum", "30s", "amount"),
        _metric("pair_count", ["card", "merchant"], "count", "30s"),
        _metric("pair_max", ["card", "merchant"], "max", "1m", "amount"),
    ])  # fmt: skip
    assert len({sp.group for sp in specs}) == 6
    slot = {sp.name: sp.column("v") for sp in specs}
    assert slot["txn_count"] == slot["merchant_count"] == slot["pair_count"]
    assert slot["card_amount"] == slot["merchant_amount"]
    assert len(set(slot.values())) == 3
    assert {sp.column("n") for sp in specs} == {"n0", "n1", "n2"}
    assert {sp.column("sum") for sp in specs if sp.agg == "sum"} == {"sum1"}


def test_metrics_of_one_group_never_share_a_slot(tmp_path: Path) -> None:
    specs = _specs(tmp_path, [
        _metric("a", ["card"], "count", "10s"),
        _metric("b", ["card"], "count", "10s", filter="amount > 5"),
        _metric("c", ["merchant"], "count", "10s"),
        _metric("d", ["merchant"], "count", "10s", filter="amount > 5"),
        _metric("e", ["merchant"], "count", "10s", filter="amount > 9"),
    ])  # fmt: skip
    for g in {sp.group for sp in specs}:
        mine = [sp.column("v") for sp in specs if sp.group == g]
        assert len(mine) == len(set(mine)), mine
    assert len({sp.column("v") for sp in specs}) == 3  # the widest group's count


def test_only_alike_folds_share(tmp_path: Path) -> None:
    specs = _specs(tmp_path, [
        _metric("sum_double", ["card"], "sum", "10s", "amount"),
        _metric("sum_long", ["merchant"], "sum", "10s", "qty"),  # long values: its own slot
        _metric("avg", ["card", "merchant"], "avg", "10s", "amount"),  # folds n and sum too
        _metric("max", ["merchant"], "max", "1m", "amount"),
        _metric("res", ["card"], "count", "10s", resolutions=["10s", "1m", "10m"]),
    ])  # fmt: skip
    by = {(sp.name, sp.slice_ms): sp for sp in specs}
    slots = {k: sp.column("v") for k, sp in by.items()}
    assert slots[("avg", 10_000)] == slots[("sum_double", 10_000)]  # count and sum of doubles
    assert len({slots[("sum_double", 10_000)], slots[("sum_long", 10_000)],
                slots[("max", 60_000)]}) == 3  # fmt: skip
    # Each resolution is a group of its own, so the three counts share one slot.
    assert len({slots[("res", ms)] for ms in (10_000, 60_000, 600_000)}) == 1
    assert len({by[("res", ms)].group for ms in (10_000, 60_000, 600_000)}) == 3


def test_a_spec_without_a_slot_names_its_columns_by_index() -> None:
    sp = MetricSpec(4, "m", "sum", 10_000, 3_600_000, False, group=1)
    assert (sp.column("v"), sp.column("sum")) == ("v4", "sum4")
    [slotted] = assign_slots([sp])
    assert (slotted.column("v"), slotted.column("sum")) == ("v0", "sum0")


def test_without_shared_columns_each_metric_keeps_its_own(tmp_path: Path) -> None:
    cfg = make_config("redis://unused", tmp_path, derived=[], metrics=[
        _metric("a", ["card"], "count", "10s"), _metric("b", ["merchant"], "count", "10s"),
    ])  # fmt: skip
    shared = metric_specs(cfg, {"a": None, "b": None})
    alone = metric_specs(cfg, {"a": None, "b": None}, share_columns=False)
    assert [sp.column("v") for sp in shared] == ["v0", "v0"]
    assert [sp.column("v") for sp in alone] == ["v0", "v1"]
