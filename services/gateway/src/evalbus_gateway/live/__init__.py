"""Live views of a run, projected from the LIVE stream (and the CASES stream's word on whether the
run settled): its log tail, its trace before it seals, and their event streams. A process holds
only the shared subscriptions its open event streams follow (`live.fanout`), a cache of the
stream: every gateway replica answers the same, and a stream resumes on any of them. What they
answer (`LogTail`, `LiveTraceView`, `RunPlacement`…) is `evalbus_api.live`."""

from evalbus_gateway.live.views import Stored

__all__ = ["Stored"]
