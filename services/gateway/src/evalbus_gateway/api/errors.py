"""Errors as JSON: `{"error": {"code", "message", "field"}}` for every 4xx and 5xx.

Handlers raise `ApiError`; the middleware turns it (and aiohttp's own 404/405/413) into the JSON
body, and any unexpected exception into a 500 without the traceback (which is logged). msgspec's
validation messages carry the JSON path of the bad value (`... - at $.suite.cases[0]`); `field_of`
turns them into the offending field, including the name of a missing or unknown one.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping

import asyncpg
import msgspec
import nats.errors
from aiohttp import web
from aiohttp.typedefs import Handler

from evalbus_api.models import ErrorBody, ErrorDetail
from evalbus_contracts import encode
from evalbus_gateway.errors import NotReadyError
from evalbus_gateway.store import StoreError
from evalbus_runtime import PublishFailedError

log = logging.getLogger("evalbus.gateway.api")

_AT = re.compile(r"^(?P<message>.*?) - at `(?P<path>[^`]*)`$", re.DOTALL)
_NAMED = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<name>[^`]+)`")


class ApiError(Exception):
    """An HTTP error with a JSON body naming the offending field."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = dict(headers or {})

    def response(self) -> web.Response:
        """The JSON response."""
        return error_response(self.status, self.code, self.message, self.field, headers=self.headers)


def error_response(
    status: int, code: str, message: str, field: str | None = None, *, headers: Mapping[str, str] | None = None
) -> web.Response:
    """A JSON error response."""
    body = ErrorBody(error=ErrorDetail(code=code, message=message, field=field))
    return web.Response(status=status, body=encode(body), content_type="application/json", headers=headers)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if name.isidentifier() else f'{path}["{name}"]'


def field_of(error: msgspec.ValidationError, root: str = "$") -> tuple[str, str]:
    """(field, message) of a msgspec validation error: the JSON path of the bad value, extended
    with the field name when a required field is missing or an unknown one is present."""
    text = str(error)
    match = _AT.match(text)
    message, path = (match["message"], match["path"]) if match else (text, "$")
    if root != "$":
        path = root + path[1:]
    named = _NAMED.match(message)
    if named is not None:
        path = _join(path, named["name"])
    return path, message


def invalid(error: msgspec.ValidationError, root: str = "$") -> ApiError:
    """A 400 for a body (or part of one) that is JSON but not the expected shape."""
    field, message = field_of(error, root)
    return ApiError(400, "invalid", message, field)


def not_found(what: str, field: str, value: str) -> ApiError:
    """A 404 naming the path parameter."""
    return ApiError(404, "not_found", f"no {what} {value!r}", field)


def _from_http(exc: web.HTTPException, request: web.Request) -> web.Response:
    status = exc.status
    headers = {k: v for k, v in exc.headers.items() if k.lower() in {"allow", "www-authenticate", "retry-after"}}
    if status == 404:
        return error_response(404, "not_found", f"no route {request.method} {request.path}", "path", headers=headers)
    if status == 405:
        return error_response(
            405, "method_not_allowed", f"{request.method} is not allowed on {request.path}", "method", headers=headers
        )
    if status == 413:
        return error_response(413, "payload_too_large", "request body too large", "$", headers=headers)
    code = exc.reason.lower().replace(" ", "_") if exc.reason else "error"
    return error_response(status, code, exc.text or exc.reason or "error", None, headers=headers)


def database_unavailable(e: BaseException) -> bool:
    """Whether PostgreSQL is away rather than the request wrong: shutting down or restarting,
    sessions terminated, out of connections, or a database not accepting connections (which
    PostgreSQL reports as a plain "object not in prerequisite state" at connect). A pooled
    connection whose session was terminated under it fails with asyncpg's `InternalClientError`
    ("cannot switch to state …"): the same outage, seen from the client."""
    if isinstance(
        e,
        asyncpg.exceptions.OperatorInterventionError
        | asyncpg.exceptions.InsufficientResourcesError
        | asyncpg.exceptions.InternalClientError,
    ):
        return True
    return isinstance(e, asyncpg.exceptions.ObjectNotInPrerequisiteStateError) and "accepting connections" in str(e)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as the JSON error body; never a stack trace."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _from_http(e, request)
    except asyncio.CancelledError:
        raise
    except NotReadyError as e:
        return error_response(503, "unavailable", str(e), None, headers={"Retry-After": "1"})
    except PublishFailedError as e:
        log.warning("%s %s: publish failed: %s", request.method, request.path, e)
        return error_response(503, "bus_unavailable", "the event bus did not accept the event; retry", None)
    except (StoreError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError, nats.errors.Error, OSError) as e:
        log.warning("%s %s: %s: %s", request.method, request.path, type(e).__name__, e)
        return error_response(503, "unavailable", "a backing service is unavailable; retry", None)
    except Exception as e:
        if database_unavailable(e):
            log.warning("%s %s: the database is unavailable: %s: %s", request.method, request.path, type(e).__name__, e)
            return error_response(
                503, "unavailable", "the event store is unavailable; retry", None, headers={"Retry-After": "1"}
            )
        log.exception("unexpected error in %s %s", request.method, request.path)
        return error_response(500, "internal", "internal error", None)
