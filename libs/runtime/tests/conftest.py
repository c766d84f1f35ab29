"""Fixtures of the chassis tests."""

from evalbus.testing.bus import bus, workers

__all__ = ["bus", "workers"]
