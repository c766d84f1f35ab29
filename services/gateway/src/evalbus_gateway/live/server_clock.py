"""The NATS server's clock, for ages that must not depend on any two replicas' clocks agreeing: a
message's stored time (`RawStreamMsg.time`, set by the server) against the server's own time now,
read from the `ts` of a stream info answer (one request). Dispatcher freshness and terminal ticket
expiry are judged this way, so a replica whose clock is minutes off changes neither."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import msgspec
import nats.errors
from nats.js import JetStreamContext

log = logging.getLogger("evalbus.gateway.live")


async def stream_info_raw(
    js: JetStreamContext, stream: str, timeout_s: float, **request: object
) -> dict[str, object] | None:
    """The stream info answer as JSON (None when the stream does not exist or cannot be read); it
    carries the server's time as `ts`."""
    try:
        reply = await js._nc.request(f"$JS.API.STREAM.INFO.{stream}", msgspec.json.encode(request), timeout=timeout_s)
        info = msgspec.json.decode(reply.data)
    except (nats.errors.Error, msgspec.DecodeError) as e:
        log.warning("stream %s unreadable: %s", stream, e)
        return None
    if not isinstance(info, dict) or "error" in info:
        return None
    return info


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 time as nats-server writes it (nanoseconds, `Z`), or None."""
    if not isinstance(value, str):
        return None
    text = value.rstrip("Z")
    if "." in text:
        whole, frac = text.split(".", 1)
        text = f"{whole}.{frac[:6]}"
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC)
    except ValueError:
        return None


async def server_now(js: JetStreamContext, stream: str, timeout_s: float) -> datetime | None:
    """The server's time now (answered for `stream`, which must exist)."""
    info = await stream_info_raw(js, stream, timeout_s)
    return None if info is None else parse_time(info.get("ts"))
