"""Request and response bodies of the actions on a run's live sandbox (`POST /v1/runs/{run_id}/exec`,
`POST …/terminal-ticket`, `GET …/screen`)."""

from __future__ import annotations

from datetime import datetime

import msgspec


class ExecBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`POST /v1/runs/{run_id}/exec`."""

    command: str
    """A command line for `sh -c`, run in the sandbox's workdir and environment."""
    timeout_s: float = 30.0
    """Killed after this long (exit 124); at most 600."""


class ExecView(msgspec.Struct, frozen=True, kw_only=True):
    """The command's outcome."""

    run_id: str
    """The run."""
    found: bool
    """False when no live sandbox holds the run (not started, released, settled)."""
    stdout: str = ""
    """Its standard output (its end, when `truncated`), secrets masked."""
    stderr: str = ""
    """Its standard error (its end, when `truncated`), secrets masked."""
    exit_code: int | None = None
    """Exit code (124 on timeout, 128+n when killed by signal n); null when not found."""
    timed_out: bool = False
    """Killed on its timeout."""
    truncated: bool = False
    """The beginning of stdout or stderr was left out (each carries at most 128 KiB)."""
    ended: str | None = None
    """Why it ended early: the sandbox was released while it ran."""


class TicketView(msgspec.Struct, frozen=True, kw_only=True):
    """A terminal ticket: open `url` as a WebSocket within 30 s; it works once."""

    run_id: str
    """The run."""
    ticket: str
    """The ticket."""
    expires_at: datetime
    """When it stops working."""
    url: str
    """The WebSocket's path, ticket included."""


class ScreenView(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/runs/{run_id}/screen`."""

    run_id: str
    """The run."""
    supported: bool
    """Whether a screen could be reached (the capture attempt itself, never a guess from the case)."""
    found: bool
    """Whether a frame was captured."""
    data_url: str | None = None
    """The frame as `data:image/png;base64,…`."""
    target: str | None = None
    """What was captured: the page's URL, or `display :99 (1280x1024)` (a desktop case)."""
    reason: str | None = None
    """Why there is no frame."""
