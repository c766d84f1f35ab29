"""A small Python client of the gateway's HTTP API (what the `evalbus` CLI uses).

    async with GatewayClient("http://127.0.0.1:8080", token) as gw:
        accepted = await gw.submit(spec)
        async for ev in gw.events(accepted.batch_id):
            print(ev.id, ev.event, ev.data)      # ends after the `end` event
        batch = await gw.get(accepted.batch_id)

Only aiohttp's client is used. Errors come back as `ApiRequestError` carrying the API's
`{code, message, field}`; the event stream reconnects with `Last-Event-ID` when the connection
drops before `end`, so no event is lost or repeated.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import Any, Literal, NamedTuple, TypeVar
from urllib.parse import quote

import aiohttp
import msgspec

from evalbus_api.actions import ExecBody, ExecView, ScreenView, TicketView
from evalbus_api.compare import BaselineRequest, BaselineView
from evalbus_api.live import LiveTraceView, LogTail, RunPlacement, RunStreamEnd
from evalbus_api.models import (
    IDEMPOTENCY_KEY_MAX,
    BatchAccepted,
    BatchPage,
    CancelAccepted,
    CasePage,
    DatasetUploaded,
    ErrorBody,
    Me,
    StreamEnd,
)
from evalbus_api.numbers import whole_number
from evalbus_api.online import (
    ObservationAnswer,
    OnlineStats,
    OnlineSuiteDetail,
    OnlineSuiteList,
    OnlineSuiteView,
    SuiteDeleted,
)
from evalbus_api.views import BatchView, RunView, Stage, Trajectory
from evalbus_contracts import BatchSpec, Event, JudgeSpec, OnlineSuiteSpec, decode, decode_event, encode
from evalbus_grading.compare import Comparison

T = TypeVar("T")

END_EVENT = "end"
"""The event that ends a batch's stream (its data holds the final status)."""

MIN_RETRY_S = 0.5
"""The shortest wait before asking again, whatever `Retry-After` says (0 from a proxy would spin)."""

TOO_MANY_STREAMS = 429
"""The answer to a stream the principal has no slot for: waited out (its `Retry-After`) and tried
again for up to the stream's idle timeout, since a slot frees as soon as the gateway notices a
closed stream (at its next heartbeat)."""


class ApiRequestError(Exception):
    """The gateway answered with an error (or not at all)."""

    def __init__(
        self, status: int, code: str, message: str, field: str | None = None, *, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        """The answer's `Retry-After`, in seconds, when it had one."""


class SseEvent(NamedTuple):
    """One server-sent event: `(id, event, data)`."""

    id: int | None
    """Stream sequence (None for `end`, which carries none)."""
    event: str
    """Event type (`case.executed`...), or `end`."""
    data: str
    """The data (event JSON)."""

    @property
    def is_end(self) -> bool:
        """The stream's last event: the batch finalized, or the run settled."""
        return self.event == END_EVENT

    def decoded(self) -> Event | StreamEnd | RunStreamEnd:
        """A batch stream's event as its contract event, and `end` as what it says (`StreamEnd` of
        a batch, `RunStreamEnd` of a run)."""
        raw = self.data.encode("utf-8")
        if self.is_end:
            return decode(raw, RunStreamEnd) if b'"run_id"' in raw else decode(raw, StreamEnd)
        return decode_event(raw)


class SseParser:
    """Incremental parser of a `text/event-stream` body (any chunking, any line length)."""

    def __init__(self) -> None:
        self._buffer = b""
        self._id: int | None = None
        self._event = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events completed by `chunk`."""
        self._buffer += chunk
        out: list[SseEvent] = []
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                return out
            line = self._buffer[:cut].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buffer = self._buffer[cut + 1 :]
            event = self._line(line)
            if event is not None:
                out.append(event)

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            if not self._data and not self._event:
                self._id = None  # a block of only an id is no event: its id is nobody's
                return None
            event = SseEvent(self._id, self._event or "message", "\n".join(self._data))
            self._id, self._event, self._data = None, "", []  # an id belongs to its own event only
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = whole_number(value)
        return None


class GatewayClient:
    """Calls the gateway's API with a bearer token."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: float = 30.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session (when the client opened it)."""
        if self._session is not None and self._own_session:
            await self._session.close()
        self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
            self._own_session = True
        return self._session

    async def _call(
        self,
        method: str,
        path: str,
        kind: type[T],
        *,
        body: Any = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> T:
        data = None if body is None else encode(body)
        all_headers = {**self._headers, **(headers or {})}
        if data is not None:
            all_headers["Content-Type"] = "application/json"
        try:
            async with self._http().request(
                method, self.base_url + path, data=data, params=params, headers=all_headers, timeout=self._timeout
            ) as resp:
                payload = await resp.read()
                if resp.status >= 400:
                    raise _error(resp.status, payload, resp.headers.get("Retry-After"))
        except aiohttp.ClientError as e:
            raise ApiRequestError(0, "unreachable", f"{method} {path}: {type(e).__name__}: {e}") from e
        return decode(payload, kind)

    # ------------------------------------------------------------ batches

    async def me(self) -> Me:
        """Who the token is."""
        return await self._call("GET", "/v1/me", Me)

    async def submit(self, spec: BatchSpec, *, idempotency_key: str | None = None) -> BatchAccepted:
        """Submit a batch (`batch.requested` is published)."""
        if idempotency_key is not None and not (
            0 < len(idempotency_key) <= IDEMPOTENCY_KEY_MAX and idempotency_key.isprintable()
        ):  # the gateway's own rule, checked here: an HTTP header cannot even carry some of these
            raise ApiRequestError(
                400,
                "invalid",
                f"Idempotency-Key must be 1 to {IDEMPOTENCY_KEY_MAX} printable characters (checked before sending)",
                "Idempotency-Key",
            )
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return await self._call("POST", "/v1/batches", BatchAccepted, body=spec, headers=headers)

    async def upload_dataset(self, blocks: AsyncIterable[bytes], *, read_timeout_s: float = 300.0) -> DatasetUploaded:
        """Upload a dataset (JSONL, one case per line) as it is produced, in one chunked request;
        the reference to name it by in `suite.dataset_ref`. Only the gaps between chunks are timed
        (a large upload takes as long as it takes)."""
        headers = {**self._headers, "Content-Type": "application/x-ndjson"}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout.total, sock_read=read_timeout_s)
        try:
            async with self._http().post(
                self.base_url + "/v1/datasets", data=blocks, headers=headers, timeout=timeout
            ) as resp:
                payload = await resp.read()
                if resp.status >= 400:
                    raise _error(resp.status, payload, resp.headers.get("Retry-After"))
        except aiohttp.ClientError as e:
            raise ApiRequestError(0, "unreachable", f"POST /v1/datasets: {type(e).__name__}: {e}") from e
        return decode(payload, DatasetUploaded)

    async def get(self, batch_id: str) -> BatchView:
        """A batch's status, counts, summary, export status and error."""
        return await self._call("GET", f"/v1/batches/{_quote(batch_id)}", BatchView)

    async def list_batches(self, *, limit: int | None = None, cursor: str | None = None) -> BatchPage:
        """A page of batches, newest first."""
        return await self._call("GET", "/v1/batches", BatchPage, params=_params(limit=limit, cursor=cursor))

    async def cases(
        self, batch_id: str, *, limit: int | None = None, cursor: str | None = None, stage: Stage | None = None
    ) -> CasePage:
        """A page of a batch's runs."""
        return await self._call(
            "GET",
            f"/v1/batches/{_quote(batch_id)}/cases",
            CasePage,
            params=_params(limit=limit, cursor=cursor, stage=stage),
        )

    async def all_cases(self, batch_id: str, *, stage: Stage | None = None, page_size: int = 500) -> list[RunView]:
        """Every run of a batch (following the cursor)."""
        runs: list[RunView] = []
        cursor: str | None = None
        while True:
            page = await self.cases(batch_id, limit=page_size, cursor=cursor, stage=stage)
            runs.extend(page.cases)
            if page.next_cursor is None:
                return runs
            cursor = page.next_cursor

    async def cancel(self, batch_id: str) -> CancelAccepted:
        """Cancel a batch (409 `conflict` when it is already finalized)."""
        return await self._call("POST", f"/v1/batches/{_quote(batch_id)}/cancel", CancelAccepted)

    async def rejudge(self, batch_id: str, judges: tuple[JudgeSpec, ...] | None = None) -> BatchAccepted:
        """Re-judge a finalized batch (with other judges when given): the new batch."""
        body: dict[str, Any] = {} if judges is None else {"judges": judges}
        return await self._call("POST", f"/v1/batches/{_quote(batch_id)}/rejudge", BatchAccepted, body=body)

    async def run(self, run_id: str) -> RunView:
        """One run."""
        return await self._call("GET", f"/v1/runs/{_quote(run_id)}", RunView)

    async def trajectory(self, run_id: str) -> Trajectory:
        """A run's recorded events and seal."""
        return await self._call("GET", f"/v1/runs/{_quote(run_id)}/trajectory", Trajectory)

    # ------------------------------------------------------------ events

    async def events(
        self,
        batch_id: str,
        *,
        last_event_id: int | None = None,
        reconnects: int = 10,
        idle_timeout_s: float = 60.0,
    ) -> AsyncIterator[SseEvent]:
        """The batch's events as `(id, event, data)`, ending after the `end` event. A dropped
        connection is resumed from the last id seen, up to `reconnects` times in a row."""
        async for event in self._follow(
            f"/v1/batches/{_quote(batch_id)}/events",
            f"event stream of {batch_id}",
            last_event_id=last_event_id,
            reconnects=reconnects,
            idle_timeout_s=idle_timeout_s,
        ):
            yield event

    # ------------------------------------------------------------ live runs

    async def logs(self, run_id: str) -> LogTail:
        """The end of a run's live log (last 64 KiB)."""
        return await self._call("GET", f"/v1/runs/{_quote(run_id)}/logs", LogTail)

    async def live_trace(self, run_id: str) -> LiveTraceView:
        """A run's own trace before it seals: infra marks and the harness's events."""
        return await self._call("GET", f"/v1/runs/{_quote(run_id)}/trajectory/live", LiveTraceView)

    async def placement(self, run_id: str) -> RunPlacement:
        """Where a run's sandbox is and why (queued, blocked, starting, running, dead)."""
        return await self._call("GET", f"/v1/runs/{_quote(run_id)}/placement", RunPlacement)

    async def exec(self, run_id: str, command: str, *, timeout_s: float = 30.0) -> ExecView:
        """Run one command in the run's live sandbox (`found` false when none holds it)."""
        body = ExecBody(command=command, timeout_s=timeout_s)
        return await self._call("POST", f"/v1/runs/{_quote(run_id)}/exec", ExecView, body=body)

    async def terminal_ticket(self, run_id: str) -> TicketView:
        """A single-use ticket for a terminal in the run's live sandbox (open `url` as a WebSocket)."""
        return await self._call("POST", f"/v1/runs/{_quote(run_id)}/terminal-ticket", TicketView)

    async def screen(self, run_id: str) -> ScreenView:
        """A frame of what the run's live browser shows (`supported` false when none is reachable)."""
        return await self._call("GET", f"/v1/runs/{_quote(run_id)}/screen", ScreenView)

    # ------------------------------------------------------------ comparing

    async def compare(self, candidate: str, base: str | None = None) -> Comparison:
        """The candidate batch against `base` (default: the candidate suite's baseline)."""
        return await self._call("GET", "/v1/compare", Comparison, params=_params(candidate=candidate, base=base))

    async def baseline(self, suite_id: str) -> BaselineView:
        """A suite's baseline (404 `not_found` when none is set)."""
        return await self._call("GET", f"/v1/suites/{_quote(suite_id)}/baseline", BaselineView)

    async def set_baseline(self, suite_id: str, batch_id: str) -> BaselineView:
        """Make `batch_id` the suite's baseline (409 for a batch that did not succeed)."""
        body = BaselineRequest(batch_id=batch_id)
        return await self._call("PUT", f"/v1/suites/{_quote(suite_id)}/baseline", BaselineView, body=body)

    # ------------------------------------------------------------ online evaluation

    async def apply_online_suite(self, suite: OnlineSuiteSpec) -> OnlineSuiteView:
        """Define (or replace) an online suite (admin)."""
        return await self._call("POST", "/v1/online/suites", OnlineSuiteView, body=suite)

    async def online_suites(self) -> OnlineSuiteList:
        """Every online suite."""
        return await self._call("GET", "/v1/online/suites", OnlineSuiteList)

    async def online_suite(self, suite_id: str) -> OnlineSuiteDetail:
        """One online suite with its rolling scores, fate counts and recent judged observations."""
        return await self._call("GET", f"/v1/online/suites/{_quote(suite_id)}", OnlineSuiteDetail)

    async def delete_online_suite(self, suite_id: str) -> SuiteDeleted:
        """Stop sampling for an online suite (admin)."""
        return await self._call("DELETE", f"/v1/online/suites/{_quote(suite_id)}", SuiteDeleted)

    async def online_stats(self, suite_id: str | None = None) -> OnlineStats:
        """Observations per suite, fate and reason."""
        params = {"suite": suite_id} if suite_id else None
        return await self._call("GET", "/v1/online/stats", OnlineStats, params=params)

    async def observation_fates(self, trace_id: str) -> ObservationAnswer:
        """Why a trace was (or was not) judged."""
        return await self._call("GET", f"/v1/online/observations/{_quote(trace_id)}", ObservationAnswer)

    async def follow_run(
        self,
        run_id: str,
        what: Literal["logs", "trajectory/live"] = "logs",
        *,
        last_event_id: int | None = None,
        reconnects: int = 10,
        idle_timeout_s: float = 60.0,
    ) -> AsyncGenerator[SseEvent, None]:
        """A run's live log (`logs`: `log` events of `LogChunk`) or live trace (`trajectory/live`:
        `trace` events of trace events) as it is written, ending after `end` (`RunStreamEnd`);
        resumed from the last id seen when the connection drops."""
        async for event in self._follow(
            f"/v1/runs/{_quote(run_id)}/{what}/stream",
            f"{what} stream of {run_id}",
            last_event_id=last_event_id,
            reconnects=reconnects,
            idle_timeout_s=idle_timeout_s,
        ):
            yield event

    async def _follow(
        self, path: str, what: str, *, last_event_id: int | None, reconnects: int, idle_timeout_s: float
    ) -> AsyncIterator[SseEvent]:
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=None, sock_read=idle_timeout_s)
        failures = 0
        loop = asyncio.get_running_loop()
        crowded_since: float | None = None
        while True:
            headers = {**self._headers, "Accept": "text/event-stream"}
            if last_event_id is not None:
                headers["Last-Event-ID"] = str(last_event_id)
            try:
                async with self._http().get(url, headers=headers, timeout=timeout) as resp:
                    if resp.status >= 400:
                        raise _error(resp.status, await resp.read(), resp.headers.get("Retry-After"))
                    crowded_since = None
                    parser = SseParser()
                    async for chunk in resp.content.iter_any():
                        for event in parser.feed(chunk):
                            failures = 0
                            if event.id is not None:
                                last_event_id = event.id
                            yield event
                            if event.event == END_EVENT:
                                return
            except ApiRequestError as e:
                if e.status == TOO_MANY_STREAMS and e.retry_after_s is not None:
                    # The principal's streams are all taken: wait as told, up to one idle timeout.
                    now = loop.time()
                    crowded_since = crowded_since if crowded_since is not None else now
                    if now - crowded_since + e.retry_after_s > idle_timeout_s:
                        raise
                    await asyncio.sleep(max(e.retry_after_s, MIN_RETRY_S))
                    continue
                if e.status < 500:
                    raise
                failures += 1
                if failures > reconnects:
                    raise
            except (aiohttp.ClientError, TimeoutError) as e:
                failures += 1
                if failures > reconnects:
                    raise ApiRequestError(0, "unreachable", f"{what}: {e}") from e
            else:
                failures += 1
                if failures > reconnects:
                    raise ApiRequestError(0, "stream_closed", f"{what} kept closing before its end")
            await asyncio.sleep(min(0.2 * 2**failures, 5.0))


def _quote(value: str) -> str:
    return quote(value, safe="")


def _params(**values: object) -> dict[str, str]:
    return {k: str(v) for k, v in values.items() if v is not None}


def _error(status: int, payload: bytes, retry_after: str | None = None) -> ApiRequestError:
    seconds = whole_number(retry_after) if retry_after is not None else None
    wait = float(seconds) if seconds is not None else None
    try:
        detail = msgspec.json.decode(payload, type=ErrorBody).error
    except msgspec.DecodeError:
        return ApiRequestError(
            status, "http_error", payload[:200].decode("utf-8", errors="replace"), retry_after_s=wait
        )
    return ApiRequestError(status, detail.code, detail.message, detail.field, retry_after_s=wait)
