"""Rates and durations on the command line are finite numbers above 0: anything else is a
usage error (exit status 2) that names the option, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from sluice.cli import main


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "0", "-5", "fast"])
@pytest.mark.parametrize("command", ["produce", "demo"])
def test_a_rate_that_is_no_positive_finite_number_is_a_usage_error(
    tmp_path: Path, command: str, bad: str
) -> None:
    cfg = tmp_path / "sluice.yaml"
    cfg.write_text("metrics: []\n")
    args = ["produce", "-c", str(cfg), "--duration", "1"] if command == "produce" else ["demo"]
    res = CliRunner().invoke(main, [*args, "--rate", bad])
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--rate'" in res.output
    assert "Traceback" not in res.output
    said = "is not a number" if bad == "fast" else "must be a finite number above 0"
    assert said in res.output


def test_a_duration_of_nan_is_a_usage_error(tmp_path: Path) -> None:
    cfg = tmp_path / "sluice.yaml"
    cfg.write_text("metrics: []\n")
    res = CliRunner().invoke(main, ["produce", "-c", str(cfg), "--rate", "10", "--duration", "nan"])
    assert res.exit_code == 2 and "Invalid value for '--duration'" in res.output, res.output
