"""evalbus package: `from evalbus import harness` is the Python harness SDK's decorator, and
`from evalbus import Client` the API client for scripts and notebooks (imported on first use, so
a harness does not load the HTTP client)."""

from typing import TYPE_CHECKING, Any

from evalbus.harness.sdk import Answer, harness

if TYPE_CHECKING:
    from evalbus.client import Client

__all__ = ["Answer", "Client", "harness"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from evalbus.client import Client

        return Client
    raise AttributeError(f"module 'evalbus' has no attribute {name!r}")
