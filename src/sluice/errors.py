"""The one error hierarchy of Sluice.

    SluiceError
     ├── ConfigError            a sluice.yaml that does not validate (names the field path)
     ├── RedisUnavailable       the Redis server cannot be reached or started
     ├── QueryError             a query that cannot be answered
     │    ├── UnknownMetric     (HTTP 404)
     │    ├── BadQuery          malformed window, end or key (HTTP 400 / 422)
     │    └── PartlyWritten     part of a request's events written, the rest not (HTTP 503)
     ├── BackpressureError      the input is over its high watermark; carries `retry_after_s`
     └── PipelineError          the streaming job failed to start or stopped with an error
          ├── AuditError        a batch's completeness audit stayed non-zero after its replays
          ├── LeaseLost         this process no longer leads: it must not commit another batch
          └── LeaderConflict    another pipeline, with another checkpoint, leads these streams

Messages say what was wrong, which value caused it, and what to do.
"""

from __future__ import annotations

from typing import Any


class SluiceError(Exception):
    """Root of every error Sluice raises on purpose."""


class ConfigError(SluiceError):
    """The configuration is invalid. `path` is the dotted field path, e.g. `metrics[0].agg`."""

    def __init__(self, message: str, path: str = "") -> None:
        self.path = path
        super().__init__(f"config error at `{path}`: {message}" if path else message)


class RedisUnavailable(SluiceError):
    """The Redis server could not be reached (or the embedded one could not start)."""


class QueryError(SluiceError):
    """A query that cannot be answered. `status` is the HTTP status it maps to."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)

    def details(self) -> dict[str, Any]:
        """Fields of the error body besides `code` and `message` (none but for some)."""
        return {}


class PartlyWritten(QueryError):
    """Some of a request's events were written and the others (`unwritten`, their indices in
    the request) could not be: 503 `partly_written`, naming them in the error body."""

    status = 503
    code = "partly_written"

    def __init__(self, message: str, unwritten: list[int]) -> None:
        super().__init__(message)
        self.unwritten = unwritten

    def details(self) -> dict[str, Any]:
        return {"unwritten": self.unwritten}


class UnknownMetric(QueryError):
    status = 404
    code = "unknown_metric"


class BadQuery(QueryError):
    """Malformed parameter (400), or well-formed but unanswerable (422, e.g. window > retention)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message, param)
        self.status = status
        self.code = "bad_request" if status == 400 else "unprocessable"


class BadEvent(SluiceError):
    """An event a producer cannot write as it is (not a mapping, not JSON, nothing to write)."""


class BackpressureError(SluiceError):
    """Raised while the input is backpressured. Retry after `retry_after_s` seconds."""

    def __init__(self, retry_after_s: float, message: str = "") -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message or f"backpressured; retry after {retry_after_s:.1f}s")


class PipelineError(SluiceError):
    """The streaming job could not start, or stopped with an error."""


class AuditError(PipelineError):
    """A batch did not balance: its events, their updates and the applied updates disagree.

    Raised after the in-place replays; the batch is neither committed nor trimmed, so the
    restarted query replays it from Spark's offset log.
    """

    def __init__(self, batch_id: int, residual: int, attempts: int) -> None:
        self.batch_id = batch_id
        self.residual = residual
        super().__init__(
            f"batch {batch_id} failed its completeness audit {attempts} times"
            f" (residual {residual:#018x}); it will be replayed from the offset log"
        )


class LeaseLost(PipelineError):
    """This process no longer holds the leadership lease of a streaming query (another process
    took it, or it could not be renewed in time). Raised before a batch commits, so Spark does
    not commit it; the process stops its queries and stands by."""

    def __init__(self, query: str, reason: str) -> None:
        self.query = query
        super().__init__(f"query `{query}` lost its leadership lease ({reason}); standing by")


class LeaderConflict(PipelineError):
    """Another `sluice run` leads the same streams and store from a different checkpoint. Two
    checkpoints over one input would count its events twice, so this process refuses to run."""
