"""Online evaluation from inside an application: `Recorder.record()` offers production
observations, a background forwarder publishes them to `obs.received.<target>`, where the
collector samples them for every online suite (see `evalbus.online.recorder` and docs/online.md).

This package imports only the contracts and the NATS client, never a service package: it runs in
the application's process.
"""

from evalbus.online.ledger import DropReason, LostReason, Outcome, RecorderStats
from evalbus.online.recorder import Recorder

__all__ = ["DropReason", "LostReason", "Outcome", "Recorder", "RecorderStats"]
