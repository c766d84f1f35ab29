"""Lane users of the local secure stack (`evalbus up --secure`): `evalbus lane credential LANE`
gives the dispatchers of one lane — a GPU box, a laptop — a NATS user of their own whose
permissions are that lane's (`nats_accounts.lane_publish_grants`), without restarting anything.

The lane's password is made once and kept with the other users' in `DIR/nats/users.json` (mode
0600); the stack's `accounts.conf` is rendered again with every lane user (their passwords written
in it, so the file is 0600 too: nats-server reads a new variable only when it starts, but a new
file on every reload) and nats-server reloads it (SIGHUP).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from evalbus.infra import nats_accounts
from evalbus.infra.endpoints import load_endpoints, url_as
from evalbus.infra.processes import ProcessId, is_alive
from evalbus_contracts import lane_problem


class LaneCredentialError(RuntimeError):
    """The lane has no credential to give (not a lane name, no secure stack running)."""


@dataclass(frozen=True)
class LaneCredential:
    """What a dispatcher serving one lane runs with."""

    lane: str
    user: str
    nats_url: str
    """The NATS URL with the lane user's password."""

    def environment(self) -> dict[str, str]:
        """The dispatcher's environment: its lane, its user, its own reply inboxes, streams taken
        as the stack created them (its user may not change them), cancellations read per batch
        (its user may create no consumer but its lane's)."""
        return {
            "NATS_URL": self.nats_url,
            "DISPATCHER_LANES": self.lane,
            "DISPATCHER_INBOX_PREFIX": nats_accounts.lane_inbox(self.lane),
            "DISPATCHER_CREATE_TOPOLOGY": "false",
            "DISPATCHER_CANCELLATIONS": "lookup",
        }


def lane_passwords(passwords: Mapping[str, str]) -> dict[str, str | None]:
    """lane -> password of every lane user in a users file's passwords."""
    prefix = nats_accounts.LANE_USER_PREFIX
    return {user.removeprefix(prefix): password for user, password in passwords.items() if user.startswith(prefix)}


def write_private(path: Path, data: bytes) -> None:
    """Write `path` readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def render_accounts(path: Path, passwords: Mapping[str, str]) -> None:
    """The stack's `accounts.conf`: the deployments' users and every lane user of `passwords`."""
    write_private(path, nats_accounts.render(lane_passwords(passwords)).encode("utf-8"))


def lane_credential(state_dir: Path, lane: str, new_password: str, *, reload_timeout_s: float = 10.0) -> LaneCredential:
    """The lane's credential on the secure stack of `state_dir`, its user added (and nats-server
    reloaded) when the lane has none yet."""
    problem = lane_problem(lane)
    if problem is not None:
        raise LaneCredentialError(f"{lane!r} is not a lane name: {problem}")
    endpoints = load_endpoints(state_dir)
    if endpoints is None or endpoints.nats is None or endpoints.nats_users is None:
        raise LaneCredentialError(
            f"no secure stack in {state_dir}: run `evalbus up --secure` (lane users are least-privilege NATS users)"
        )
    process = endpoints.nats_process
    if process is None or not is_alive(process):
        raise LaneCredentialError(f"nats-server of {state_dir} is not running: run `evalbus up --secure`")
    users_file = Path(endpoints.nats_users)
    passwords = msgspec.json.decode(users_file.read_bytes(), type=dict[str, str])
    user = nats_accounts.lane_user(lane)
    if user not in passwords:
        passwords[user] = new_password
        write_private(users_file, msgspec.json.encode(passwords))
        render_accounts(users_file.with_name("accounts.conf"), passwords)
        reload_nats(process, Path(endpoints.nats_log) if endpoints.nats_log else None, reload_timeout_s)
    return LaneCredential(lane=lane, user=user, nats_url=url_as(endpoints.nats, user, passwords[user]))


def reload_nats(process: ProcessId, log: Path | None, timeout_s: float) -> None:
    """SIGHUP nats-server and wait until its log says it reloaded (or the timeout)."""
    before = log.stat().st_size if log is not None and log.exists() else 0
    os.kill(process.pid, signal.SIGHUP)
    if log is None:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with log.open("rb") as f:
            f.seek(before)
            text = f.read().decode("utf-8", "replace")
        if "Reloaded server configuration" in text:
            return
        if "Failed to reload" in text or "config reload failed" in text.lower():
            raise LaneCredentialError(f"nats-server did not reload its configuration (see {log})")
        time.sleep(0.05)
    raise LaneCredentialError(f"nats-server did not say it reloaded its configuration within {timeout_s:g}s ({log})")
