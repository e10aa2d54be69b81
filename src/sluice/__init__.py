"""Sluice: real-time per-entity metrics over any window length.

The public names are imported on first use, so that a process that needs one module (a Spark
Python worker reading the log, say) does not pay for the config models, the HTTP client and the
producer.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.config import Config, load_config
    from sluice.errors import SluiceError
    from sluice.query.client import Client
    from sluice.source.producer import Producer

__all__ = ["Client", "Config", "Producer", "SluiceError", "load_config"]
__version__ = "0.1.0"

_HOMES = {
    "Client": "sluice.query.client",
    "Config": "sluice.config",
    "Producer": "sluice.source.producer",
    "SluiceError": "sluice.errors",
    "load_config": "sluice.config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'sluice' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value
