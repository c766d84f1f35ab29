"""The route table: every HTTP route as data — method, path, access, parameters, bodies and
responses — from which the routes are installed and the OpenAPI document is generated, so the
two cannot drift apart."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

if TYPE_CHECKING:
    from evalbus_gateway.api.auth import Principal
    from evalbus_gateway.state import GatewayState

Access = Literal["public", "member", "admin"]
"""Who may call a route: anyone, any valid token, or an admin token."""
Location = Literal["path", "query", "header"]


@dataclass(frozen=True, slots=True)
class Call:
    """One request as a handler sees it."""

    request: web.Request
    """The aiohttp request."""
    state: GatewayState
    """The gateway's shared state."""
    principal: Principal | None
    """The authenticated principal (None on public routes)."""

    @property
    def user(self) -> Principal:
        """The principal of an authenticated route."""
        if self.principal is None:
            raise RuntimeError("route is public: no principal")
        return self.principal


Handler = Callable[[Call], Awaitable[web.StreamResponse]]
"""A route's logic."""


@dataclass(frozen=True, slots=True)
class Param:
    """A path, query or header parameter."""

    name: str
    location: Location
    description: str
    schema: dict[str, Any]
    required: bool = False


@dataclass(frozen=True, slots=True)
class Link:
    """An OpenAPI link from a response: how its values feed another operation (`batch_id` of a
    submitted batch → reading it), for clients and for the stateful fuzzing that follows them."""

    name: str
    """The link's name in the response."""
    operation_id: str
    """The operation it leads to."""
    parameters: dict[str, str] = field(default_factory=dict)
    """Target parameter → runtime expression (`$response.body#/batch_id`, `$request.path.batch_id`)."""
    request_body: Any = None
    """The target's body (or the part of it) the link fills, expressions inside (None: none)."""
    description: str = ""
    """What following it means."""


@dataclass(frozen=True, slots=True)
class Body:
    """A response (or request) body."""

    description: str
    type: Any = None
    """msgspec type of a JSON body; None for no JSON schema."""
    content_type: str = "application/json"
    schema: dict[str, Any] | None = None
    """An explicit schema when `type` is None."""
    links: tuple[Link, ...] = ()
    """OpenAPI links of a response: the operations its values lead to."""


@dataclass(frozen=True, slots=True)
class Route:
    """One route: what the installer adds to the router and what the OpenAPI document says."""

    methods: tuple[str, ...]
    """HTTP methods (the chassis' GET routes also answer HEAD)."""
    path: str
    """aiohttp path pattern (`/v1/batches/{batch_id}`), also the OpenAPI path."""
    operation_id: str
    """OpenAPI operation id."""
    summary: str
    """One line."""
    access: Access
    """Who may call it."""
    handler: Handler | None = None
    """Its logic; None for routes the chassis installs itself."""
    description: str = ""
    """Longer explanation."""
    tag: str = "batches"
    """OpenAPI tag."""
    params: tuple[Param, ...] = ()
    """Parameters."""
    request: Body | None = None
    """Request body."""
    request_required: bool = True
    """Whether the body is required."""
    responses: dict[int, Body] = field(default_factory=dict)
    """Success (and specific) responses by status; error responses are added from the shape."""

    @property
    def openapi_path(self) -> str:
        """`path` as OpenAPI writes it: without aiohttp's regex of a parameter (`{name:.+}` → `{name}`)."""
        return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", self.path)

    @property
    def is_event_stream(self) -> bool:
        """Whether it answers server-sent events (held open for the stream's life)."""
        ok = self.responses.get(200)
        return ok is not None and ok.content_type == "text/event-stream"
