"""Deterministic fault points, for crash tests only: SIGKILL this process at an exact step of the
delivery contract, so a test can prove what happens in the windows a random kill rarely hits.

The setting `FAULT_KILL` (`<SERVICE>_FAULT_KILL` first, like every setting) holds one or more
points separated by `;`, each `<point>:<consumer>:<event type>:<run id>`, every field but the
point a shell-style glob (`*` matches anything):

- `before_publish`: the handler returned its outputs; none is published yet.
- `before_ack`: the outputs are acknowledged by JetStream (or, for a handler that publishes
  nothing, its effects are done: the recorder's transaction committed), and the input is not
  acknowledged yet. The redelivery must then be absorbed by `Nats-Msg-Id` deduplication and the
  event store's first-write-wins — the window where a duplicate would be born.

For example `before_ack:judge-cases:*:evb-*-c05` kills the judge right after the PubAck of case
c05's `case.judged`, before it acks the `case.executed` it judged. A service logs a warning at
start when a fault point is armed; production deployments never set it.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import signal
from dataclasses import dataclass
from typing import Literal, get_args

log = logging.getLogger("evalbus.faults")

FaultPoint = Literal["before_publish", "before_ack"]
_POINTS: dict[str, FaultPoint] = {p: p for p in get_args(FaultPoint)}


class FaultSpecError(ValueError):
    """A `FAULT_KILL` value that cannot be read."""


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One armed fault point."""

    point: FaultPoint
    """Where in the delivery of a message it fires."""
    consumer: str
    """Glob on the consumer's durable name."""
    event_type: str
    """Glob on the input event's type."""
    run_id: str
    """Glob on the input event's run id (`-` matches an event without one)."""

    def matches(self, point: str, consumer: str, event_type: str, run_id: str | None) -> bool:
        """Whether this rule fires for a message at `point`."""
        return (
            point == self.point
            and fnmatch.fnmatchcase(consumer, self.consumer)
            and fnmatch.fnmatchcase(event_type, self.event_type)
            and fnmatch.fnmatchcase(run_id if run_id is not None else "-", self.run_id)
        )


def parse_faults(spec: str | None) -> tuple[FaultRule, ...]:
    """The rules of a `FAULT_KILL` value (empty when unset)."""
    rules: list[FaultRule] = []
    for part in filter(None, (p.strip() for p in (spec or "").split(";"))):
        fields = part.split(":")
        if len(fields) != 4 or not all(fields):
            raise FaultSpecError(f"fault point {part!r} must be <point>:<consumer>:<event type>:<run id>")
        point, consumer, event_type, run_id = fields
        known = _POINTS.get(point)
        if known is None:
            raise FaultSpecError(f"fault point {point!r} is not one of {', '.join(_POINTS)}")
        rules.append(FaultRule(point=known, consumer=consumer, event_type=event_type, run_id=run_id))
    return tuple(rules)


class Faults:
    """The armed rules of one process; `check` SIGKILLs the process when one matches."""

    def __init__(self, rules: tuple[FaultRule, ...] = ()) -> None:
        self._rules = rules

    @classmethod
    def from_setting(cls, spec: str | None) -> Faults:
        """Rules from a `FAULT_KILL` value."""
        return cls(parse_faults(spec))

    @property
    def armed(self) -> bool:
        """Whether any rule is set."""
        return bool(self._rules)

    def check(self, point: FaultPoint, consumer: str, event_type: str, run_id: str | None) -> None:
        """SIGKILL this process if a rule matches (no clean-up runs: that is the point)."""
        for rule in self._rules:
            if rule.matches(point, consumer, event_type, run_id):
                log.warning("fault point %s hit on %s (%s, %s): SIGKILL", point, consumer, event_type, run_id)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os.kill(os.getpid(), signal.SIGKILL)


NO_FAULTS = Faults()
"""No rule armed (the default everywhere)."""
