"""The OpenAPI 3.1 document, generated from the route table and msgspec's JSON Schemas.

Error responses follow from a route's shape: 401 on authenticated routes, 403 on admin routes,
400 when it takes parameters or a body, 413 with a body, 404 with a path id, 503 and 500
everywhere on `/v1`. Every schema lives under `components.schemas`. A response's `links` say which
operations its values lead to (a submitted batch's id → reading it, its runs, cancelling it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from evalbus_api.models import ErrorBody
from evalbus_gateway.api.table import Body, Link, Route

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"


def _error(description: str) -> Body:
    return Body(description, ErrorBody)


def _responses(route: Route) -> dict[int, Body]:
    out = dict(route.responses)
    has_input = bool(route.params) or route.request is not None
    if has_input:
        out.setdefault(400, _error("Bad input; `error.field` names the offending field"))
    if route.access != "public":
        out.setdefault(401, _error("Missing or unknown bearer token (`error.field` = `Authorization`)"))
    if route.access == "admin":
        out.setdefault(403, _error("The token's role may not do this (`error.field` = `Authorization`)"))
    if any(p.location == "path" for p in route.params):
        out.setdefault(404, _error("Unknown (or not yours) — `error.field` names the path parameter"))
    if route.request is not None:
        out.setdefault(413, _error("Request body larger than the limit (`error.field` = `$`)"))
    if route.is_event_stream:
        out.setdefault(429, _error("The principal holds its most open event streams (`error.field` = `Authorization`)"))
    if route.path.startswith("/v1/"):
        out.setdefault(503, _error("Starting, or the database or the bus is unavailable; retry"))
        out.setdefault(500, _error("Unexpected error (logged; no details are returned)"))
    return dict(sorted(out.items()))


def _link(link: Link) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": link.operation_id}
    if link.parameters:
        out["parameters"] = dict(link.parameters)
    if link.request_body is not None:
        out["requestBody"] = link.request_body
    if link.description:
        out["description"] = link.description
    return out


def _body_types(routes: Iterable[Route]) -> list[Any]:
    types: list[Any] = [ErrorBody]
    for route in routes:
        bodies = [*route.responses.values(), *([route.request] if route.request else [])]
        types.extend(b.type for b in bodies if b.type is not None and b.type not in types)
    return types


def build_openapi(routes: Iterable[Route], *, title: str = "evalbus gateway", version: str = "1") -> dict[str, Any]:
    """The document describing exactly `routes`."""
    routes = list(routes)
    types = _body_types(routes)
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref_of = dict(zip(map(id, types), refs, strict=True))

    def content(body: Body) -> dict[str, Any]:
        schema = ref_of[id(body.type)] if body.type is not None else (body.schema or {})
        return {body.content_type: {"schema": schema}}

    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {
            "operationId": route.operation_id,
            "summary": route.summary,
            "tags": [route.tag],
            "responses": {
                str(status): {
                    "description": body.description,
                    **({"content": content(body)} if body.type or body.schema else {}),
                    **({"links": {link.name: _link(link) for link in body.links}} if body.links else {}),
                }
                for status, body in _responses(route).items()
            },
        }
        if route.description:
            operation["description"] = route.description
        if route.params:
            operation["parameters"] = [
                {
                    "name": p.name,
                    "in": p.location,
                    "required": p.required or p.location == "path",
                    "description": p.description,
                    "schema": p.schema,
                }
                for p in route.params
            ]
        if route.request is not None:
            operation["requestBody"] = {
                "required": route.request_required,
                "description": route.request.description,
                "content": content(route.request),
            }
        operation["security"] = [] if route.access == "public" else [{"bearer": []}]
        item = paths.setdefault(route.openapi_path, {})
        for method in route.methods:
            item[method.lower()] = (
                operation if method != "HEAD" else {**operation, "operationId": route.operation_id + "Head"}
            )
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": title,
            "version": version,
            "description": "Submit evaluation batches, follow them live, read their results. Bearer tokens: "
            "an admin sees every batch, a member only the batches it submitted.",
        },
        "jsonSchemaDialect": "https://spec.openapis.org/oas/3.1/dialect/base",
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
