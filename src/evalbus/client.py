"""`evalbus.Client`: evalbus from a script or a notebook.

    from evalbus import Client

    with Client() as eb:                       # the local stack `evalbus up` started (or gateway=, token=)
        batch = eb.run("examples/suite.yaml")  # submit, wait for the end, the batch with its summary
        for run in eb.results(batch.batch_id):
            print(run.case_id, run.verdict, [s.metric for s in run.scores])

Every method is synchronous and safe to call from a Jupyter cell: the client runs its own event
loop on a thread of its own, so it works whether or not the caller's thread has a loop running.
It finds the gateway as the CLI does (`gateway`/`token` arguments, then `EVALBUS_GATEWAY_URL` and
`EVALBUS_TOKEN`, then what `evalbus up` recorded in `dir`: default `$EVALBUS_DIR`, else the nearest
`.evalbus` of the working directory or a folder above it).
A suite is a suite file's path (YAML or JSON, dataset files and all, checked as `evalbus run`
checks it), a mapping with the same content, or a `BatchSpec`; cases too large to ride in the batch
are uploaded as a dataset first, as the CLI does. API errors raise `ApiRequestError` (status, code,
message and the offending field); a suite with problems raises `SpecFileError` listing each one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from evalbus.cli.connection import gateway_target
from evalbus.cli.options import default_state_dir
from evalbus.cli.suite_file import (
    SpecFileError,
    SuiteFile,
    _inputs_as_text,
    convert_as,
    expand,
    load_suite,
    resolve_command,
    with_dataset_problems,
)
from evalbus.cli.upload import UploadProgress, inline_limit, needs_upload, offload_cases
from evalbus_api.client import ApiRequestError, GatewayClient, SseEvent
from evalbus_api.validation import batch_spec_problems
from evalbus_api.views import BatchView, RunView
from evalbus_contracts import BatchSpec, JudgeSpec

__all__ = ["ApiRequestError", "Client", "SpecFileError"]

T = TypeVar("T")

FINAL = frozenset({"succeeded", "failed", "cancelled", "superseded"})
"""Batch statuses after which nothing changes."""


class Client:
    """A gateway's API for scripts and notebooks: submit, wait, follow, results, cancel, rejudge."""

    def __init__(
        self,
        gateway: str | None = None,
        token: str | None = None,
        *,
        dir: str | Path | None = None,  # noqa: A002 - the CLI's --dir
        timeout_s: float = 30.0,
    ) -> None:
        state_dir = Path(dir) if dir is not None else default_state_dir()
        target = gateway_target(state_dir, gateway, token)
        self.url = target.url
        """The gateway's base URL."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="evalbus-client", daemon=True)
        self._thread.start()
        self._api = self._call(_open(target.url, target.token, timeout_s))

    # ------------------------------------------------------------ plumbing

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the HTTP session and stop the client's loop. Idempotent."""
        if self._loop.is_closed():
            return
        self._call(self._api.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------ batches

    def submit(self, suite: str | Path | Mapping[str, Any] | BatchSpec, *, idempotency_key: str | None = None) -> str:
        """Submit a suite (a file's path, its content as a mapping, or a `BatchSpec`); the batch id."""
        spec = load(suite)

        async def go() -> str:
            submitted = spec
            if needs_upload(spec, inline_limit()):
                submitted = await offload_cases(self._api, spec, UploadProgress(len(spec.suite.cases), quiet=True))
            return (await self._api.submit(submitted, idempotency_key=idempotency_key)).batch_id

        return self._call(go())

    def batch(self, batch_id: str) -> BatchView:
        """The batch now: status, counts and (once final) its summary."""
        return self._call(self._api.get(batch_id))

    def wait(self, batch_id: str, *, timeout_s: float | None = None) -> BatchView:
        """Block until the batch is final (succeeded, failed, cancelled or superseded); the batch.
        Follows its event stream (resumed on a dropped connection); `TimeoutError` after `timeout_s`."""

        async def go() -> BatchView:
            view = await self._api.get(batch_id)
            if view.status not in FINAL:
                async for event in self._api.events(batch_id):
                    if event.event == "end":
                        break
                view = await self._api.get(batch_id)
            return view

        async def bounded() -> BatchView:
            try:
                return await asyncio.wait_for(go(), timeout_s)
            except TimeoutError:
                raise TimeoutError(f"batch {batch_id} was not final after {timeout_s:g} s") from None

        return self._call(bounded() if timeout_s is not None else go())

    def run(self, suite: str | Path | Mapping[str, Any] | BatchSpec, *, timeout_s: float | None = None) -> BatchView:
        """Submit a suite and wait for its end; the final batch with its summary."""
        return self.wait(self.submit(suite), timeout_s=timeout_s)

    def follow(self, batch_id: str) -> Iterator[SseEvent]:
        """The batch's events as they happen (`(id, event, data)`; `.decoded()` gives the event),
        from its first, ending after the stream's `end` event."""
        queue: asyncio.Queue[SseEvent | BaseException | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for event in self._api.events(batch_id):
                    await queue.put(event)
            except BaseException as e:  # handed to the reader, raised there
                await queue.put(e)
            finally:
                await queue.put(None)

        task = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = self._call(queue.get())
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    def results(self, batch_id: str) -> list[RunView]:
        """Every run of the batch (verdict, scores, stage times, failure), in case order."""
        return self._call(self._api.all_cases(batch_id))

    def cancel(self, batch_id: str) -> None:
        """Stop the batch starting cases; those in flight settle."""
        self._call(self._api.cancel(batch_id))

    def rejudge(self, batch_id: str, judges: tuple[JudgeSpec, ...] | None = None) -> str:
        """Judge the batch's recorded runs again (with other judges, or its own); the new batch's id."""
        return self._call(self._api.rejudge(batch_id, judges)).batch_id


async def _open(url: str, token: str | None, timeout_s: float) -> GatewayClient:
    return GatewayClient(url, token, timeout_s=timeout_s)


def load(suite: str | Path | Mapping[str, Any] | BatchSpec) -> BatchSpec:
    """A checked `BatchSpec` from a suite file's path, its content, or a spec; `SpecFileError`."""
    if isinstance(suite, BatchSpec):
        problems = [(p.field, p.message) for p in batch_spec_problems(suite)]
        if problems:
            raise SpecFileError("<BatchSpec>", problems)
        return suite
    if isinstance(suite, str | Path):
        return load_suite(Path(suite))
    source, folder = "<mapping>", Path.cwd()
    data = dict(suite)
    _inputs_as_text(data)
    file = convert_as(data, SuiteFile, source)
    spec, _, unread = expand(file, folder, source)
    problems = with_dataset_problems(unread, [(p.field, p.message) for p in batch_spec_problems(spec)])
    if problems:
        raise SpecFileError(source, problems)
    return resolve_command(spec, folder)
