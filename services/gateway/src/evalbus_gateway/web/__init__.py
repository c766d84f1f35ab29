"""The web dashboard: one page (`/`) and its assets, shipped in this package (no build step), plus
the login that exchanges a token for the session cookie.

The page is a projection like every other view: it reads the same `/v1` API (the session cookie
authenticates it) and follows the same event streams (`EventSource` on the batch and run streams),
so every gateway replica serves the same dashboard. Pages (hash routes): batches, a batch, a run
(live log, live trace, sealed trajectory, its screen, a terminal in its sandbox), two batches
compared, two runs side by side, online suites, an online suite.

The terminal is rendered by xterm.js, vendored unmodified under `assets/vendor/xterm/` (its README
says which version and how to refresh it). Its DOM renderer writes `<style>` elements, so the
page's Content-Security-Policy admits `<style>` elements that carry the nonce minted for that
response (and no other inline style); the page's script stamps the nonce on the ones it creates.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from importlib import resources

import msgspec
from aiohttp import web

from evalbus_api.models import ErrorBody, Me
from evalbus_gateway.api.auth import SESSION_COOKIE
from evalbus_gateway.api.errors import ApiError
from evalbus_gateway.api.table import Body, Call, Param, Route
from evalbus_gateway.api.validation import read_json

log = logging.getLogger("evalbus.gateway.web")

ASSETS = {
    "app.js": ("app.js", "text/javascript"),
    "app.css": ("app.css", "text/css"),
    "xterm.js": ("vendor/xterm/xterm.js", "text/javascript"),
    "xterm.css": ("vendor/xterm/xterm.css", "text/css"),
    "addon-fit.js": ("vendor/xterm/addon-fit.js", "text/javascript"),
}
"""The assets the page loads, by name: their file under `assets/` and their content type."""
NONCE_PLACEHOLDER = b"{{style-nonce}}"
"""Where `index.html` takes the response's style nonce."""
SESSION_MAX_AGE_S = 12 * 3600
"""How long a dashboard session lasts."""


class LoginRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The token to log in with (in the body, never the URL)."""

    token: str


def _asset(path: str) -> bytes:
    return (resources.files("evalbus_gateway.web") / "assets" / path).read_bytes()


def csp(nonce: str) -> str:
    """The page's policy: it loads nothing from elsewhere and runs no inline script; the only inline
    style it admits is a `<style>` element carrying this response's `nonce`."""
    return (
        "default-src 'self'; img-src 'self' data:; "
        f"style-src 'self' 'nonce-{nonce}'; style-src-attr 'none'; "
        "script-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    )


async def index(call: Call) -> web.StreamResponse:
    """GET /: the dashboard page, with a fresh style nonce."""
    nonce = secrets.token_urlsafe(18)
    return web.Response(
        body=_asset("index.html").replace(NONCE_PLACEHOLDER, nonce.encode()),
        content_type="text/html",
        charset="utf-8",
        headers={
            "Cache-Control": "no-store",
            "Content-Security-Policy": csp(nonce),
            "X-Content-Type-Options": "nosniff",
        },
    )


async def asset(call: Call) -> web.StreamResponse:
    """GET /ui/assets/{name}: revalidated on every load (`no-cache`) against its digest, so an
    unchanged asset (xterm.js is half a megabyte) is answered 304 without its body; compressed
    when the client accepts it."""
    name = call.request.match_info.get("name", "")
    found = ASSETS.get(name)
    if found is None:
        raise ApiError(404, "not_found", f"no asset {name!r}", "name")
    path, content_type = found
    body = _asset(path)
    etag = f'W/"{hashlib.sha256(body).hexdigest()[:32]}"'
    headers = {"Cache-Control": "no-cache", "ETag": etag, "X-Content-Type-Options": "nosniff"}
    if etag in (tag.strip() for tag in call.request.headers.get("If-None-Match", "").split(",")):
        return web.Response(status=304, headers=headers)
    response = web.Response(body=body, content_type=content_type, charset="utf-8", headers=headers)
    response.enable_compression()
    return response


async def login(call: Call) -> web.StreamResponse:
    """POST /ui/login: a valid token becomes an HttpOnly session cookie (signed and expiring; it
    does not hold the token)."""
    body = await read_json(call.request, LoginRequest, 16 * 1024)
    token = body.token.strip()
    principal = call.state.tokens.lookup(token)
    session = call.state.tokens.session_for(token, time.time(), SESSION_MAX_AGE_S)
    if principal is None or session is None:
        raise ApiError(401, "unauthorized", "unknown token", "$.token")
    response = web.Response(body=msgspec.json.encode(Me(principal=principal.name, role=principal.role)))
    response.content_type = "application/json"
    response.set_cookie(
        SESSION_COOKIE,
        session,
        max_age=SESSION_MAX_AGE_S,
        httponly=True,
        samesite="Strict",
        secure=call.request.secure,
        path="/",
    )
    log.info("dashboard login of %s", principal.name)
    return response


async def logout(call: Call) -> web.StreamResponse:
    """POST /ui/logout: forget the session cookie."""
    response = web.json_response({"logged_out": True})
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


ROUTES: tuple[Route, ...] = (
    Route(
        ("GET",),
        "/",
        "dashboard",
        "The web dashboard",
        "public",
        index,
        tag="dashboard",
        responses={200: Body("The page", content_type="text/html", schema={"type": "string"})},
    ),
    Route(
        ("GET",),
        "/ui/assets/{name}",
        "dashboardAsset",
        "A script or stylesheet of the dashboard",
        "public",
        asset,
        tag="dashboard",
        params=(
            Param(
                "name",
                "path",
                "The asset's name (`app.js`, `app.css`; xterm.js's `xterm.js`, `xterm.css`, `addon-fit.js`)",
                {"type": "string"},
                True,
            ),
        ),
        responses={
            200: Body("The asset (its `ETag` a digest of it)", content_type="text/plain", schema={"type": "string"}),
            304: Body("Unchanged: `If-None-Match` holds its `ETag`"),
        },
    ),
    Route(
        ("POST",),
        "/ui/login",
        "dashboardLogin",
        "Exchange a token for the dashboard's session cookie",
        "public",
        login,
        description="Sets `evalbus_session` (HttpOnly, SameSite=Strict, 12 h), which then authenticates the `/v1` "
        "API like the bearer token; writes made with it need `X-Evalbus-Csrf: 1`. 401 for an unknown token.",
        tag="dashboard",
        request=Body("The token", LoginRequest),
        responses={200: Body("Who logged in", Me), 401: Body("Unknown token (`error.field` = `$.token`)", ErrorBody)},
    ),
    Route(
        ("POST",),
        "/ui/logout",
        "dashboardLogout",
        "Forget the dashboard's session cookie",
        "public",
        logout,
        tag="dashboard",
        responses={200: Body("Logged out", schema={"type": "object"})},
    ),
)
"""The dashboard's routes, added to the gateway's table in `api.routes`."""
