"""Backends: where a case's sandbox runs (local processes today; docker, nomad, kubernetes later)."""

from evalbus_dispatcher.backends.base import Backend, Capacity, HarnessRun, OnOutput, OutputStream, SandboxHandle

__all__ = ["Backend", "Capacity", "HarnessRun", "OnOutput", "OutputStream", "SandboxHandle"]
