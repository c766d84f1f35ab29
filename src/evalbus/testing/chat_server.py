"""An OpenAI-compatible chat-completions (and embeddings) server on 127.0.0.1 for tests of model judges: it checks
the request shape and bearer key, records every request with its arrival time, and answers from a
script (documented bodies, 429 + Retry-After, 5xx, garbage, hangs) or, while an `outage` reply is
set, with that reply to every request — a provider that is down for a while.

    server = ChatCompletionsServer(api_key="sk-…")
    base_url = await server.start()          # http://127.0.0.1:<port>/v1
    server.push(Reply(status=429, headers={"Retry-After": "1"}))
    server.outage = Reply(status=500, body=error_body("down", "server_error"))
    server.rate_limit = RateLimit(per_s=20)  # a provider's rate limit: 429 past 20 requests a second
    …
    await server.stop()

Used by the judge's own tests and by the cross-service outage tests (the judge service pointed at
it with `JUDGE_MODEL_BASE_URL`).
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from evalbus_runtime.secrets import env_name


@dataclass(frozen=True)
class Reply:
    """One scripted response."""

    status: int = 200
    body: Any = None
    raw: bytes | None = None
    """Bytes sent as is (non-JSON garbage); overrides `body`."""
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False
    """Never answer until the server stops: a request timeout for the client."""
    echo_auth: bool = False
    """Quote the received Authorization header in an error body, as some providers do."""


@dataclass(frozen=True)
class RateLimit:
    """A provider's request rate limit: at most `per_s` requests accepted in each wall-clock
    second (fixed windows), the others answered 429 with `Retry-After` (whole seconds) and
    `retry-after-ms` (until the next window), as OpenAI does; every answer carries
    `x-ratelimit-limit-requests` and `x-ratelimit-remaining-requests`. Requests take `latency_s`
    (a model's thinking time) before they are counted and answered."""

    per_s: int
    latency_s: float = 0.0


@dataclass(frozen=True)
class Recorded:
    """A request the server received."""

    path: str
    at_monotonic: float
    at_wall: float
    headers: dict[str, str]
    body: Any


def completion(content: str | None, *, refusal: str | None = None) -> dict[str, Any]:
    """A chat-completions response body in the documented shape."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if refusal is not None:
        message["refusal"] = refusal
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "judge-test-model",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


def verdict_reply(score: Any, passed: Any = None, reasoning: str = "looks right") -> Reply:
    """A 200 whose assistant content is a judge verdict JSON object."""
    content: dict[str, Any] = {"score": score, "reasoning": reasoning}
    if passed is not None:
        content["pass"] = passed
    return Reply(body=completion(msgspec.json.encode(content).decode()))


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class ChatCompletionsServer:
    """`POST …/chat/completions` on 127.0.0.1; `start()` returns the base URL `http://127.0.0.1:<port>/v1`."""

    def __init__(self, *, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.script: deque[Reply] = deque()
        self.default = verdict_reply(1.0, True)
        self.requests: list[Recorded] = []
        self.abandoned: list[int] = []
        """Indexes (into `requests`) of hanging requests whose client hung up."""
        self.protocol_errors: list[str] = []
        self.outage: Reply | None = None
        """While set, every request is answered with this reply (the script waits)."""
        self.statuses: Counter[int] = Counter()
        """HTTP status → responses sent with it (protocol errors and key refusals included)."""
        self.rate_limit: RateLimit | None = None
        """While set, requests past its rate are refused with 429 (before the script is read)."""
        self.answered: list[tuple[float, int]] = []
        """(monotonic time, status) of every answer under a rate limit."""
        self._window = (0, 0)  # (wall-clock second, requests accepted in it)
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    def push(self, *replies: Reply) -> None:
        """Queue replies for the next requests, in order; the default answers afterwards."""
        self.script.extend(replies)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/{prefix:.*}chat/completions", self._handle)
        app.router.add_post("/{prefix:.*}embeddings", self._embeddings)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        return f"{self.root}/v1"

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def _protocol_error(self, text: str) -> web.Response:
        self.protocol_errors.append(text)
        return web.json_response(error_body(text, "invalid_request_error"), status=400)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        response = await self._answer(request)
        self.statuses[response.status] += 1
        return response

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        """`POST …/embeddings`: each input's vector is its letter counts (a–z), so texts with the
        same letters are similar and others are not; usage counts one prompt token per word."""
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = None
        self.requests.append(Recorded(request.path, time.monotonic(), time.time(), dict(request.headers), body))
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            response = web.json_response(error_body("Incorrect API key provided.", "invalid_request_error"), status=401)
        elif self.outage is not None:
            response = web.json_response(self.outage.body, status=self.outage.status, headers=self.outage.headers)
        elif (
            not isinstance(body, dict)
            or not isinstance(body.get("model"), str)
            or not isinstance(body.get("input"), list)
            or not all(isinstance(x, str) for x in body["input"])
        ):
            response = self._protocol_error("body must be a JSON object with a model and a list of input strings")
        else:
            texts: list[str] = body["input"]
            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": [float(text.lower().count(c)) for c in "abcdefghijklmnopqrstuvwxyz"],
                }
                for i, text in enumerate(texts)
            ]
            tokens = sum(len(text.split()) for text in texts)
            response = web.json_response(
                {
                    "object": "list",
                    "data": data,
                    "model": body["model"],
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )
        self.statuses[response.status] += 1
        return response

    def _take(self, limit: RateLimit) -> tuple[web.Response | None, dict[str, str]]:
        """Count a request in its wall-clock second: a 429 past the limit, else the quota headers."""
        now = time.time()
        second = int(now)
        window, used = self._window
        if window != second:
            used = 0
        if used >= limit.per_s:
            self._window = (second, used)
            wait = second + 1 - now
            headers = {
                "Retry-After": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(max(1, round(wait * 1000))),
                "x-ratelimit-limit-requests": str(limit.per_s),
                "x-ratelimit-remaining-requests": "0",
            }
            body = error_body("Rate limit reached for requests", "requests", "rate_limit_exceeded")
            return web.json_response(body, status=429, headers=headers), {}
        self._window = (second, used + 1)
        return None, {
            "x-ratelimit-limit-requests": str(limit.per_s),
            "x-ratelimit-remaining-requests": str(limit.per_s - used - 1),
        }

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = None
        self.requests.append(Recorded(request.path, time.monotonic(), time.time(), dict(request.headers), body))
        if not request.headers.get("Content-Type", "").startswith("application/json"):
            return self._protocol_error("Content-Type must be application/json")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return self._protocol_error("body must be a JSON object with a model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return self._protocol_error("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                return self._protocol_error("every message needs a role")
            if not isinstance(m.get("content"), str):
                return self._protocol_error("every message needs string content")
        limit = self.rate_limit
        limit_headers: dict[str, str] = {}
        if limit is not None:
            if limit.latency_s > 0:
                await asyncio.sleep(limit.latency_s)  # the model's thinking time, as a provider takes it
            refused, limit_headers = self._take(limit)
            if refused is not None:
                self.answered.append((time.monotonic(), refused.status))
                return refused
        reply = self.outage or (self.script.popleft() if self.script else self.default)
        if limit is not None:
            self.answered.append((time.monotonic(), reply.status))
            reply = Reply(
                status=reply.status,
                body=reply.body,
                raw=reply.raw,
                headers={**reply.headers, **limit_headers},
                hang=reply.hang,
                echo_auth=reply.echo_auth,
            )
        auth = request.headers.get("Authorization")
        if reply.echo_auth:
            return web.json_response(
                error_body(f"Incorrect API key provided: {auth}", "invalid_request_error", "invalid_api_key"),
                status=reply.status,
            )
        if self.api_key is not None and auth != f"Bearer {self.api_key}":
            return web.json_response(
                error_body("Incorrect API key provided.", "invalid_request_error", "invalid_api_key"), status=401
            )
        if reply.hang:
            index = len(self.requests) - 1
            try:
                await self._release.wait()
            except asyncio.CancelledError:  # the client closed the connection (handler_cancellation)
                self.abandoned.append(index)
                raise
        if reply.raw is not None:
            return web.Response(status=reply.status, body=reply.raw, headers=reply.headers)
        return web.json_response(reply.body, status=reply.status, headers=reply.headers)


@asynccontextmanager
async def serving(*, api_key: str | None = None) -> AsyncIterator[ChatCompletionsServer]:
    """A started server (stopped on exit)."""
    server = ChatCompletionsServer(api_key=api_key)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def judge_env(server: ChatCompletionsServer, *, secret: str = "provider-key") -> dict[str, str]:  # noqa: S107 - a name
    """The judge service's settings that make `server` its default model endpoint, its API key in
    the secret named `secret`."""
    env = {"JUDGE_MODEL_BASE_URL": f"{server.root}/v1", "JUDGE_MODEL_API_KEY_SECRET": secret}
    if server.api_key is not None:
        env[env_name(secret)] = server.api_key
    return env
