"""What the command modules share (`sluice.cli`, `sluice.offline_cli`): the config option, the
config and its Redis opened with errors turned into one line, stop signals, a quiet Spark stop.

Every command that reads a config goes through `opened`: load the file, open its Redis (the
embedded one, started or joined, when `redis:` is not set), and turn any `SluiceError` into one
line on stderr and exit code 1.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import click

from sluice.config import Config, load_config
from sluice.errors import SluiceError
from sluice.pipeline import jvm_stderr
from sluice.redis.connection import RedisHandle, open_redis

log = logging.getLogger("sluice")


@contextlib.contextmanager
def opened(config_path: str, reads_only: bool = False) -> Iterator[tuple[Config, RedisHandle]]:
    """The config and its Redis, open until the block ends. A `SluiceError` raised opening
    them or inside the block becomes one line on stderr and exit code 1. A command that
    `reads_only` leaves a running server's persistence settings as they are (`durability:
    strict` is the writers' to set); an embedded server it starts runs as the config says."""
    try:
        cfg = load_config(config_path)
        ensure = not reads_only
        with open_redis(cfg.redis, cfg.state_dir, cfg.durability, ensure) as handle:
            yield cfg, handle
    except SluiceError as e:
        raise click.ClickException(str(e)) from None


class StopSignals:
    """SIGINT and SIGTERM, installed at once, ask `then` to stop (once); a second one does not
    interrupt the stop. `systemd`, Kubernetes, `timeout` and Ctrl-C signal the whole process
    group, Spark's JVM included, so what fails while stopping is expected: `quiet` silences the
    loggers that would report it.

    The handler itself only notes the signal and wakes a thread of its own, which does the rest:
    a handler runs in the main thread between two of its steps, possibly inside the handler of
    the signal before (`timeout` forwards a SIGTERM to the group, and the process gets it
    twice), and anything that takes a lock there can wait for itself forever."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.signum: int | None = None  # the first signal, set in the handler itself
        self._then: Callable[[], None] | None = None
        self._wake: queue.SimpleQueue[int] = queue.SimpleQueue()  # put() is reentrant
        threading.Thread(target=self._stop, name="sluice-stop-signals", daemon=True).start()
        self.install()

    @property
    def stopping(self) -> bool:
        """Whether a signal came: true from the handler on, before `requested` is set."""
        return self.signum is not None

    def install(self) -> None:
        """(Again:) PySpark's context puts a SIGINT handler of its own in place, which raises
        KeyboardInterrupt in whatever the main thread is doing."""
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def then(self, action: Callable[[], None]) -> None:
        self.install()
        self._then = action
        if self.requested.is_set():
            action()

    def _on_signal(self, signum: int, _: Any) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        jvm_stderr.stopping()
        self._wake.put(signum)

    def _stop(self) -> None:
        signum = self._wake.get()
        name = signal.Signals(signum).name
        log.info("stopping after the batch in flight", extra={"signal": name})
        self.quiet()
        self.requested.set()
        if self._then is not None:
            self._then()

    @staticmethod
    def quiet() -> None:
        ours, root = logging.getLogger("sluice"), logging.getLogger()
        if ours.level == logging.NOTSET:
            ours.setLevel(root.getEffectiveLevel())
        # py4j reports the JVM's going on the root logger itself: at INFO, and at ERROR with a
        # traceback for a call in flight when the JVM went (a signal to the process group).
        root.setLevel(max(root.level, logging.CRITICAL))
        for name in ("py4j", "pyspark"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        # PySpark's accumulator server prints a traceback when its JVM connection ends.
        from pyspark import accumulators

        for server in (accumulators.AccumulatorTCPServer, accumulators.AccumulatorUnixServer):
            server.handle_error = _ignore_request_error  # type: ignore[method-assign]


def _ignore_request_error(self: Any, request: Any, client_address: Any) -> None:
    """`socketserver`'s error report, for a server whose peer is known to be gone."""


@contextlib.contextmanager
def handlers_kept() -> Iterator[None]:
    """While Spark starts (around `build_spark`), the stop signals' handlers stay ours: PySpark's
    context puts its own SIGINT handler in place as it starts, one that cancels every job from
    inside whatever JVM call is in flight and raises KeyboardInterrupt there (a Ctrl-C then
    printed py4j's tracebacks and ended in `Aborted!`, or status 130)."""
    install = signal.signal

    def keep(signum: int, handler: Any) -> Any:
        if signum in (signal.SIGINT, signal.SIGTERM):
            return signal.getsignal(signum)
        return install(signum, handler)

    signal.signal = keep  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = install


def stop_spark(spark: Any) -> None:
    """Stop the session; its JVM may be gone already (a signal to the process group)."""
    try:
        spark.stop()
    except Exception as e:  # noqa: BLE001 - py4j raises all kinds once the JVM is gone
        log.debug("spark stop", extra={"error": str(e)})


config_option = click.option(
    "-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False),
    help="path to sluice.yaml",
)  # fmt: skip
