"""The whole pipeline `sluice run` runs: one streaming query per fold and stage, supervised.

A config without `stages:` is one query, the source's fold, exactly as before stages existed.
With stages, every stream-to-stream stage and every stream folded by metrics is its own query in
the same Spark application (each with its own checkpoint, reader offsets, writer tokens and
batch records), and one supervisor restarts whichever fails.
"""

from __future__ import annotations

import re

from pyspark.sql import SparkSession

from sluice.clock import SYSTEM_CLOCK, Clock
from sluice.config import Config
from sluice.errors import ConfigError
from sluice.graph import Graph, fold_stage, graph_topology, store_stage
from sluice.pipeline.fold import FoldQuery
from sluice.pipeline.query import Role, StreamQuery
from sluice.pipeline.schemas import resolve_schemas
from sluice.pipeline.stage import StageQuery
from sluice.pipeline.supervisor import Supervisor
from sluice.redis.connection import RedisHandle


def build_queries(
    cfg: Config,
    redis: RedisHandle,
    spark: SparkSession,
    clock: Clock = SYSTEM_CLOCK,
    only: tuple[str, ...] = (),
) -> tuple[Graph, list[StreamQuery]]:
    """The graph, resolved against Spark, and its queries (stages first, then the folds),
    prepared; with `only`, just the queries named there (other applications run the rest).
    Raises ConfigError naming the field for anything Spark refuses."""
    graph = resolve_schemas(graph_topology(cfg), spark)
    names = [st.name for st in graph.stages] + [fold_stage(cfg, s) for s in graph.folds]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ConfigError(
            f"--stage: no query named {', '.join(unknown)}; this config has {', '.join(names)}"
        )
    queries: list[StreamQuery] = []
    for st in graph.stages:
        if only and st.name not in only:
            continue
        role = Role.of(graph, st.name, st.from_)
        queries.append(StageQuery(cfg, graph, st, role, redis, spark, clock))
    for stream in graph.folds:
        name = fold_stage(cfg, stream)
        if only and name not in only:
            continue
        role = Role.of(graph, name, [stream], store_stage(cfg, stream))
        queries.append(FoldQuery(graph.fold_config(stream), redis, spark, clock, role=role))
    for q in queries:
        try:
            q.prepare()
        except ConfigError as e:
            raise _config_path(cfg, graph, q, e) from None
    return graph, queries


def _config_path(cfg: Config, graph: Graph, q: StreamQuery, e: ConfigError) -> ConfigError:
    """A fold's config lists only its own metrics: name the metric as the user's file does."""
    m = re.match(r"metrics\[(\d+)\](.*)", e.path)
    if m is None or not isinstance(q, FoldQuery):
        return e
    metric = q.cfg.metrics[int(m.group(1))]
    i = cfg.metrics.index(metric)
    message = str(e).split(": ", 1)[1] if str(e).startswith("config error") else str(e)
    return ConfigError(message, f"metrics[{i}]{m.group(2)}")


class Pipeline:
    """The running graph. `prepare()` builds its queries (talks to Spark and Redis; raises
    ConfigError); `run_forever()` runs them until `request_stop()`, then every query stops."""

    def __init__(
        self,
        cfg: Config,
        redis: RedisHandle,
        spark: SparkSession,
        clock: Clock = SYSTEM_CLOCK,
        only: tuple[str, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.spark = spark
        self.clock = clock
        self.only = only
        self.graph: Graph | None = None
        self.queries: list[StreamQuery] = []
        self.supervisor: Supervisor | None = None
        self._stop_requested = False

    def prepare(self) -> None:
        if self.supervisor is None:
            self.graph, self.queries = build_queries(
                self.cfg, self.redis, self.spark, self.clock, self.only
            )
            self.supervisor = Supervisor(self.queries, self.redis.client, self.clock)
            if self._stop_requested:
                self.supervisor.request_stop()

    def run_forever(self) -> None:
        self.prepare()
        assert self.supervisor is not None
        self.supervisor.run_forever()

    def request_stop(self) -> None:
        self._stop_requested = True
        if self.supervisor is not None:
            self.supervisor.request_stop()
