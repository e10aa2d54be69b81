"""Redis's instructions per piece of work, counted by valgrind's callgrind: a count that is the
same from run to run whatever else the machine does, where CPU seconds on this shared machine
spread by ±20 %.

`wrapper` makes an executable that starts the embedded Redis's own binary under callgrind (point
`SLUICE_REDIS_SERVER` at it); `Counter` zeroes the counts before a piece of work and dumps them
after it. Needs valgrind (`apt-get install valgrind`).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path


def require() -> None:
    """Raise SystemExit with the install command when valgrind's tools are missing."""
    missing = [t for t in ("valgrind", "callgrind_control") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not found: install it with `apt-get install"
                         " valgrind`")  # fmt: skip


def wrapper(binary: str, into: Path) -> Path:
    """An executable that runs `binary` (a redis-server) under callgrind with collection on and
    its dumps named `into/callgrind.out[.N]`."""
    path = into / "redis-server-callgrind"
    out = into / "callgrind.out"
    path.write_text(
        "#!/bin/sh\n"
        f"exec valgrind --tool=callgrind --callgrind-out-file={shlex.quote(str(out))}"
        f' {shlex.quote(binary)} "$@"\n'
    )
    path.chmod(0o755)
    return path


# Where a script call's instructions go: (label, the Redis functions whose inclusive counts make
# it, added; then those subtracted). Function names are Redis 6.2's and 7.0's.
PARTS = (
    ("request parsing (the EVALSHA's arguments)", ("processMultibulkBuffer",), ()),
    ("ARGV and KEYS made Lua tables", ("luaSetGlobalArray",), ()),
    (
        "the script's own Lua (parsing, merging, formatting)",
        ("lua_pcall",),
        ("luaRedisGenericCommand",),
    ),
    (
        "`redis.call` itself (argument objects, command lookup, checks)",
        ("luaRedisGenericCommand",),
        (
            "hmgetCommand",
            "hsetCommand",
            "pexpireatCommand",
            "hkeysCommand",
            "hdelCommand",
            "propagate",
            "propagate.part.0",
            "redisProtocolToLuaType",
        ),
    ),
    ("replies made Lua values", ("redisProtocolToLuaType",), ()),
    ("HMGET", ("hmgetCommand",), ()),
    ("HSET", ("hsetCommand",), ()),
    ("PEXPIREAT", ("pexpireatCommand",), ()),
    ("HKEYS and HDEL (retention)", ("hkeysCommand", "hdelCommand"), ()),
    ("AOF: the commands' text (effects replication)", ("propagate", "propagate.part.0"), ()),
)


def inclusive(dump: Path) -> dict[str, int]:
    """Each function's inclusive instruction count in a callgrind dump."""
    command = ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)]
    out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        head, _, where = line.strip().partition(" ")
        if not head[:1].isdigit() or ":" not in where:
            continue
        name = where.rsplit(":", 1)[1].split(" ")[0]
        counts.setdefault(name, int(head.replace(",", "")))  # the first (outer) entry of a name
    return counts


def parts(dump: Path, total: int) -> dict[str, int]:
    """`PARTS` of a dump, and "the rest" (networking, the event loop, the AOF's writes)."""
    counts = inclusive(dump)
    out = {}
    for label, plus, minus in PARTS:
        out[label] = sum(counts.get(f, 0) for f in plus) - sum(counts.get(f, 0) for f in minus)
    out["the rest (event loop, sockets, AOF writes, cron)"] = total - sum(
        counts.get(f, 0) for f in ("processMultibulkBuffer", "evalGenericCommand")
    )
    return out


class Counter:
    """The instruction counts of the callgrind-run process `pid`, one dump per piece of work."""

    def __init__(self, pid: int, dumps: Path) -> None:
        self.pid, self.dumps = pid, dumps

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.pid)], check=True,
                       capture_output=True, timeout=120)  # fmt: skip

    def zero(self) -> None:
        """Start a piece of work: the counts so far are dropped."""
        self._control("-z")

    def dump(self) -> tuple[int, Path]:
        """End a piece of work: the instructions Redis ran since `zero`, and the dump."""
        before = set(self.dumps.glob("callgrind.out.*"))
        self._control("-d")
        new = sorted(set(self.dumps.glob("callgrind.out.*")) - before,
                     key=lambda p: p.stat().st_mtime)  # fmt: skip
        if not new:
            raise RuntimeError(f"callgrind wrote no dump for pid {self.pid} under {self.dumps}")
        for line in new[-1].read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1]), new[-1]
        raise RuntimeError(f"no instruction total in {new[-1]}")
