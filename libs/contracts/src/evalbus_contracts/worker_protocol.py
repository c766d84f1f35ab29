"""The worker protocol: how the dispatcher hands cases to a warm worker harness (`harness.kind:
worker`) and reads back what each case did. JSON lines: one JSON object per line, `type` first.

The worker says `ready` once on stdout when it can take cases. The dispatcher then writes one
`case` at a time on the worker's stdin and waits; the worker answers with any number of `event`,
`log`, `cdp` and `display` lines for that case, then exactly one `result`. Every line a worker
writes about a case carries that case's `run_id`. The worker's stderr is free text, attributed to the case it is
serving. End of stdin means: finish and exit. Anything else on stdout — a line that is not one of
these objects, a line for another run, a second `ready` — breaks the protocol: the worker is killed
and its case fails (`worker_protocol`).

Pure data (no I/O): the dispatcher's pool and the Python SDK (`evalbus.harness`) share it.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1
"""The version a worker announces in `ready`."""


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    pass


class Ready(_Message, frozen=True, kw_only=True, tag="ready"):
    """Worker → dispatcher, once: the worker has loaded and takes cases."""

    protocol: int = PROTOCOL_VERSION
    """The protocol version it speaks."""


class CaseMessage(_Message, frozen=True, kw_only=True, tag="case"):
    """Dispatcher → worker: run one case."""

    run_id: str
    """The run id (`EVALBUS_RUN_ID`): every line about this case carries it."""
    case_id: str
    """The case id."""
    batch_id: str | None = None
    """The batch, for batch runs."""
    trial: int = 1
    """The trial, from 1."""
    attempt: int = 1
    """The attempt, from 1."""
    input: str
    """The case input (JSON text when the suite gave a mapping or a list)."""
    workdir: str
    """The case's own fresh workdir: the worker runs the case there (its current directory)."""
    input_file: str
    """A file holding the input (`EVALBUS_INPUT_FILE`)."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """The case's own environment variables (`EVALBUS_RUN_ID`, `EVALBUS_CASE_ID`, ...), set for the
    case's duration."""
    timeout_s: float
    """Seconds the case may take before the worker is killed."""


class EventMessage(_Message, frozen=True, kw_only=True, tag="event"):
    """Worker → dispatcher: one trace event of the case (a trace event object, as in an
    `EVALBUS_EVENT` line; `t` is seconds since the case was handed over)."""

    run_id: str
    """The case's run id."""
    event: msgspec.Raw
    """The trace event (decoded by the dispatcher as a command harness's event line)."""


class LogMessage(_Message, frozen=True, kw_only=True, tag="log"):
    """Worker → dispatcher: text the case printed (its live log and log tail)."""

    run_id: str
    """The case's run id."""
    stream: Literal["stdout", "stderr"] = "stdout"
    """Which stream the text belongs to."""
    text: str
    """The text, one or more lines."""


class CdpMessage(_Message, frozen=True, kw_only=True, tag="cdp"):
    """Worker → dispatcher: the DevTools endpoint of the browser the case drives (live screen)."""

    run_id: str
    """The case's run id."""
    url: str
    """`http://host:port`."""


class DisplayMessage(_Message, frozen=True, kw_only=True, tag="display"):
    """Worker → dispatcher: the X display the case works on (live screen of a desktop case)."""

    run_id: str
    """The case's run id."""
    display: str
    """The display name, `:99` (as `DISPLAY`)."""


class ResultMessage(_Message, frozen=True, kw_only=True, tag="result"):
    """Worker → dispatcher: the case is done; the worker is ready for the next one."""

    run_id: str
    """The case's run id."""
    answer: str | None = None
    """The final answer (as `EVALBUS_RESULT`'s); None with `error`."""
    error: str | None = None
    """Set when the agent failed on this case (an exception, say): the case fails
    (`harness_error`), the worker goes on."""


WorkerOutput = Ready | EventMessage | LogMessage | CdpMessage | DisplayMessage | ResultMessage
"""Any line a worker writes on stdout."""
