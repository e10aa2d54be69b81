"""The `sluice` command's entry point.

Importing the command line takes about a second (pyarrow, pydantic, redis). A Ctrl-C in that
second would otherwise end the command with a traceback of whatever was being imported; here it
ends it as SIGINT ends a process, with one line and status 130, as a Ctrl-C does once the
commands run (`cli._Commands`, and each command's own handling).
"""

from __future__ import annotations

import signal
import sys


def main() -> None:
    try:
        from sluice.cli import main as commands
    except KeyboardInterrupt:
        sys.stderr.write("sluice: stopped by SIGINT\n")
        raise SystemExit(128 + signal.SIGINT) from None
    commands()


__all__ = ["main"]
