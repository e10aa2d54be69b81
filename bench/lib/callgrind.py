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

    def dump(self) -> int:
        """End a piece of work: the instructions Redis ran since `zero`."""
        before = set(self.dumps.glob("callgrind.out.*"))
        self._control("-d")
        new = sorted(set(self.dumps.glob("callgrind.out.*")) - before,
                     key=lambda p: p.stat().st_mtime)  # fmt: skip
        if not new:
            raise RuntimeError(f"callgrind wrote no dump for pid {self.pid} under {self.dumps}")
        for line in new[-1].read_text(errors="replace").splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no instruction total in {new[-1]}")
