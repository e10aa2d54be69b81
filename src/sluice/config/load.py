"""The root model, `Config`, with its checks across sections, and how a file becomes one."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from sluice.config.base import _at, _FieldError, _Model, _PathError
from sluice.config.metrics import DerivedConfig, MetricConfig
from sluice.config.runtime import (
    AuditConfig,
    BackpressureConfig,
    LeaseConfig,
    ServerConfig,
    SparkConfig,
)
from sluice.config.source import SourceConfig
from sluice.config.stages import StageConfig, check_acyclic
from sluice.errors import ConfigError
from sluice.formula import check_derived, names, parse
from sluice.redis.cluster import is_cluster_url, parse_cluster_url, seeds_to_url
from sluice.units import format_duration_ms


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
    lease: LeaseConfig = Field(default_factory=LeaseConfig)

    @field_validator("redis", mode="before")
    @classmethod
    def _redis_url(cls, v: Any) -> Any:
        """One URL, a `redis+cluster://` URL, or a list of cluster seeds (made into that URL)."""
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
        check_acyclic(self.stages, writers)
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
            try:
                check_derived(d.expr, {m.name: m for m in self.metrics})
            except ValueError as e:
                raise _at(f"derived[{i}].expr", _derived_problem(d.expr, e, self.derived)) from None
            _warn_mixed_slices(d, [m for m in self.metrics if m.name in names(parse(d.expr))])
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

    def stored_inputs(self, name: str) -> list[str]:
        """The stored metrics that metric `name` is answered from: itself, or a derived
        metric's inputs (in first-use order)."""
        d = self.derived_metric(name)
        return [name] if d is None else names(parse(d.expr))


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


def _derived_problem(expr: str, e: ValueError, derived: list[DerivedConfig]) -> str:
    """What is wrong with a derived formula: `e`'s message, or, where it reads another
    derived metric, that (its name is no stored metric, but not unknown)."""
    try:
        others = sorted(set(names(parse(expr))) & {x.name for x in derived})
    except ValueError:
        return str(e)
    if others:
        return (f"{others[0]!r} is a derived metric: a formula reads stored metrics only;"
                " write its formula out in this one")  # fmt: skip
    return str(e)


def load_config(path: str | Path) -> Config:
    """Read and validate `sluice.yaml`. Raises ConfigError (never a bare YAML or pydantic error)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark is let go
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{p}: not UTF-8 text (byte {e.start} is {e.object[e.start : e.start + 1]!r});"
            " save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a safe loader (see below)
    except yaml.MarkedYAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {_yaml_problem(e)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return config_from_dict(data, base_dir=p.resolve().parent)


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (the last would win,
    silently: a second `metrics:` would drop every metric of the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<:`: the keys it merges in may be given here again (overridden)
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):
                continue  # unhashable: the base constructor says so
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.MarkedYAMLError) -> str:
    """One line: where (line and column, from 1) and what, without PyYAML's excerpt."""
    mark = e.problem_mark or e.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = e.problem or "cannot be parsed"
    if e.context:
        what += f" ({e.context})"
    return where + " ".join(what.split())


_warned: set[tuple[str, str]] = set()


def _warn_mixed_slices(d: DerivedConfig, inputs: list[MetricConfig]) -> None:
    """Warn (once per process) about a derived metric whose inputs have different finest
    slices: each input is taken over its own cover, so the window's start edge of one may lie up
    to a slice of the other before it, and the value mixes two intervals (docs/metrics.md)."""
    finest = {m.name: m.slice_lengths()[0] for m in inputs}
    if len(set(finest.values())) < 2 or (d.name, d.expr) in _warned:
        return
    _warned.add((d.name, d.expr))
    logging.getLogger("sluice.config").warning(
        "a derived metric's inputs have different slices: each is taken over its own cover,"
        " so their windows' start edges differ; give them one slice length for one interval",
        extra={"derived": d.name, "slices": ",".join(f"{k}={format_duration_ms(v)}"
                                                      for k, v in finest.items())},
    )  # fmt: skip
