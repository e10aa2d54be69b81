"""A real redis-server that stays in its start-up LOADING state for a chosen time.

`LoadingRedis` runs the binary the embedded Redis uses with an RDB file and no AOF. Give it data
through `client`, then `restart(load_s)`: it pads the dataset with 1 KiB filler keys, saves,
restarts with the hidden debug setting `key-load-delay` (µs per key loaded, Redis >= 6.0), and
returns once the server answers LOADING. Redis 6.2 serves clients while it loads only after each
2 MiB of the file (`loading_process_events_interval_bytes`, not configurable before 7.0), so
the filler keys are large and saved uncompressed: 8 of them, 200 ms of loading, make 2 MiB; a
round trip takes up to that long while it loads (a new redis-py connection makes three).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

import redis

from sluice.redis.embedded import _free_port, find_server_binary

FILLER_BYTES = 256 * 1024
KEY_DELAY_US = 25_000  # 40 filler keys (10 MiB) per second of loading


class LoadingRedis:
    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = redis.Redis(port=self.port, socket_timeout=10)
        self._start([])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _start(self, extra: list[str]) -> None:
        args = [find_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--dbfilename", "dump.rdb", "--appendonly", "no",
                "--save", "", "--rdbcompression", "no", *extra]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # listening (it may not answer yet: it loads)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def loading(self) -> bool:
        """Whether the server is still loading (INFO answers while it loads)."""
        return bool(self.client.info("persistence")["loading"])

    def restart(self, load_s: float) -> None:
        """Save, stop and start the server again so that it loads for about `load_s` seconds;
        returns once it answers LOADING (the filler keys are in the dataset from then on)."""
        n = int(load_s * 1_000_000 / KEY_DELAY_US)
        self.client.execute_command("DEBUG", "POPULATE", n, "filler", FILLER_BYTES)
        self.client.save()
        self._stop()
        self._start(["--key-load-delay", str(KEY_DELAY_US)])
        if not self.loading():
            raise RuntimeError("redis-server did not stay loading; is key-load-delay ignored?")

    def wait_loaded(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while self.loading():
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis still loading after {timeout_s}s")
            time.sleep(0.05)

    def close(self) -> None:
        self.client.close()
        self._stop()

    def __enter__(self) -> LoadingRedis:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
