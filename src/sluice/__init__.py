"""Sluice: real-time per-entity metrics over any window length."""

from sluice.config import Config, load_config
from sluice.errors import SluiceError
from sluice.query.client import Client
from sluice.source.producer import Producer

__all__ = ["Client", "Config", "Producer", "SluiceError", "load_config"]
__version__ = "0.1.0"
