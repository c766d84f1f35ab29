"""The test rig's service stack picks free ports and starts services on them; tests run in
parallel, so another process may bind a port between the pick and the service's bind. A first start
that dies of that is started again on other ports; a restart keeps its ports."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from evalbus.infra.ports import free_port
from evalbus.testing import stack as stack_module
from evalbus.testing.stack import ServiceStack

pytestmark = pytest.mark.integration


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port some other process holds (listening)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_service_whose_free_port_was_taken_starts_on_another(
    service_stack: ServiceStack, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed = iter([taken_port])  # the first pick loses the race; then real free ports
    monkeypatch.setattr(stack_module, "free_port", lambda: next(handed, None) or free_port())
    started = service_stack.start("exporter")
    assert started.port != taken_port
    assert started.process.poll() is None
    assert stack_module.ADDRESS_IN_USE in (service_stack.workdir / "exporter-1.log").read_text()

    port = started.port
    service_stack.kill("exporter")
    assert service_stack.start("exporter").port == port  # a restart keeps its port


def test_a_restart_whose_port_was_taken_fails_rather_than_move(
    service_stack: ServiceStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients know a restarted service's port: it must not move silently."""
    first = service_stack.start("exporter")
    service_stack.kill("exporter")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the old one's TIME_WAIT
        squatter.bind(("127.0.0.1", first.port))
        squatter.listen()
        with pytest.raises(RuntimeError, match=stack_module.ADDRESS_IN_USE):
            service_stack.start("exporter")
