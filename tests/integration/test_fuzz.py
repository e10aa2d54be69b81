"""Property-based HTTP fuzzing of the whole API from its own OpenAPI spec: whatever comes in,
no response is a 500. Real Redis behind the app."""

from __future__ import annotations

from pathlib import Path

import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from sluice.server.app import create_app
from tests.conftest import make_config


def test_no_input_gives_a_server_error(r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    app = create_app(make_config(redis_url, tmp_path), r)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    calls: dict[str, int] = {}
    for op_result in schema.get_all_operations():
        operation = op_result.ok()

        @settings(
            max_examples=60,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case: schemathesis.Case) -> None:
            response = case.call()
            calls[case.operation.label] = calls.get(case.operation.label, 0) + 1
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} {case.query} -> {response.status_code}"
                )
            case.validate_response(response, checks=[not_a_server_error])

        run()
    assert not failures, failures
    assert len(calls) >= 8, calls  # every operation of the spec was exercised
    # Operations with inputs were fuzzed many times (those without get one case).
    for label in ("GET /v1/metrics/{name}", "GET /v1/metrics/{name}/series", "POST /v1/query"):
        assert calls[label] >= 30, calls
