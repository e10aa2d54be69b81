"""An in-memory Arrow streaming source, for measuring Sluice's Spark plan without a log.

`spark.dataSource.register(ArrowFileSource)`, then `spark.readStream.format(ARROW_FORMAT)`: the
benchmarks' bare engine feeds the fold the same decoded columns as the Sluice source
(`sluice.source.decode.output_schema`), written once to an Arrow IPC file, with no log between.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

ARROW_FORMAT = "sluice-bench-arrow"


class ArrowFileSource(DataSource):
    """`spark.readStream.format("sluice-bench-arrow")`: every micro-batch re-reads one pre-built
    Arrow IPC file (memory-mapped), split into `partitions` partitions. Options: path, ddl (the
    schema), batches (micro-batches in all), partitions."""

    @classmethod
    def name(cls) -> str:
        return ARROW_FORMAT

    def schema(self) -> str:
        return str(self.options["ddl"])

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        o = self.options
        return ArrowFileReader(str(o["path"]), int(o["batches"]), int(o["partitions"]))


class ArrowFileReader(DataSourceStreamReader):
    def __init__(self, path: str, total_batches: int, n_partitions: int) -> None:
        self.path, self.total_batches, self.n_partitions = path, total_batches, n_partitions

    def initialOffset(self) -> dict[str, Any]:
        return {"batch": 0}

    def latestOffset(self, start: dict[str, Any], limit: Any) -> dict[str, Any]:
        return {"batch": min(int(start["batch"]) + 1, self.total_batches)}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        n = int(end["batch"]) - int(start["batch"])
        return [InputPartition((self.path, j, self.n_partitions))
                for _ in range(n) for j in range(self.n_partitions)]  # fmt: skip

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        import pyarrow.ipc as ipc  # on the executor

        path, j, n_parts = partition.value
        with pa.memory_map(path) as src:
            reader = ipc.open_file(src)
            for i in range(j, reader.num_record_batches, n_parts):
                yield reader.get_batch(i)
