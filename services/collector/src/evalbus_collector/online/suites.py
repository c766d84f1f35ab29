"""The online suites a collector replica samples for: a projection of `online.suite.*` in CASES
(the last event per suite holds: applied → defined, deleted → gone), followed live."""

from __future__ import annotations

import logging

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from evalbus_contracts import DecodeError, OnlineSuiteApplied, OnlineSuiteDeleted, OnlineSuiteSpec, decode_event
from evalbus_contracts.streams import CASES
from evalbus_contracts.subjects import ONLINE_SUITE
from evalbus_runtime.follow import follow

log = logging.getLogger("evalbus.collector.suites")


class SuiteRegistry:
    """Online suites by id."""

    def __init__(self) -> None:
        self._suites: dict[str, OnlineSuiteSpec] = {}
        self._sub: Subscription | None = None

    @property
    def suites(self) -> tuple[OnlineSuiteSpec, ...]:
        """Every defined suite."""
        return tuple(self._suites.values())

    def apply(self, event: OnlineSuiteApplied | OnlineSuiteDeleted) -> None:
        """Fold one suite event in (the newest per suite wins)."""
        if isinstance(event, OnlineSuiteApplied):
            self._suites[event.suite.id] = event.suite
        else:
            self._suites.pop(event.suite_id, None)

    def _on_message(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except (DecodeError, ValueError) as e:
            log.warning("unreadable online suite event on %s ignored: %s", msg.subject, e)
            return
        if isinstance(event, OnlineSuiteApplied | OnlineSuiteDeleted):
            self.apply(event)

    async def start(self, js: JetStreamContext) -> None:
        """Read every suite stored, then follow changes."""
        self._sub = await follow(js, CASES.name, f"{ONLINE_SUITE}.>", self._on_message)

    async def stop(self) -> None:
        """Stop following."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
