"""`stages:`: stream-to-stream stages, each its SQL, static tables and output stream."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from sluice.config.base import (
    NAME_RE,
    FieldType,
    SizeBytes,
    _at,
    _FieldError,
    _Model,
    check_schema,
    check_stream_name,
)

RESERVED_STAGES = ("ingest", "spark", "store", "input")
TABLE_FORMATS = (".csv", ".json", ".jsonl", ".parquet")


class StageOutput(_Model):
    """The stream a stage writes: `jsonl` entries of up to `entry_events` events each."""

    stream: str
    shards: int = Field(1, ge=1, le=1024)
    schema_: dict[str, str] | None = Field(
        None,
        alias="schema",
        description="the output's fields and types; null = taken from the SQL at start-up",
    )
    time_field: str | None = Field(
        None, description="the event-time field; null = the input's, when the output keeps it"
    )
    high_watermark: SizeBytes | None = Field(
        None, description="its readers' backlog watermarks; null = backpressure's"
    )
    low_watermark: SizeBytes | None = None
    entry_events: int = Field(500, ge=1, le=100_000, description="events per stream entry")

    @field_validator("stream")
    @classmethod
    def _stream(cls, v: str) -> str:
        return check_stream_name(v)

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return None if v is None else check_schema(v)

    @model_validator(mode="after")
    def _marks(self) -> StageOutput:
        if (self.high_watermark is None) != (self.low_watermark is None):
            raise _FieldError("low_watermark", "set both watermarks of a stream, or neither")
        high, low = self.high_watermark, self.low_watermark
        if high is not None and low is not None and low >= high:
            raise _FieldError("low_watermark", "low_watermark must be below high_watermark")
        if self.schema_ is not None and self.time_field is not None:
            spec = self.schema_.get(self.time_field)
            if spec is None or FieldType.parse(spec).type not in ("long", "int"):
                raise _FieldError(
                    "time_field", f"{self.time_field!r} must be a long field of the schema"
                )
        return self


class StageConfig(_Model):
    """A stream-to-stream stage: reads `from`, applies `sql` to each micro-batch (the input is
    the view `input`; `tables` are static views for enrichment), writes stream `to`."""

    name: str
    from_: list[str] = Field(alias="from", min_length=1)
    sql: str = "SELECT * FROM input"
    tables: dict[str, str] = Field(
        default_factory=dict,
        description="static tables for joins: view name -> a .csv, .json, .jsonl or .parquet path",
    )
    to: StageOutput

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"stage name {v!r} must match {NAME_RE.pattern}")
        if v in RESERVED_STAGES:
            raise ValueError(f"stage name {v!r} is reserved ({', '.join(RESERVED_STAGES)})")
        return v

    @field_validator("from_", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("tables")
    @classmethod
    def _tables(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not NAME_RE.match(name) or name == "input":
                raise ValueError(f"table name {name!r} must match {NAME_RE.pattern}, not input")
            if not path.endswith(TABLE_FORMATS):
                raise ValueError(
                    f"table {name!r}: {path!r} must end with one of {', '.join(TABLE_FORMATS)}"
                )
        return v


def check_acyclic(stages: list[StageConfig], writers: dict[str, str]) -> None:
    by_name = {st.name: st for st in stages}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = " -> ".join([*path[path.index(name) :], name])
            raise _at("stages", f"the stages form a cycle: {cycle}")
        state[name] = 1
        for src in by_name[name].from_:
            if src in writers:
                visit(writers[src], [*path, name])
        state[name] = 2

    for st in stages:
        visit(st.name, [])
