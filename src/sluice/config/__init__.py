"""`sluice.yaml`: typed, validated configuration (DESIGN §3).

Two levels of checking:
- `load_config` checks everything that needs no engine: types, names, units, that every slice
  divides its retention, that key and value fields exist, that derived formulas name known
  metrics. A failure raises `ConfigError` naming the field path, e.g. `metrics[1].value`.
- Spark SQL snippets (`filter`, `value` expressions) are checked against the schema when the
  pipeline starts (`sluice.pipeline.plan.check_expressions`), because only Spark can parse them.

One module per section: `source`, `metrics` (and `derived`), `stages`, `runtime` (Spark,
backpressure, server, audit, lease); `load` holds the root `Config` and reads files.
"""

from sluice.config.base import FIELD_TYPES, NAME_RE, DurationMs, FieldType, SizeBytes
from sluice.config.load import Config, config_from_dict, load_config
from sluice.config.metrics import DerivedConfig, MetricConfig
from sluice.config.runtime import (
    AimdConfig,
    AuditConfig,
    BackpressureConfig,
    LeaseConfig,
    PidConfig,
    ServerConfig,
    SparkConfig,
    StoreWatermarks,
)
from sluice.config.source import KafkaConfig, SourceConfig
from sluice.config.stages import StageConfig, StageOutput

__all__ = [
    "FIELD_TYPES",
    "NAME_RE",
    "AimdConfig",
    "AuditConfig",
    "BackpressureConfig",
    "Config",
    "DerivedConfig",
    "DurationMs",
    "FieldType",
    "KafkaConfig",
    "LeaseConfig",
    "MetricConfig",
    "PidConfig",
    "ServerConfig",
    "SizeBytes",
    "SourceConfig",
    "SparkConfig",
    "StageConfig",
    "StageOutput",
    "StoreWatermarks",
    "config_from_dict",
    "load_config",
]
