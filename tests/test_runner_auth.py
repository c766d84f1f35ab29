"""Per-run NATS credentials for the in-job runners, against a real nats-server running the
deployment's own accounts (deploy/nats/accounts.conf: the `AUTH` account and its auth callout):
a run token minted by a dispatcher becomes a user that may publish its own run's live log and
trace and nothing else, until its expiry; anything else is refused; the static users keep their
passwords without the callout; nobody in the evalbus account hears the requests.

The nkey and JWT encodings (`evalbus_runtime.nkeys`) are checked here by the server itself: a
response it could not verify would refuse every runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from tests.test_deploy_nats_live import SecureNats, connect_as, start_secure_nats

from evalbus.cli import main as cli_main
from evalbus.infra import nats_accounts
from evalbus.testing.pipeline import eventually
from evalbus_contracts import LiveLog, LiveTrace, Message, encode
from evalbus_contracts.subjects import live_subject
from evalbus_dispatcher.runner_auth import AUTH_SUBJECT, RunnerAuth, RunTokenError, RunTokens, runner_permissions
from evalbus_runtime import ensure_topology
from evalbus_runtime.nkeys import AccountKey, decode_jwt, encode_jwt, public_key

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureNats]:
    with start_secure_nats(tmp_path_factory.mktemp("runner-auth")) as server:
        yield server


@contextlib.asynccontextmanager
async def answering(server: SecureNats, issuer: AccountKey | None = None) -> AsyncIterator[RunnerAuth]:
    """A dispatcher's responder on the `runner-auth` user, signing with `issuer` (the server's own
    by default)."""
    nc = await nats.connect(server.url(nats_accounts.RUNNER_AUTH_USER), allow_reconnect=False, connect_timeout=5)
    auth = RunnerAuth(nc, issuer or server.issuer)
    await auth.start()
    await nc.flush()
    try:
        yield auth
    finally:
        await auth.close()


class Runner:
    """A connection as a runner would make it, with what the server told it."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.closed = asyncio.Event()
        self.nc = NatsClient()

    async def error(self, e: Exception) -> None:
        text = str(e).lower()
        if "permissions violation" in text:
            self.violations.append(text)

    async def on_closed(self) -> None:
        self.closed.set()

    async def connect(self, server: SecureNats, token: str) -> None:
        await self.nc.connect(
            server.anonymous_url(), token=token, allow_reconnect=False, connect_timeout=5,
            error_cb=self.error, closed_cb=self.on_closed,
        )  # fmt: skip

    async def refused(self, server: SecureNats, token: str) -> bool:
        """Whether the server refuses a connection with `token` (the client hears `Authorization Violation`)."""
        try:
            await self.connect(server, token)
        except (nats.errors.Error, OSError) as e:
            return "authorization" in str(e).lower() or isinstance(e, nats.errors.NoServersError)
        else:
            return not self.nc.is_connected
        finally:
            await self.nc.close()

    async def must_be_refused(self, subject: str, *, subscribe: bool = False) -> None:
        if subscribe:
            await self.nc.subscribe(subject)
        else:
            await self.nc.publish(subject, b"{}")
        named = f'"{subject.lower()}"'
        await eventually(  # the violation comes back asynchronously, on the connection
            lambda: any(named in v for v in self.violations),
            timeout_s=30,
            what=f"the server to refuse {subject}",
            diagnostics=lambda: f"violations reported: {self.violations}",
        )


async def last_on(server: SecureNats, subject: str) -> bytes | None:
    async with connect_as(server, "admin") as (nc, _):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            return (await nc.jetstream().get_last_msg("LIVE", subject)).data
    return None


# ---------------------------------------------------------------- live


async def test_a_run_token_publishes_its_own_runs_live_view_and_nothing_else(secure: SecureNats) -> None:
    async with connect_as(secure, "admin") as (admin, _):
        await ensure_topology(admin.jetstream())
    run, other = f"evb-tok-{uuid.uuid4().hex[:8]}", f"evb-other-{uuid.uuid4().hex[:8]}"
    async with answering(secure) as auth:
        runner = Runner()
        await runner.connect(secure, auth.tokens.mint(run, 60))
        assert auth.granted == 1
        chunk = LiveLog(run_id=run, case_id="c1", seq=1, stream="stdout", text="hi\n")
        trace = LiveTrace(run_id=run, case_id="c1", seq=1, events=(Message(role="assistant", text="t"),))
        await runner.nc.publish(chunk.subject(), encode(chunk))
        await runner.nc.publish(trace.subject(), encode(trace))
        await runner.nc.flush()
        assert await last_on(secure, chunk.subject()) == encode(chunk)
        assert await last_on(secure, trace.subject()) == encode(trace)
        assert runner.violations == []

        for subject in (
            f"run.{other}.live.log",  # another run's live view
            f"run.{other}.live.trace",
            f"run.{run}.live.infra",  # its own run's other live subjects stay the dispatcher's
            f"case.executed.b1.{run}",
            "obs.received.x",
            "$JS.API.STREAM.INFO.LIVE",
        ):
            await runner.must_be_refused(subject)
        await runner.must_be_refused(f"run.{run}.live.>", subscribe=True)
        await runner.must_be_refused(">", subscribe=True)
        assert await last_on(secure, f"run.{other}.live.log") is None
        await runner.nc.close()


async def test_tokens_that_are_forged_expired_or_from_another_key_are_refused(secure: SecureNats) -> None:
    run = f"evb-bad-{uuid.uuid4().hex[:8]}"
    async with answering(secure) as auth:
        good = auth.tokens.mint(run, 60)
        head, _, mac = good.rpartition(".")
        forged_run = good.replace(good.split(".")[1], RunTokens(b"x").mint("evb-victim", 60).split(".")[1])
        bad = {
            "wrong": "not-a-token",
            "tampered mac": f"{head}.{'A' * len(mac)}",
            "another run's id under this mac": forged_run,
            "expired": auth.tokens.mint(run, 1, now=time.time() - 120),
            "another key": RunTokens(AccountKey.generate().token_key()).mint(run, 60),
        }
        for why, token in bad.items():
            assert await Runner().refused(secure, token), why
        assert auth.refused == len(bad)
        assert auth.granted == 0
        assert not await Runner().refused(secure, good)
        assert auth.granted == 1


async def test_answers_signed_by_another_issuer_are_refused_by_the_server(secure: SecureNats) -> None:
    async with answering(secure, issuer=AccountKey.generate()) as auth:
        assert await Runner().refused(secure, auth.tokens.mint("evb-x", 60))
        assert auth.granted == 1  # it said yes; the server did not believe it


async def test_no_responder_means_no_runner_connects(secure: SecureNats) -> None:
    token = RunTokens(secure.issuer.token_key()).mint("evb-nobody", 60)
    assert await Runner().refused(secure, token)


async def test_the_connection_ends_at_the_tokens_expiry(secure: SecureNats) -> None:
    async with answering(secure) as auth:
        runner = Runner()
        await runner.connect(secure, auth.tokens.mint("evb-short", 1))
        assert runner.nc.is_connected
        await asyncio.wait_for(runner.closed.wait(), 10)  # the server's expiry timer, not a sleep
        assert "expired" in str(runner.nc.last_error).lower()


async def test_static_users_keep_their_passwords_and_never_reach_the_callout(secure: SecureNats) -> None:
    async with answering(secure) as auth:
        for user in ("gateway", "dispatcher", "judge", "ingest", "admin", "sys"):
            async with connect_as(secure, user) as (nc, _):
                assert nc.is_connected
        assert auth.granted == auth.refused == 0
        wrong = secure.url("gateway").replace(secure.passwords["gateway"], "wrong-password")
        refused = NatsClient()
        with pytest.raises(nats.errors.Error):
            await refused.connect(wrong, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0)
        await refused.close()
        assert auth.refused == 1  # a wrong password is asked about, and refused
        assert auth.granted == 0


async def test_no_evalbus_user_hears_the_authorization_requests(secure: SecureNats) -> None:
    heard: list[str] = []

    async def on_msg(msg: Msg) -> None:
        heard.append(msg.subject)

    async with answering(secure) as auth, connect_as(secure, "admin") as (admin, _):
        await admin.subscribe(">", cb=on_msg)
        await admin.subscribe(AUTH_SUBJECT, cb=on_msg)
        await admin.flush()
        runner = Runner()
        await runner.connect(secure, auth.tokens.mint("evb-quiet", 60))
        await runner.nc.publish("run.evb-quiet.live.log", b"{}")
        await runner.nc.flush()
        await runner.nc.close()
        await admin.flush()
        # flush only says the message reached the admin's connection; its callback runs after
        await eventually(lambda: "run.evb-quiet.live.log" in heard, timeout_s=10, what="the admin hears the publish")
        assert auth.granted == 1
    assert heard == ["run.evb-quiet.live.log"]  # its publish, never a request or an answer


# ---------------------------------------------------------------- pure


def test_an_account_key_round_trips_through_its_seed() -> None:
    key = AccountKey.generate()
    assert key.public.startswith("A")
    assert key.seed.startswith("SA")
    again = AccountKey.from_seed(key.seed)
    assert again.public == key.public
    assert again.token_key() == key.token_key()
    public_key(key.public, "A")
    with pytest.raises(ValueError, match="kind"):
        public_key(key.public, "U")
    with pytest.raises(ValueError, match="checksum"):
        AccountKey.from_seed(key.seed[:-2] + ("AA" if key.seed[-2:] != "AA" else "BB"))
    with pytest.raises(ValueError, match="account seed"):
        AccountKey.from_seed(key.public)


def test_a_jwt_verifies_against_its_issuer_and_a_changed_one_does_not() -> None:
    key = AccountKey.generate()
    token = encode_jwt(key, {"sub": "x", "aud": "EVALBUS"}, {"type": "user"})
    claims = decode_jwt(token, "A")
    assert claims["iss"] == key.public
    assert claims["nats"] == {"type": "user", "version": 2}
    header, _payload, signature = token.split(".")
    other = encode_jwt(key, {"sub": "y", "aud": "EVALBUS"}, {"type": "user"}).split(".")[1]
    with pytest.raises(ValueError, match="signature"):
        decode_jwt(f"{header}.{other}.{signature}", "A")
    with pytest.raises(ValueError, match="kind N"):
        decode_jwt(token, "N")  # an account signed it, not a server


def test_a_run_token_names_one_run_and_checks_its_expiry() -> None:
    tokens = RunTokens(AccountKey.generate().token_key())
    token = tokens.mint("evb-r1", 30, now=1000.0)
    assert tokens.check(token, now=1010.0) == ("evb-r1", 1031)
    with pytest.raises(RunTokenError, match="expired"):
        tokens.check(token, now=1031.0)
    prefix, run, exp, mac = token.split(".")
    with pytest.raises(RunTokenError, match="wrong signature"):  # a longer life under the same mac
        tokens.check(f"{prefix}.{run}.{int(exp) + 3600}.{mac}", now=1010.0)
    assert runner_permissions("evb-r1") == {
        "pub": {"allow": ["run.evb-r1.live.log", "run.evb-r1.live.trace"]},
        "sub": {"deny": [">"]},
    }
    # an id that is no subject token is encoded as every live subject encodes it: never a wildcard
    odd = "evb-b1-case.with dots*>"
    assert tokens.check(tokens.mint(odd, 30, now=1000.0), now=1010.0)[0] == odd
    (log_subject, trace_subject) = runner_permissions(odd)["pub"]["allow"]
    assert log_subject == live_subject(odd, "log")
    assert trace_subject == live_subject(odd, "trace")
    assert not any(c in log_subject.split(".")[1] for c in ".*> ")


def test_the_accounts_name_the_responder_and_the_issuer_variable() -> None:
    text = nats_accounts.render()
    assert f"{{user: {nats_accounts.RUNNER_AUTH_USER}, password: $NATS_PASSWORD_RUNNER_AUTH" in text
    assert f"issuer: ${nats_accounts.ISSUER_VARIABLE}" in text
    assert "allowed_accounts: [AUTH]" in text
    assert "user: runner," not in text  # no shared runner password any more
    assert Path(nats_accounts.__file__).parents[3].joinpath("deploy/nats/accounts.conf").read_text() == text


def test_evalbus_runner_key_prints_a_pair_whose_seed_gives_its_public_key(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cli_main(["runner-key"]) == 0
    pairs = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines() if not line.startswith("#"))
    assert set(pairs) == {nats_accounts.ISSUER_VARIABLE, "DISPATCHER_RUNNER_AUTH_SEED"}
    seed = pairs["DISPATCHER_RUNNER_AUTH_SEED"]
    assert AccountKey.from_seed(seed).public == pairs[nats_accounts.ISSUER_VARIABLE]
    monkeypatch.setattr("sys.stdin", io.StringIO(seed + "\n"))
    assert cli_main(["runner-key", "--public"]) == 0
    assert capsys.readouterr().out == f"{nats_accounts.ISSUER_VARIABLE}={pairs[nats_accounts.ISSUER_VARIABLE]}\n"
    broken = seed[:-3] + ("AAA" if not seed.endswith("AAA") else "BBB")
    monkeypatch.setattr("sys.stdin", io.StringIO(broken))
    assert cli_main(["runner-key", "--public"]) == 2
    err = capsys.readouterr().err
    assert "not an nkey" in err
    assert seed[2:10] not in err  # no piece of the seed in the message
