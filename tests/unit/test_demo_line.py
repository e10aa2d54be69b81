"""The demo's status line says how the producer is held: free, throttled (the flag up), or
capped (a provisional cap, the flag clear). It said "free" for a producer held at 100/s."""

from __future__ import annotations

from sluice.demo import _flow


def test_the_demo_names_a_cap_that_outlived_its_flag() -> None:
    assert _flow({"backpressure": False, "rate": None}).strip() == "free"
    assert _flow({"backpressure": True, "rate": 250.0}) == "throttled to 250/s"
    assert _flow({"backpressure": True, "rate": None}) == "throttled"
    assert _flow({"backpressure": False, "rate": 100.0}) == "capped at 100/s"
