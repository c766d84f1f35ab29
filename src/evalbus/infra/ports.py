"""Free loopback ports."""

from __future__ import annotations

import socket
import threading
from collections import deque

_HANDED_OUT: deque[int] = deque(maxlen=4096)
_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and not handed out by this process
    recently: the kernel may offer the same port to two `bind(0)` calls in a row, and a port is
    only taken once its server binds it, so two stacks started together (the crash tests start
    four) could otherwise both be given it."""
    with _LOCK:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
        raise RuntimeError("no free loopback port that was not handed out already")


def wait_port(port: int, timeout_s: float = 20.0, host: str = "127.0.0.1") -> None:
    """Block until something accepts TCP connections on `host:port` (or raise TimeoutError)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s}s") from None
            time.sleep(0.05)


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether `host:port` can be bound right now (used to keep a remembered port across restarts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Servers set SO_REUSEADDR, so a port whose old connections linger in TIME_WAIT is free to them.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
