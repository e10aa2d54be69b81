"""The offline commands' pure parts: the TIME option (epoch ms or ISO 8601, UTC unless it says
otherwise), how times and durations are shown, the progress line and the summary."""

from __future__ import annotations

import datetime as dt
import signal
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sluice.cli import main
from sluice.offline.backfill import BackfillReport
from sluice.offline_cli import (
    check_out_apart,
    format_progress,
    format_summary,
    iso_ms,
    metric_names,
    parse_time_ms,
)
from sluice.units import duration_text

NOV_1 = 1_793_491_200_000  # 2026-11-01T00:00:00Z


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1793491200000", NOV_1),
        ("0", 0),
        ("-1000", -1000),
        (" 1793491200000 ", NOV_1),
        ("2026-11-01", NOV_1),
        ("2026-11-01T00:00:00", NOV_1),  # naive: UTC, not the machine's zone
        ("2026-11-01T12:00:00Z", NOV_1 + 12 * 3_600_000),
        ("2026-11-01 12:00:00Z", NOV_1 + 12 * 3_600_000),
        ("2026-11-01T14:00:00+02:00", NOV_1 + 12 * 3_600_000),
        ("2026-11-01T00:00:00-05:30", NOV_1 + 5 * 3_600_000 + 1_800_000),
        ("2026-11-01T12:00", NOV_1 + 12 * 3_600_000),
        ("2026-11-01T00:00:00.123Z", NOV_1 + 123),
        ("2026-11-01T00:00:00.999999Z", NOV_1 + 999),  # below a millisecond: truncated
        ("1969-12-31T23:59:59.999Z", -1),
    ],
)
def test_time_is_epoch_ms_or_iso_8601(text: str, want: int) -> None:
    assert parse_time_ms(text) == want


def test_a_naive_time_is_utc_whatever_the_local_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert parse_time_ms("2026-11-01T00:00:00") == NOV_1
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


@pytest.mark.parametrize("text", ["", "yesterday", "2026-13-01", "2026-11-01T25:00", "1.5e12",
                                  "12:00", "2026/11/01"])  # fmt: skip
def test_a_bad_time_names_the_value_and_the_forms_taken(text: str) -> None:
    with pytest.raises(ValueError, match=r"is neither epoch ms nor an ISO 8601 time; use e\.g\."):
        parse_time_ms(text)


def test_iso_ms_shows_utc_and_milliseconds_only_when_there_are_some() -> None:
    assert iso_ms(NOV_1) == "2026-11-01T00:00:00Z"
    assert iso_ms(NOV_1 + 12 * 3_600_000 + 7) == "2026-11-01T12:00:00.007Z"
    assert iso_ms(-1) == "1969-12-31T23:59:59.999Z"
    for ms in (0, NOV_1, NOV_1 + 1, 1_234_567_890_123):
        assert parse_time_ms(iso_ms(ms)) == ms
    stamp = dt.datetime.fromtimestamp(NOV_1 / 1000, dt.UTC).isoformat()
    assert parse_time_ms(stamp) == NOV_1


@pytest.mark.parametrize("option", ["--start", "--until"])
def test_a_bad_time_option_is_a_usage_error_naming_it(option: str) -> None:
    res = CliRunner().invoke(
        main, ["backfill", "-c", "nowhere.yaml", "--input", "x", option, "last tuesday"]
    )
    assert res.exit_code == 2
    assert f"Invalid value for '{option}'" in res.output
    assert "'last tuesday' is neither epoch ms nor an ISO 8601 time" in res.output


def test_until_before_start_is_a_usage_error() -> None:
    res = CliRunner().invoke(main, ["backfill", "-c", "nowhere.yaml", "--input", "x",
                                    "--start", "2026-11-02", "--until", "2026-11-01"])  # fmt: skip
    assert res.exit_code == 2
    assert "Invalid value for '--until': must be after `--start` (2026-11-02T00:00:00Z)" in (
        res.output
    )


def test_metric_names_are_comma_separated_and_repeatable() -> None:
    assert metric_names(()) is None
    assert metric_names(("a,b", " c ", "d")) == ["a", "b", "c", "d"]
    for empty in [("",), ("a,",), ("a,,b",), ("a", " ")]:  # never "every metric" by accident
        with pytest.raises(click.BadParameter, match="empty metric name"):
            metric_names(empty)


@pytest.mark.parametrize(
    ("out", "read", "refused"),
    [
        ("/d/ev", "/d/ev", True),  # the input itself
        ("/d/ev/o", "/d/ev", True),  # inside a folder read whole
        ("/d", "/d/ev", True),  # a folder that holds it
        ("/d/ev2", "/d/ev", False),
        ("/d/x.parquet", "/d/*.parquet", True),  # a path the glob matches
        ("/d/x.parquet/y", "/d/*.parquet", True),
        ("/d", "/d/*.parquet", True),
        ("/", "/d/*.parquet", True),
        ("/d/o", "/d/*.parquet", False),  # beside the matches, not one of them
        ("/d/p=1", "/d/*/*.parquet", True),  # holds matches
        ("/d/p=1/o", "/d/*/*.parquet", False),
        ("/d/ev-1/o", "/d/ev*", True),
        ("/d/other", "/d/ev*", False),
        ("file:/d/ev", "/d/ev", True),
        ("s3a://b/o", "s3a://b", False),  # not a local path: the file system's to say
    ],
)
def test_out_may_not_be_or_hold_what_the_job_reads(out: str, read: str, refused: bool) -> None:
    """An overwrite deletes --out before the job reads its inputs: a training set written over
    its archive or spine deleted them."""
    if refused:
        with pytest.raises(click.BadParameter, match="which the job reads"):
            check_out_apart(out, {"input": (read,)})
    else:
        check_out_apart(out, {"input": (read,)})


def test_durations_read_as_people_say_them() -> None:
    assert duration_text(0.84) == "0.8 s"
    assert duration_text(42.4) == "42 s"
    assert duration_text(185) == "3 min 05 s"
    assert duration_text(7620) == "2 h 07 min"
    assert duration_text(6 * 86_400 + 22 * 3600 + 59) == "6 d 22 h"


def test_the_progress_line() -> None:
    p = {"phase": "writing", "tasks_done": 12, "tasks": 40, "partitions_done": 1,
         "partitions": 4, "events": 1_234_567, "slices": 345_678, "elapsed_s": 20.2,
         "events_per_s": 61_000, "left_s": 12}  # fmt: skip
    assert format_progress(p) == (
        "backfill: 1/4 partitions written, 1,234,567 events read, 345,678 slices written,"
        " 61,000 events/s, about 12 s left"
    )
    assert format_progress({**p, "events": 0, "events_per_s": 0, "left_s": None}) == (
        "backfill: 1/4 partitions written, 0 events read, 345,678 slices written"
    )
    assert format_progress({**p, "partitions_done": 4}).endswith("61,000 events/s, finishing")
    assert format_progress({**p, "left_s": 0}).endswith("61,000 events/s, finishing")
    assert format_progress({**p, "phase": "reading", "elapsed_s": 14.2}) == (
        "backfill: reading and shuffling the archive, 12/40 tasks, 14 s"
    )
    assert format_progress({**p, "phase": "planning", "elapsed_s": 3.14}) == (
        "backfill: reading the archive and planning, 3.1 s"
    )


def test_the_summary_shows_seams_as_times_and_a_sample_of_each_bad_row() -> None:
    seam = NOV_1 + 12 * 3_600_000
    report = BackfillReport(
        run="abc",
        metrics=["txn_count", "amount_sum", "pair_count"],
        seams={"txn_count": seam, "amount_sum": seam, "pair_count": NOV_1},
        first_slices={"txn_count": None, "amount_sum": None, "pair_count": None},
        events=1_234_567,
        slices=89_012,
        after_seam=17,
        partitions=16,
        partitions_skipped=5,
        dead={"bad_type": 3, "missing_field": 40},
        samples={
            "bad_type": ['{"reason":"bad_type","x":1}', "second"],
            "missing_field": ["m" * 500],
        },
        warnings=["the live fold began folding 'txn_count' at 1, after ..."],
        elapsed_s=75.0,
    )
    text = format_summary(report)
    lines = text.splitlines()
    assert lines[0] == (
        "backfill abc: 1,234,567 events folded into 89,012 slices of 3 metrics in 1 min 15 s"
    )
    assert f"  seam 2026-11-01T00:00:00Z ({NOV_1}): pair_count" in lines
    assert f"  seam 2026-11-01T12:00:00Z ({seam}): txn_count, amount_sum" in lines
    assert "  bad rows: 43 (not folded, in the partitions written now)" in lines
    assert any(ln.startswith("    missing_field         40  e.g. mmm") for ln in lines), text
    assert any(ln.endswith('e.g. {"reason":"bad_type","x":1}') for ln in lines), text
    assert "second" not in text and max(len(ln) for ln in lines) < 200
    assert "  partitions: 11 written, 5 skipped (written by an earlier run of it)" in lines
    assert "  left to the live fold: 17 slices at or after a seam" in lines
    assert lines[-1] == "  warning: the live fold began folding 'txn_count' at 1, after ..."


def test_the_summary_of_a_rerun_that_had_nothing_to_do() -> None:
    report = BackfillReport("abc", ["n"], {"n": NOV_1}, {"n": NOV_1 - 86_400_000},
                            partitions=4, partitions_skipped=4, elapsed_s=3.0)  # fmt: skip
    lines = format_summary(report).splitlines()
    assert lines[0] == "backfill abc: 0 events folded into 0 slices of 1 metric in 3.0 s"
    assert "  from 2026-10-31T00:00:00Z (--start): n" in lines
    assert "  bad rows: not counted (no partition was read)" in lines
    assert lines[-2:] == [
        "  partitions: 0 written, 4 skipped (written by an earlier run of it)",
        "  nothing to do: an earlier run of it wrote every partition (--fresh writes again)",
    ]


def test_by_default_the_offline_commands_fold_the_metrics_an_archive_holds() -> None:
    """An archive holds events of `source.schema`: without names, a metric that folds a stage's
    output is left out (not refused); named, it is refused with the reason."""
    from sluice.config import config_from_dict
    from sluice.errors import ConfigError
    from sluice.offline.fold import select_metrics

    cfg = config_from_dict({
        "source": {"stream": "events", "schema": {"ts": "long", "card": "string"},
                   "time_field": "ts"},
        "stages": [{"name": "big", "from": "events", "sql": "SELECT * FROM input",
                    "to": {"stream": "big"}}],
        "metrics": [{"name": "txn_count", "key": ["card"], "agg": "count"},
                    {"name": "big_count", "key": ["card"], "agg": "count", "from": "big"}],
    })  # fmt: skip
    assert [m.name for m in select_metrics(cfg, None)] == ["txn_count"]
    with pytest.raises(ConfigError, match="folds the stage output 'big'"):
        select_metrics(cfg, ["big_count"])
    only_stage = cfg.model_copy(update={"metrics": cfg.metrics[1:]})
    with pytest.raises(ConfigError, match="no metric folds the source's events"):
        select_metrics(only_stage, None)


def test_while_spark_starts_the_stop_signals_keep_their_handlers() -> None:
    """PySpark's context installs a SIGINT handler as it starts, which cancels every job from
    inside the JVM call in flight: while `spark_for` starts Spark, such an install is refused,
    and the handler before stays; afterwards installs work again."""
    from sluice.commands import handlers_kept

    def ours(*_: object) -> None: ...

    def theirs(*_: object) -> None: ...

    before = signal.signal(signal.SIGINT, ours)
    try:
        with handlers_kept():
            assert signal.signal(signal.SIGINT, theirs) is ours
            assert signal.getsignal(signal.SIGINT) is ours
        assert signal.signal(signal.SIGINT, theirs) is ours
        assert signal.getsignal(signal.SIGINT) is theirs
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_key_field_given_twice_is_a_usage_error_unless_it_is_the_same() -> None:
    from sluice.training_cli import parse_keys

    assert parse_keys(("card=card_id", " card = card_id ")) == {"card": "card_id"}
    with pytest.raises(click.BadParameter, match="'card' is given twice, as 'card_id' and"):
        parse_keys(("card=card_id", "card=row"))


def test_a_local_glob_that_matches_nothing_fails_before_spark(tmp_path: Path) -> None:
    from sluice.offline.events import ArchiveError
    from sluice.offline_cli import check_local_inputs

    (tmp_path / "a.parquet").write_bytes(b"")
    check_local_inputs((str(tmp_path / "*.parquet"),))
    check_local_inputs((str(tmp_path / "{a,b}.json"),))  # Hadoop's braces: Spark's to read
    with pytest.raises(ArchiveError, match=r"input '.*\*\.json' matches no file or directory"):
        check_local_inputs((str(tmp_path / "*.json"),))
