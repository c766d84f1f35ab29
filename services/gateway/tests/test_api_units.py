"""The API's pure parts: field paths of validation errors, the batch spec's rules, cursors, the
tokens file, and the OpenAPI generator."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from evalbus_api.validation import batch_spec_problems
from evalbus_contracts import (
    BatchPolicy,
    BatchSpec,
    CaseSpec,
    CommandGrader,
    ExactJudge,
    RegexJudge,
    StepsGrader,
    TextMetricGrader,
    decode,
)
from evalbus_gateway.api.auth import Principal, TokenTable, load_tokens_file
from evalbus_gateway.api.errors import ApiError, field_of
from evalbus_gateway.api.openapi import build_openapi
from evalbus_gateway.api.routes import ROUTES
from evalbus_gateway.api.validation import decode_cursor, encode_cursor
from evalbus_gateway.errors import TokensFileError
from evalbus_gateway.testing import batch_spec

pytestmark = pytest.mark.unit


def validation_error(body: bytes) -> msgspec.ValidationError:
    with pytest.raises(msgspec.ValidationError) as info:
        decode(body, BatchSpec)
    return info.value


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b"[]", "$"),
        (b"{}", "$.suite"),
        (b'{"suite": {"id": "s", "cases": [{"input": "x"}]}, "harness": {}}', "$.suite.cases[0].id"),
        (b'{"suite": {"id": 1, "cases": []}}', "$.suite.id"),
        (b'{"suite": {"id": "s", "cases": []}, "harness": {"id": "h", "command": "ls"}}', "$.harness.command"),
    ],
)
def test_field_of_names_the_offending_field(body: bytes, field: str) -> None:
    assert field_of(validation_error(body))[0] == field


def test_field_of_names_unknown_fields() -> None:
    class Strict(msgspec.Struct, forbid_unknown_fields=True):
        a: int = 0

    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(b'{"a": 1, "b-c": 2}', type=Strict)
    assert field_of(info.value)[0] == '$["b-c"]'


def test_a_valid_spec_has_no_problems() -> None:
    assert batch_spec_problems(batch_spec()) == []


def test_every_broken_rule_is_reported_at_its_path() -> None:
    cases = (
        CaseSpec(
            id="a",
            input="x",
            graders=(
                CommandGrader(id="g", command="true", pass_pattern="("),
                StepsGrader(id="g"),
                TextMetricGrader(id="t", pattern="[0-9]+"),
            ),
        ),
        CaseSpec(id="a", input="y", timeout_s=0),
    )
    spec = BatchSpec(
        suite=msgspec.structs.replace(batch_spec().suite, cases=cases),
        harness=batch_spec().harness,
        judges=(ExactJudge(id="a:b"), RegexJudge(id="r", pattern="[")),
        policy=BatchPolicy(trials=0, retries=11, concurrency=-2),
        supersede_key="",
    )
    fields = [p.field for p in batch_spec_problems(spec)]
    assert fields == [
        "$.suite.cases[0].graders[0].pass_pattern",
        "$.suite.cases[0].graders[1].id",
        "$.suite.cases[0].graders[2].pattern",
        "$.suite.cases[1].id",
        "$.suite.cases[1].timeout_s",
        "$.judges[0].id",
        "$.judges[1].pattern",
        "$.policy.trials",
        "$.policy.retries",
        "$.policy.concurrency",
        "$.supersede_key",
    ]


def test_cursors_round_trip_and_stay_in_their_list() -> None:
    cursor = encode_cursor("cases", "b1/*", ("evb-b1-c9",))
    assert decode_cursor(cursor, "cases", "b1/*", size=1) == ("evb-b1-c9",)
    for value, kind, scope in ((cursor, "cases", "b2/*"), (cursor, "batches", "b1/*"), ("@@", "cases", "b1/*")):
        with pytest.raises(ApiError) as info:
            decode_cursor(value, kind, scope, size=1)
        assert (info.value.status, info.value.field) == (400, "cursor")


def test_tokens_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text('{"t-alice": {"principal": "alice"}, "t-root": {"principal": "ops", "role": "admin"}}')
    table = TokenTable.from_settings("t-admin", str(path))
    assert table.lookup("t-alice") == Principal("alice", "member")
    assert table.lookup("t-root") == Principal("ops", "admin")
    assert table.lookup("t-admin") == Principal("admin", "admin")
    assert table.lookup("t-nobody") is None
    assert load_tokens_file(path)["t-alice"].may_access("alice")
    assert not load_tokens_file(path)["t-alice"].may_access("bob")

    secret = "super-secret-token-value"
    for text in (f'{{"{secret}": {{"principal": "x", "role": "root"}}}}', f'{{"{secret}": {{"principal": ""}}}}', "{"):
        path.write_text(text)
        with pytest.raises(TokensFileError) as info:
            load_tokens_file(path)
        assert secret not in str(info.value)


def test_a_dashboard_session_is_signed_expires_and_never_holds_the_token() -> None:
    alice, bob = "t-alice-long-secret", "t-bob-long-secret"
    table = TokenTable({alice: Principal("alice", "member"), bob: Principal("bob", "member")})
    now = 1_000_000.0
    session = table.session_for(alice, now, 3600)
    assert session is not None
    assert alice not in session
    assert table.session_principal(session, now + 3599) == Principal("alice", "member")
    assert table.session_principal(session, now + 3600) is None  # expired, whatever the browser keeps
    assert table.session_for("t-nobody", now, 3600) is None
    version, token_id, expiry, mac = session.split(".")
    forged = [
        f"{version}.{token_id}.{int(expiry) + 86400}.{mac}",  # a longer life
        f"{version}.{token_id}.{expiry}.{mac[:-1]}0",  # another mac
        ".".join([version, *session.split(".")[1:3], table.session_for(bob, now, 3600).split(".")[3]]),  # type: ignore[union-attr]
        alice,  # the raw token, as the cookie used to hold it
        "v0." + session[3:],
        "",
        "v1...",
        f"{version}.{token_id}.\u00b2.{mac}",  # a digit to str.isdigit, not to int
        f"{version}.{token_id}.{'9' * 5000}.{mac}",  # past int()'s digit limit
    ]
    for cookie in forged:
        assert table.session_principal(cookie, now) is None, cookie
    # Dropping the token from the tokens file ends its sessions.
    assert TokenTable({bob: Principal("bob", "member")}).session_principal(session, now) is None


def test_openapi_covers_every_route_of_the_table() -> None:
    doc = build_openapi(ROUTES)
    for route in ROUTES:
        for method in route.methods:
            operation = doc["paths"][route.openapi_path][method.lower()]
            assert operation["summary"] == route.summary
            if route.access != "public":
                assert "401" in operation["responses"]
            if any(p.location == "path" for p in route.params):
                assert "404" in operation["responses"]
    operation_ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(operation_ids) == len(set(operation_ids))


def test_openapi_links_lead_to_real_operations_and_parameters() -> None:
    """Every link names an operation of the document, and each parameter it fills is one of that
    operation's; the batch, run, online-suite and dataset links are there."""
    doc = build_openapi(ROUTES)
    operations = {op["operationId"]: op for item in doc["paths"].values() for op in item.values()}
    links = {
        (source["operationId"], status, name): link
        for source in operations.values()
        for status, response in source["responses"].items()
        for name, link in response.get("links", {}).items()
    }
    for (source, status, name), link in links.items():
        target = operations[link["operationId"]]
        known = {p["name"] for p in target.get("parameters", [])}
        assert set(link.get("parameters", {})) <= known, (source, status, name)
        assert all(str(v).startswith("$") for v in link.get("parameters", {}).values()), link
    want = {
        ("submitBatch", "202", "getBatch"),
        ("submitBatch", "202", "listBatchCases"),
        ("submitBatch", "202", "cancelBatch"),
        ("listBatchCases", "200", "getRun"),
        ("listBatchCases", "200", "nextPage"),
        ("uploadDataset", "201", "submitBatch"),
        ("applyOnlineSuite", "201", "getOnlineSuite"),
        ("applyOnlineSuite", "201", "deleteOnlineSuite"),
    }
    assert want <= set(links), want - set(links)
    assert links[("uploadDataset", "201", "submitBatch")]["requestBody"] == {
        "suite": {"dataset_ref": "$response.body#/dataset_ref"}
    }
