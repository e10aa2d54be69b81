"""How the pipeline runs: Spark, backpressure and its controllers, the server, the audit."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AliasChoices, Field, model_validator

from sluice.config.base import DurationMs, SizeBytes, _FieldError, _Model

# Spark's switch for the partial aggregation before a shuffle (`spark.partial_aggregation`).
BYPASS_PARTIAL_AGGREGATION = "spark.sql.execution.bypassPartialAggregation"


class SparkConfig(_Model):
    master: str = "local[2]"
    trigger: DurationMs = 500
    shuffle_partitions: int = Field(2, ge=1)
    single_task_events: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="a batch of at most this many events is folded and written by one task,"
        " without a shuffle (less fixed cost per batch); 0 = never; auto = 32,000 exploded rows"
        " (one per event and metric group it touches): 16,000 events when each event touches"
        " two groups, fewer for a plan with more",
    )
    write_behind: Literal["auto", "on", "off"] = Field(
        "auto",
        description="a fold writes a batch from the driver while Spark folds the next one;"
        " auto = on a local master only (on a cluster the executors write)",
    )
    partial_aggregation: Literal["auto", "on", "off"] = Field(
        "auto",
        description="each task folds its own rows by (group, key, slice) before the fold's"
        " shuffle (Spark's partial aggregation); auto = off after a batch whose exploded rows"
        " folded into at least 0.3 cells per row (many keys, or times over many slices), on"
        " otherwise; needs Spark 4.3 or later, where earlier ones always fold partially",
    )
    conf: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _partial(self) -> SparkConfig:
        if BYPASS_PARTIAL_AGGREGATION in self.conf:
            raise _FieldError(
                "conf",
                f"`{BYPASS_PARTIAL_AGGREGATION}` is set per batch by the fold: use"
                " `spark.partial_aggregation` (auto, on or off) instead",
            )
        return self


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
    """Spark Streaming's PIDRateEstimator gains and floor. The D gain is `derivative`; its first
    name, `derived`, is still read (it read too much like the `derived:` metrics)."""

    proportional: float = Field(1.0, ge=0.0)
    integral: float = Field(0.2, ge=0.0)
    derivative: float = Field(0.0, ge=0.0, validation_alias=AliasChoices("derivative", "derived"))
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
    http: Literal["uvicorn", "granian"] = Field(
        "uvicorn",
        description="`sluice serve`'s HTTP server: uvicorn, or granian (HTTP in Rust);"
        " docs/benchmarks.md has them side by side",
    )
    log_answers: float = Field(
        0.01,
        ge=0.0,
        le=1.0,
        description="the share of keys whose answers the server logs to the stream"
        " `sluice:{consistency}:answers`, for `sluice consistency` to recompute offline; chosen"
        " per (metric, key) by hash, so the same keys are logged on every request; 0 = off",
    )
    log_answers_max: int = Field(
        10_000, ge=1, description="entries that stream keeps (about: it is trimmed by MAXLEN ~)"
    )


class AuditConfig(_Model):
    """The per-batch XOR completeness audit (see pipeline.audit)."""

    enabled: bool = True
    ledger_shards: int = Field(16, ge=1, le=1024, description="ledger keys, spread by slot")
    retries: int = Field(2, ge=0, le=10, description="in-place replays before the batch fails")


class LeaseConfig(_Model):
    """The leadership lease a `sluice run` process holds while it runs the queries; a second
    process on the same config stands by and takes over when the lease lapses (see
    docs/spark.md). A shorter ttl fails over faster, and a leader paused longer than it (a
    long GC, an overloaded host) loses its lease and stands by."""

    ttl: DurationMs = Field(
        2000, description="how long a lease lasts unless renewed (every quarter of it)"
    )

    @model_validator(mode="after")
    def _ttl(self) -> LeaseConfig:
        if self.ttl < 400:
            raise _FieldError("ttl", f"`ttl` must be at least 400ms, got {self.ttl}ms")
        return self
