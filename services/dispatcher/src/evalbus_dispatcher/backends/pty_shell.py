"""A persistent interactive shell on a real pseudo-terminal (Python's `pty`), for the live terminal of
a local sandbox: its own session and process group with the terminal as its controlling tty, so
job control, line editing and resizes (`TIOCSWINSZ`, which sends the shell SIGWINCH) work as in any
terminal; output read without blocking the event loop, secrets masked as they stream out.

The shell's process group is one of the sandbox's, so releasing the sandbox kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import signal
import struct
import termios
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

log = logging.getLogger(__name__)

READ_BYTES = 64 * 1024
"""Most bytes read from the terminal at once."""
HOLD_S = 0.1
"""Longest time output that could be the start of a secret is held back before it is sent as is."""

OnBytes = Callable[[bytes], Awaitable[None]]


def default_shell() -> str:
    """bash when the machine has it, else /bin/sh."""
    return shutil.which("bash") or "/bin/sh"


class StreamRedactor:
    """Masks secret values in a byte stream cut into arbitrary chunks: a chunk's end that could be
    the beginning of a secret is held back until the next chunk shows whether it is (or `HOLD_S`
    passes: then it goes out as is — a prefix is never the secret)."""

    def __init__(self, secrets: Iterable[str], mask: bytes = b"[redacted]") -> None:
        self._secrets = sorted({s.encode("utf-8") for s in secrets if s}, key=len, reverse=True)
        self._mask = mask
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        """What can be sent of `data` now (masked); the rest is held."""
        text = self._held + data
        for secret in self._secrets:
            text = text.replace(secret, self._mask)
        keep = 0
        for secret in self._secrets:
            for n in range(min(len(secret) - 1, len(text)), 0, -1):
                if text.endswith(secret[:n]):
                    keep = max(keep, n)
                    break
        self._held = text[len(text) - keep :] if keep else b""
        return text[: len(text) - keep] if keep else text

    @property
    def holding(self) -> bool:
        """Whether some output is held back."""
        return bool(self._held)

    def flush(self) -> bytes:
        """Whatever is held, as is."""
        held, self._held = self._held, b""
        return held


def set_size(fd: int, cols: int, rows: int) -> None:
    """Set the terminal's size (the kernel tells its foreground process group with SIGWINCH)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", max(1, rows), max(1, cols), 0, 0))


class _Exits(asyncio.SubprocessProtocol):
    """Tells when the shell process exits (it has no pipes: the terminal is its stdio)."""

    def __init__(self) -> None:
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        self.exited.set()


class PtyShell:
    """One shell process on a pseudo-terminal."""

    def __init__(
        self,
        *,
        cwd: Path,
        env: Mapping[str, str],
        secrets: Iterable[str],
        on_output: OnBytes,
        shell: str | None = None,
        cols: int = 80,
        rows: int = 24,
    ) -> None:
        self.shell = shell or default_shell()
        self._cwd = cwd
        self._env = {**env, "TERM": env.get("TERM", "xterm-256color")}
        self._on_output = on_output
        self._redactor = StreamRedactor(secrets)
        self._size = (cols, rows)
        self._master: int | None = None
        self._transport: asyncio.SubprocessTransport | None = None
        self._exits: _Exits | None = None
        self._reader_done = asyncio.Event()
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None
        self._pending_write = b""
        self.pid: int | None = None
        """The shell's pid (its process group and session id too)."""

    async def start(self) -> int:
        """Spawn the shell; its pid. Raises OSError when it cannot start."""
        loop = asyncio.get_running_loop()
        master, slave = os.openpty()
        try:
            set_size(slave, *self._size)
            transport, exits = await loop.subprocess_exec(
                _Exits,
                self.shell,
                "-i",
                cwd=self._cwd,
                env=self._env,
                stdin=slave,
                stdout=slave,
                stderr=slave,
                # A new session whose controlling terminal is the slave (job control, ^C, resizes).
                preexec_fn=_controlling_tty,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        self._master, self._transport, self._exits = master, transport, exits
        self.pid = transport.get_pid()
        loop.add_reader(master, self._readable)
        self._pump = asyncio.create_task(self._send_loop())
        return self.pid

    def _readable(self) -> None:
        assert self._master is not None
        try:
            data = os.read(self._master, READ_BYTES)
        except BlockingIOError:
            return
        except OSError as e:  # EIO: every process holding the terminal is gone
            if e.errno not in (errno.EIO, errno.EBADF):
                log.warning("terminal read failed: %s", e)
            data = b""
        if data:
            self._out.put_nowait(data)
            return
        self._stop_reading()

    def _stop_reading(self) -> None:
        if self._master is not None and not self._reader_done.is_set():
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._master)
            self._reader_done.set()
            self._out.put_nowait(None)

    async def _send_loop(self) -> None:
        while True:
            try:
                item = (
                    await asyncio.wait_for(self._out.get(), HOLD_S) if self._redactor.holding else await self._out.get()
                )
            except TimeoutError:
                await self._emit(self._redactor.flush())
                continue
            if item is None:
                await self._emit(self._redactor.flush())
                return
            await self._emit(self._redactor.feed(item))

    async def _emit(self, data: bytes) -> None:
        if data:
            try:
                await self._on_output(data)
            except Exception:
                log.warning("terminal output could not be forwarded", exc_info=True)

    def write(self, data: bytes) -> None:
        """Type `data` into the terminal (what the kernel cannot take now is written when it can)."""
        if self._master is None or self._reader_done.is_set():
            return
        self._pending_write += data
        self._write_some()

    def _write_some(self) -> None:
        assert self._master is not None
        loop = asyncio.get_running_loop()
        try:
            while self._pending_write:
                n = os.write(self._master, self._pending_write)
                self._pending_write = self._pending_write[n:]
        except BlockingIOError:
            loop.add_writer(self._master, self._writable)
            return
        except OSError:
            self._pending_write = b""
        with contextlib.suppress(Exception):
            loop.remove_writer(self._master)

    def _writable(self) -> None:
        self._write_some()

    def resize(self, cols: int, rows: int) -> None:
        """Change the terminal's size."""
        self._size = (cols, rows)
        if self._master is not None:
            with contextlib.suppress(OSError):
                set_size(self._master, cols, rows)

    def kill(self) -> None:
        """End the shell and everything started from it (its process group)."""
        if self.pid is not None:
            for sig in (signal.SIGHUP, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pid, sig)

    async def wait(self) -> int | None:
        """Wait until the shell exited and its output was forwarded; its exit code."""
        assert self._exits is not None
        assert self._transport is not None
        await self._exits.exited.wait()
        code = self._transport.get_returncode()
        self._transport.close()
        # The terminal reads EOF once no process holds it; a leftover background job may keep it
        # open, so its end is awaited only briefly before the terminal is closed anyway.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reader_done.wait(), 1.0)
        self._stop_reading()
        if self._pump is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._pump, 2.0)
        self.close()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    def close(self) -> None:
        """Release the terminal (idempotent)."""
        if self._master is not None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(Exception):
                loop.remove_reader(self._master)
            with contextlib.suppress(Exception):
                loop.remove_writer(self._master)
            with contextlib.suppress(OSError):
                os.close(self._master)
            self._master = None
        if self._pump is not None and not self._pump.done():
            self._pump.cancel()


def _controlling_tty() -> None:
    """In the child, before exec: a new session, the terminal (its stdin) as controlling tty."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
