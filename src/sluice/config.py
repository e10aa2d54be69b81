"""`sluice.yaml`: typed, validated configuration (DESIGN §3).

Two levels of checking:
- `load_config` checks everything that needs no engine: types, names, units, that every slice
  divides its retention, that key and value fields exist, that derived formulas name known
  metrics. A failure raises `ConfigError` naming the field path, e.g. `metrics[1].value`.
- Spark SQL snippets (`filter`, `value` expressions) are checked against the schema when the
  pipeline starts (`sluice.pipeline.plan.check_expressions`), because only Spark can parse them.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from sluice.errors import ConfigError
from sluice.slices.aggs import AGG_NAMES, AGGS
from sluice.units import parse_duration_ms, parse_size_bytes

DurationMs = Annotated[int, BeforeValidator(parse_duration_ms)]
SizeBytes = Annotated[int, BeforeValidator(parse_size_bytes)]

FIELD_TYPES = ("string", "long", "int", "double", "float", "boolean")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
KAFKA_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
# librdkafka settings Sluice sets itself on every client it makes.
KAFKA_OWNED_OPTIONS = (
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "enable.partition.eof",
    "isolation.level",
)
RESERVED_STAGES = ("ingest", "spark", "store", "input")
TABLE_FORMATS = (".csv", ".json", ".jsonl", ".parquet")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class FieldType(_Model):
    """One schema field: `long`, or `string?` for a field that may be missing."""

    type: str
    nullable: bool = False

    @classmethod
    def parse(cls, spec: str) -> FieldType:
        nullable = spec.endswith("?")
        base = spec[:-1] if nullable else spec
        if base not in FIELD_TYPES:
            raise ValueError(
                f"unknown field type {spec!r}; expected one of {', '.join(FIELD_TYPES)}"
                " (add '?' for a field that may be missing)"
            )
        return cls(type=base, nullable=nullable)


def check_stream_name(v: str) -> str:
    if not v or any(c in v for c in "{}\n ") or len(v) > 200:
        raise ValueError(f"stream name {v!r} must be non-empty, <=200 chars, no spaces or braces")
    return v


def check_schema(v: dict[str, str]) -> dict[str, str]:
    if not v:
        raise ValueError("schema must name at least one field")
    for name, spec in v.items():
        if not NAME_RE.match(name):
            raise ValueError(f"field name {name!r} must match {NAME_RE.pattern}")
        if name.startswith("_"):
            raise ValueError(f"field name {name!r} must not start with '_' (reserved)")
        FieldType.parse(str(spec))
    return {k: str(s) for k, s in v.items()}


class KafkaConfig(_Model):
    """`source.kafka`: read a Kafka topic instead of Redis Streams (see docs/kafka.md)."""

    bootstrap: str = Field(description="bootstrap servers, host:port[,host:port...]")
    topic: str
    group_id: str = Field(
        "sluice", description="processed offsets are committed to this group after each batch"
    )
    start: Literal["earliest", "latest"] = Field(
        "earliest", description="where a fresh checkpoint begins in each partition"
    )
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="librdkafka settings for every client, passed as they are (TLS, SASL, ...)",
    )
    producer_options: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="librdkafka settings for Sluice's producers only (linger.ms, acks, ...)",
    )

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap(cls, v: str) -> str:
        hosts = [h.strip() for h in v.split(",")]
        for h in hosts:
            host, sep, port = h.rpartition(":")
            if not host or not sep or not port.isdigit():
                raise ValueError(f"bootstrap server {h!r} must be host:port")
        return ",".join(hosts)

    @field_validator("topic")
    @classmethod
    def _topic(cls, v: str) -> str:
        if not KAFKA_TOPIC_RE.match(v) or v in (".", ".."):
            raise ValueError(
                f"topic {v!r} is not a Kafka topic name (1-249 of letters, digits, '.', '_', '-')"
            )
        return v

    @field_validator("group_id")
    @classmethod
    def _group(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("`group_id` must not be empty")
        return v

    @field_validator("options", "producer_options")
    @classmethod
    def _options(cls, v: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(k for k in v if k in KAFKA_OWNED_OPTIONS)
        if owned:
            raise ValueError(
                f"{', '.join(owned)} cannot be set here: Sluice sets it (bootstrap servers,"
                " group and offset handling come from the fields of `source.kafka`)"
            )
        return v


class SourceConfig(_Model):
    stream: str = "events"
    shards: int = Field(1, ge=1, le=1024)
    format: Literal["fields", "jsonl", "json"] = Field(
        "fields",
        description="Redis Streams: fields | jsonl; Kafka: json | jsonl (default json)",
    )
    kafka: KafkaConfig | None = Field(
        None, description="read this Kafka topic; its partitions are the shards"
    )
    schema_: dict[str, str] = Field(
        default_factory=lambda: {"ts": "long", "key": "string", "value": "double"},
        alias="schema",
    )
    time_field: str | None = "ts"
    max_events_per_batch: int | None = Field(
        1_000_000,
        ge=1,
        description="default admission limit per micro-batch (ReadMaxRows); null = no limit",
    )
    max_future: DurationMs = Field(3_600_000, description="events further ahead are dead-lettered")
    dead_letter_maxlen: int = Field(100_000, ge=100)
    max_string_bytes: int = Field(4096, ge=16, description="longer string values are rejected")
    max_entry_bytes: SizeBytes = Field(
        8_000_000, description="a larger stream entry is dead-lettered whole (`oversize_entry`)"
    )
    hash_tags: bool | None = Field(
        None,
        description="shard keys carry a hash tag that spreads them over Redis Cluster slots"
        " (`events:0:{5}`); unset: on when `redis:` is a cluster",
    )

    @field_validator("stream")
    @classmethod
    def _stream_name(cls, v: str) -> str:
        return check_stream_name(v)

    @field_validator("schema_")
    @classmethod
    def _schema(cls, v: dict[str, str]) -> dict[str, str]:
        return check_schema(v)

    @model_validator(mode="after")
    def _log_format(self) -> SourceConfig:
        if self.kafka is not None:
            if "format" not in self.model_fields_set:
                object.__setattr__(self, "format", "json")
            elif self.format == "fields":
                raise _FieldError(
                    "format",
                    "format `fields` is for Redis Streams; a Kafka record value is `json` (one"
                    " JSON object) or `jsonl` (newline-separated JSON objects)",
                )
            if "shards" in self.model_fields_set:
                raise _FieldError(
                    "shards", "`shards` does not apply to Kafka: the topic's partitions are them"
                )
        elif self.format == "json":
            raise _FieldError(
                "format",
                "format `json` is for Kafka records; a Redis stream entry is `fields` (one"
                " event, its fields) or `jsonl` (field `d`: newline-separated JSON objects)",
            )
        return self

    @model_validator(mode="after")
    def _time_field(self) -> SourceConfig:
        if self.time_field is not None:
            spec = self.schema_.get(self.time_field)
            if spec is None:
                raise _FieldError("time_field", f"{self.time_field!r} is not in the schema")
            if FieldType.parse(spec).type not in ("long", "int"):
                raise _FieldError(
                    "time_field",
                    f"time_field {self.time_field!r} must be a long (epoch ms), not {spec}",
                )
        return self

    def field_types(self) -> dict[str, FieldType]:
        out = {name: FieldType.parse(spec) for name, spec in self.schema_.items()}
        if self.time_field is not None:
            # A missing time field falls back to the entry id's time, so it may be absent.
            out[self.time_field] = FieldType(type=out[self.time_field].type, nullable=True)
        return out

    def shard_keys(self) -> list[str]:
        """Redis keys of the input streams, in shard order (see `redis.keys.shard_keys`)."""
        from sluice.redis.keys import shard_keys

        return shard_keys(self.stream, self.shards, bool(self.hash_tags))

    @property
    def dead_letter_stream(self) -> str:
        from sluice.redis.keys import dead_letter_stream_key

        return dead_letter_stream_key(self.stream)


class MetricConfig(_Model):
    name: str
    key: list[str] = Field(min_length=1)
    agg: str
    value: str | None = None
    filter: str | None = None
    q: float | list[float] | None = Field(
        None, description="quantile(s) for agg quantile, each strictly between 0 and 1"
    )
    slice: DurationMs = 60_000
    retention: DurationMs = 7 * 86_400_000
    resolutions: list[DurationMs] | None = Field(
        None,
        description="slice lengths kept side by side, finest first, e.g. [1s, 1m, 1h]: queries"
        " read the coarsest slices that fit inside the window and the finest at its edges",
    )
    from_: str | None = Field(
        None,
        alias="from",
        description="the stream this metric folds: a stage's output stream; null = the source",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"metric name {v!r} must match {NAME_RE.pattern}")
        return v

    @field_validator("agg")
    @classmethod
    def _agg(cls, v: str) -> str:
        if v not in AGGS:
            raise ValueError(f"unknown agg {v!r}; expected one of {', '.join(AGG_NAMES)}")
        return v

    @model_validator(mode="after")
    def _shape(self) -> MetricConfig:
        if AGGS[self.agg].needs_value and not self.value:
            raise _FieldError(
                "value", f"agg {self.agg!r} needs `value` (a field or a Spark SQL expression)"
            )
        if self.agg == "quantile":
            qs = self.quantiles()
            if not qs:
                raise _FieldError("q", "agg 'quantile' needs `q`, e.g. q: [0.5, 0.99]")
            for q in qs:
                if not 0.0 < q < 1.0:
                    raise _FieldError("q", f"quantile {q} must be strictly between 0 and 1")
        elif self.q is not None:
            raise _FieldError("q", f"`q` is only for agg 'quantile', not {self.agg!r}")
        if self.resolutions is not None:
            res = self.resolutions
            if not res:
                raise _FieldError("resolutions", "`resolutions` must list at least one duration")
            if "slice" in self.model_fields_set and self.slice != res[0]:
                raise _FieldError(
                    "slice", f"slice ({self.slice}ms) must be the finest resolution ({res[0]}ms)"
                )
            for finer, coarser in itertools.pairwise(res):
                if coarser <= finer or coarser % finer:
                    raise _FieldError(
                        "resolutions",
                        f"each resolution must be a multiple of the one before; {coarser}ms is"
                        f" not a multiple of {finer}ms",
                    )
            object.__setattr__(self, "slice", res[0])
        if self.slice < 1000:
            raise _FieldError("slice", f"slice {self.slice}ms is shorter than the 1s minimum")
        if self.retention < self.slice:
            raise _FieldError(
                "retention", f"retention {self.retention}ms is shorter than the slice"
            )
        for r in self.resolutions or []:
            if self.retention % r:
                raise _FieldError(
                    "retention",
                    f"resolution {r}ms does not divide retention ({self.retention}ms)",
                )
        if self.retention % self.slice != 0:
            raise _FieldError(
                "retention",
                f"slice ({self.slice}ms) does not divide retention ({self.retention}ms);"
                " choose a retention that is a whole number of slices",
            )
        if len(set(self.key)) != len(self.key):
            raise _FieldError("key", f"key fields {self.key} repeat a field")
        return self

    def slice_lengths(self) -> list[int]:
        """Every slice length this metric keeps, finest first."""
        return list(self.resolutions) if self.resolutions else [self.slice]

    def quantiles(self) -> list[float]:
        if self.q is None:
            return []
        return [float(self.q)] if isinstance(self.q, int | float) else [float(x) for x in self.q]


class DerivedConfig(_Model):
    name: str
    expr: str

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"derived metric name {v!r} must match {NAME_RE.pattern}")
        return v


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


class SparkConfig(_Model):
    master: str = "local[2]"
    trigger: DurationMs = 500
    shuffle_partitions: int = Field(2, ge=1)
    conf: dict[str, str] = Field(default_factory=dict)


class AimdConfig(_Model):
    """Seed 002's send window, in events per micro-batch; the batch round trip is the RTT."""

    target_rtt: DurationMs | None = Field(
        None, description="RTT at or under which the window grows; null = 2 x spark.trigger"
    )
    initial_window: int = Field(20_000, ge=1)
    increase: int = Field(5_000, ge=1, description="events added per NORMAL batch")
    decrease: int = Field(5_000, ge=1, description="events taken off per SLOW batch")
    busy_factor: float = Field(0.5, gt=0.0, lt=1.0, description="window cut on a failed batch")
    min_window: int = Field(1_000, ge=1)
    timeout: DurationMs = Field(30_000, description="a batch slower than this counts as BUSY")


class PidConfig(_Model):
    """Spark Streaming's PIDRateEstimator gains and floor."""

    proportional: float = Field(1.0, ge=0.0)
    integral: float = Field(0.2, ge=0.0)
    derived: float = Field(0.0, ge=0.0)
    min_rate: float = Field(100.0, gt=0.0)


class StoreWatermarks(_Model):
    """When the slice store counts as overloaded (either signal) and as quiet (both)."""

    latency_high: DurationMs = Field(1_000, description="p50 write time per batch partition")
    latency_low: DurationMs = 200
    memory_high: float = Field(0.9, gt=0.0, le=1.0, description="used_memory / maxmemory")
    memory_low: float = Field(0.7, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _marks(self) -> StoreWatermarks:
        if self.latency_low >= self.latency_high:
            raise _FieldError("latency_low", "`latency_low` must be below `latency_high`")
        if self.memory_low >= self.memory_high:
            raise _FieldError("memory_low", "`memory_low` must be below `memory_high`")
        return self


class BackpressureConfig(_Model):
    controller: Literal["stepwise", "aimd", "pid", "fixed", "none"] = "stepwise"
    high_watermark: SizeBytes = 50_000_000
    low_watermark: SizeBytes = 500_000
    sensitivity: DurationMs = 2000
    step: float = Field(0.5, gt=0.0, lt=1.0)
    tick: DurationMs = Field(
        250, description="how often a stage measures its queue and reads its signals"
    )
    min_rate: float = Field(100.0, gt=0.0, description="no controller throttles below this")
    propagation: Literal["hop", "source"] = Field(
        "hop",
        description="hop: an overloaded stage signals its direct upstreams (seed 000);"
        " source: it signals the ingest tasks, throttling the whole pipeline (Heron-style)",
    )
    fixed_rate: float | None = Field(
        None, gt=0.0, description="events/s for `fixed`; null = max_events_per_batch per trigger"
    )
    aimd: AimdConfig = Field(default_factory=AimdConfig)
    pid: PidConfig = Field(default_factory=PidConfig)
    store: StoreWatermarks = Field(default_factory=StoreWatermarks)

    @model_validator(mode="after")
    def _marks(self) -> BackpressureConfig:
        if self.low_watermark >= self.high_watermark:
            raise _FieldError(
                "low_watermark",
                f"low_watermark ({self.low_watermark} B) must be below"
                f" high_watermark ({self.high_watermark} B)",
            )
        if self.tick <= 0:
            raise _FieldError("tick", "`tick` must be positive")
        return self


class ServerConfig(_Model):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    token: str | None = None
    workers: int = Field(2, ge=1, le=64, description="`sluice serve` worker processes")


class AuditConfig(_Model):
    """The per-batch XOR completeness audit (see pipeline.audit)."""

    enabled: bool = True
    ledger_shards: int = Field(16, ge=1, le=1024, description="ledger keys, spread by slot")
    retries: int = Field(2, ge=0, le=10, description="in-place replays before the batch fails")


class Config(_Model):
    redis: str | None = None
    state_dir: Path = Path(".sluice")
    durability: Literal["default", "strict"] = Field(
        "default",
        description="strict: Redis fsyncs every write (appendfsync always) before acknowledging",
    )
    audit: AuditConfig = Field(default_factory=AuditConfig)
    source: SourceConfig = Field(default_factory=SourceConfig)
    metrics: list[MetricConfig] = Field(min_length=1)
    derived: list[DerivedConfig] = Field(default_factory=list)
    stages: list[StageConfig] = Field(default_factory=list)
    spark: SparkConfig = Field(default_factory=SparkConfig)
    backpressure: BackpressureConfig = Field(default_factory=BackpressureConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @field_validator("redis", mode="before")
    @classmethod
    def _redis_url(cls, v: Any) -> Any:
        """One URL, a `redis+cluster://` URL, or a list of cluster seeds (made into that URL)."""
        from sluice.redis.cluster import is_cluster_url, parse_cluster_url, seeds_to_url

        if isinstance(v, list):
            return seeds_to_url(v)
        if not isinstance(v, str):
            return v
        if is_cluster_url(v):
            parse_cluster_url(v)
        elif not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"redis URL {v!r} must start with redis://, rediss:// or unix://, or"
                " redis+cluster:// for a Redis Cluster (or be a list of cluster seed URLs)"
            )
        return v

    @property
    def redis_cluster(self) -> bool:
        from sluice.redis.cluster import is_cluster_url

        return is_cluster_url(self.redis)

    @model_validator(mode="after")
    def _shard_tags(self) -> Config:
        # `source.hash_tags` left unset follows `redis:`: tagged shard keys on a cluster only.
        if self.source.hash_tags is None:
            tagged = self.source.model_copy(update={"hash_tags": self.redis_cluster})
            object.__setattr__(self, "source", tagged)
        return self

    @model_validator(mode="after")
    def _graph(self) -> Config:
        """Stages: unique names and output streams, inputs that exist, no cycles."""
        writers: dict[str, str] = {}  # stream -> the stage that writes it
        names: set[str] = set()
        for i, st in enumerate(self.stages):
            if st.name in names:
                raise _at(f"stages[{i}].name", f"stage name {st.name!r} is used twice")
            names.add(st.name)
            out = st.to.stream
            if out == self.source.stream or out in writers:
                raise _at(f"stages[{i}].to.stream", f"stream {out!r} already has a writer")
            writers[out] = st.name
        for i, st in enumerate(self.stages):
            for j, src in enumerate(st.from_):
                if src != self.source.stream and src not in writers:
                    raise _at(
                        f"stages[{i}].from[{j}]",
                        f"stream {src!r} is neither the source ({self.source.stream!r}) nor"
                        " written by a stage",
                    )
                if writers.get(src) == st.name:
                    raise _at(f"stages[{i}].from[{j}]", "a stage cannot read its own output")
                if (
                    self.source.kafka is not None
                    and src == self.source.stream
                    and len(st.from_) > 1
                ):
                    raise _at(
                        f"stages[{i}].from[{j}]",
                        f"a stage that reads the Kafka source {src!r} reads it alone; read the"
                        " other streams in a stage of their own",
                    )
        _check_acyclic(self.stages, writers)
        for i, m in enumerate(self.metrics):
            if m.from_ is not None and m.from_ != self.source.stream and m.from_ not in writers:
                raise _at(
                    f"metrics[{i}].from",
                    f"stream {m.from_!r} is neither the source ({self.source.stream!r}) nor"
                    " written by a stage",
                )
        return self

    def stage_writing(self, stream: str) -> StageConfig | None:
        for st in self.stages:
            if st.to.stream == stream:
                return st
        return None

    def stream_schema(self, stream: str | None) -> dict[str, str] | None:
        """The declared schema of a stream (None: a stage output taken from its SQL)."""
        if stream is None or stream == self.source.stream:
            return self.source.schema_
        st = self.stage_writing(stream)
        return None if st is None else st.to.schema_

    @model_validator(mode="after")
    def _cross(self) -> Config:
        seen: set[str] = set()
        for i, m in enumerate(self.metrics):
            if m.name in seen:
                raise _at(f"metrics[{i}].name", f"metric name {m.name!r} is used twice")
            seen.add(m.name)
            fields = self.stream_schema(m.from_)
            if fields is None:
                continue  # checked at start-up, once the stage's SQL gives its schema
            where = "source.schema" if m.from_ in (None, self.source.stream) else m.from_
            for k in m.key:
                if k not in fields:
                    raise _at(
                        f"metrics[{i}].key",
                        f"key field {k!r} is not in {where} ({', '.join(fields)})",
                    )
        for i, d in enumerate(self.derived):
            if d.name in seen:
                raise _at(f"derived[{i}].name", f"name {d.name!r} is already a metric")
            seen.add(d.name)
            # Imported here: the formula module imports this one for the metric types.
            from sluice.query.formula import check_derived

            try:
                check_derived(d.expr, {m.name: m for m in self.metrics})
            except ValueError as e:
                raise _at(f"derived[{i}].expr", str(e)) from None
        return self

    def metric(self, name: str) -> MetricConfig | None:
        for m in self.metrics:
            if m.name == name:
                return m
        return None

    def derived_metric(self, name: str) -> DerivedConfig | None:
        for d in self.derived:
            if d.name == name:
                return d
        return None


def _check_acyclic(stages: list[StageConfig], writers: dict[str, str]) -> None:
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


class _FieldError(ValueError):
    """A cross-field check that failed; `field` names the field within the model that failed."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class _PathError(ValueError):
    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(message)


def _at(path: str, message: str) -> _PathError:
    return _PathError(path, message)


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            name = "schema" if part == "schema_" else str(part)
            out += f".{name}" if out else name
    return out


def config_from_dict(data: Any, base_dir: Path | None = None) -> Config:
    """Validate a parsed YAML document. `state_dir` is made relative to `base_dir` if given."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a mapping, got {type(data).__name__}")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _PathError):
            raise ConfigError(str(ctx_err), ctx_err.path) from None
        msg = str(ctx_err) if ctx_err is not None else err["msg"]
        loc = tuple(err["loc"])
        if isinstance(ctx_err, _FieldError):
            loc = (*loc, ctx_err.field)
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check its spelling against DESIGN §3"
        elif err["type"] == "missing":
            msg = "field required"
        path = _loc_to_path(loc)
        more = len(e.errors()) - 1
        if more:
            msg += f" (and {more} more error{'s' if more > 1 else ''})"
        raise ConfigError(msg, path) from None
    if base_dir is not None and not cfg.state_dir.is_absolute():
        cfg = cfg.model_copy(update={"state_dir": (base_dir / cfg.state_dir).resolve()})
    if base_dir is not None and cfg.stages:
        cfg = cfg.model_copy(update={"stages": [_rebase(st, base_dir) for st in cfg.stages]})
    return cfg


def _rebase(st: StageConfig, base_dir: Path) -> StageConfig:
    """Table paths relative to the config file's directory, like `state_dir`."""
    tables = {n: str((base_dir / p).resolve()) for n, p in st.tables.items()}
    return st.model_copy(update={"tables": tables})


def load_config(path: str | Path) -> Config:
    """Read and validate `sluice.yaml`. Raises ConfigError (never a bare YAML or pydantic error)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return config_from_dict(data, base_dir=p.resolve().parent)
