"""evalbus package: `from evalbus import harness` is the Python harness SDK's decorator."""

from evalbus.harness.sdk import Answer, harness

__all__ = ["Answer", "harness"]
