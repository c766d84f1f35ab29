"""Actions on a live sandbox, as NATS request/reply between a gateway and the dispatcher replica that
holds the run (it subscribes to `ctl.<run>.*` while the run's sandbox lives, so the gateway never
needs to know which replica that is): a one-shot command (`exec`), an interactive terminal
(`terminal`, then frames on `term.<session>.in|out`), a screen capture (`screen`). Nobody answering
means no live sandbox holds the run.

Every payload is JSON (msgspec); byte fields travel base64-encoded.
"""

from __future__ import annotations

from typing import Literal

import msgspec

EXEC_TIMEOUT_MAX_S = 600.0
"""Longest a one-shot command may run."""
EXEC_OUTPUT_MAX_BYTES = 128 * 1024
"""Most of each stream (its end) a command's reply carries."""
TERMINAL_PING_S = 5.0
"""Seconds between the keep-alives each side of a terminal sends while it is quiet; a side that
hears nothing for three of them takes the other for gone."""


class _Control(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class ExecRequest(_Control, frozen=True, kw_only=True):
    """`ctl.<run>.exec`: run one command with `sh -c` in the sandbox (its workdir and environment)."""

    command: str
    """The command line."""
    timeout_s: float = 30.0
    """Killed (with its process group) after this long; exit 124."""
    principal: str | None = None
    """Who asked (named in the sandbox's trace)."""


class ExecReply(_Control, frozen=True, kw_only=True):
    """The command's outcome."""

    found: bool
    """False when the sandbox was released before the command could start."""
    stdout: str = ""
    """Its standard output (the end, when `truncated`), secrets masked."""
    stderr: str = ""
    """Its standard error (the end, when `truncated`), secrets masked."""
    exit_code: int | None = None
    """Exit code (124 on timeout, 128+n when killed by signal n)."""
    timed_out: bool = False
    """Killed on its timeout."""
    truncated: bool = False
    """The beginning of stdout or stderr was left out (each carries at most 128 KiB)."""
    ended: str | None = None
    """Why it ended early: the sandbox was released while it ran."""


class TerminalOpen(_Control, frozen=True, kw_only=True):
    """`ctl.<run>.terminal`: start a persistent shell on a pseudo-terminal in the sandbox and connect
    it to `term.<session>.in|out`."""

    session: str
    """Session id (random, minted by the gateway)."""
    cols: int = 80
    """Terminal width."""
    rows: int = 24
    """Terminal height."""
    principal: str | None = None
    """Who opened it (named in the sandbox's trace)."""


class TerminalOpened(_Control, frozen=True, kw_only=True):
    """The reply: the shell is attached (its input subscription is in place), or why not."""

    found: bool
    """False when no live sandbox could start it (released meanwhile)."""
    shell: str | None = None
    """The shell's program."""
    reason: str | None = None
    """Why not, when not found."""


class TermInput(_Control, frozen=True, kw_only=True, tag_field="type", tag="input"):
    """Keystrokes, gateway → dispatcher."""

    data: bytes
    """The bytes typed."""


class TermResize(_Control, frozen=True, kw_only=True, tag_field="type", tag="resize"):
    """A new terminal size, gateway → dispatcher."""

    cols: int
    rows: int


class TermClose(_Control, frozen=True, kw_only=True, tag_field="type", tag="close"):
    """The client left, gateway → dispatcher: the shell is ended."""

    reason: str = ""


class TermPing(_Control, frozen=True, kw_only=True, tag_field="type", tag="ping"):
    """A keep-alive, either way."""


class TermOutput(_Control, frozen=True, kw_only=True, tag_field="type", tag="output"):
    """What the terminal printed, dispatcher → gateway (secrets masked)."""

    data: bytes
    """The bytes."""


class TermClosed(_Control, frozen=True, kw_only=True, tag_field="type", tag="closed"):
    """The shell ended, dispatcher → gateway; the gateway closes the socket with `code` and `reason`."""

    reason: str
    """Why (the shell exited, the sandbox was released, the client went silent)."""
    code: int = 1000
    """WebSocket close code: 1000 the shell exited, 4410 the sandbox was released, 1011 an error."""
    exit_code: int | None = None
    """The shell's exit code, when it exited."""


TerminalIn = TermInput | TermResize | TermClose | TermPing
"""Frames on `term.<session>.in`."""
TerminalOut = TermOutput | TermClosed | TermPing
"""Frames on `term.<session>.out`."""

CLOSE_SHELL_EXITED = 1000
CLOSE_ERROR = 1011
CLOSE_NOT_FOUND = 4404
CLOSE_RELEASED = 4410


class ScreenRequest(_Control, frozen=True, kw_only=True):
    """`ctl.<run>.screen`: capture what the run's screen shows (its browser, else its X display)."""

    principal: str | None = None
    """Who asked."""


class ScreenReply(_Control, frozen=True, kw_only=True):
    """The capture: `supported` is whether a screen could be reached at all (the attempt itself)."""

    supported: bool
    """A screen was reachable: a declared CDP endpoint answered with a page, or the capture command
    ran in the sandbox against a declared X display."""
    found: bool
    """A frame was captured."""
    data_url: str | None = None
    """`data:image/png;base64,…` of the frame."""
    target: str | None = None
    """What was captured: the page's URL, or `display :99 (1280x1024)`."""
    reason: str | None = None
    """Why there is no frame."""


ScreenFormat = Literal["png", "jpeg"]
