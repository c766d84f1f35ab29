"""How a handler steers delivery: retry later (nak with a delay) or poison (term + dead letter)."""

from __future__ import annotations


class RuntimeFailure(Exception):
    """Root of the runtime's exceptions."""


class Retry(RuntimeFailure):
    """The message could be handled later: nak it with a delay (exponential when not given)."""

    def __init__(self, reason: str, delay_s: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.delay_s = delay_s


class Poison(RuntimeFailure):
    """The message can never be handled: terminate it and copy it to `dlq.<service>`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PublishFailedError(RuntimeFailure):
    """JetStream did not acknowledge a publish after the retries."""


class PayloadTooLargeError(RuntimeFailure):
    """An event is larger than the server's `max_payload`: publishing it again can never succeed,
    so the message that produced it is dead-lettered with this reason instead of retried."""
