"""`source:`: the log events come from (Redis Streams, or a Kafka topic) and their schema."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from sluice.config.base import (
    DurationMs,
    FieldType,
    SizeBytes,
    _FieldError,
    _Model,
    check_schema,
    check_stream_name,
)
from sluice.redis.keys import dead_letter_stream_key, shard_keys

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
        return shard_keys(self.stream, self.shards, bool(self.hash_tags))

    @property
    def dead_letter_stream(self) -> str:
        return dead_letter_stream_key(self.stream)
