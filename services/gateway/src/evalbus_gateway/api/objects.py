"""Reads of what a run keeps in the `artifacts` bucket: the trajectory with its offloaded parts read
back, and `GET /v1/runs/{run_id}/artifacts/{name}`.

An event's result that was too large for the bus names a payload object (`result.payload`); the
trajectory read fills the offloaded fields back into that event's `body` from the object, after
checking it against the reference, and lists them in the event's `loaded` (the seal's chain
covers the stored body, where the reference — and so the digest — stands in for them). An object
that does not match its reference is answered `409 tampered`, never served as if it were the run's.
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from aiohttp import web

from evalbus_api.views import Trajectory, TrajectoryEvent
from evalbus_contracts import ObjectRef
from evalbus_gateway.api.access import visible_run
from evalbus_gateway.api.errors import ApiError, not_found
from evalbus_gateway.api.table import Body, Call, Param, Route
from evalbus_gateway.api.validation import path_id
from evalbus_gateway.store import get_trajectory
from evalbus_runtime.objects import ObjectDigestError, ObjectStoreError, get_object, iter_object, object_info
from evalbus_runtime.payloads import COLLECTED_FILE, MAX_PAYLOAD_READ, PAYLOAD_FILE, object_refs, run_prefix, unreadable

_RESULT_EVENTS = frozenset({"case.executed", "case.collected", "case.judged", "case.observed"})
_MAX_ARTIFACT_NAME = 256
PAYLOAD_FILES = ("/" + PAYLOAD_FILE, "/" + COLLECTED_FILE)


def tampered(run_id: str, e: ObjectStoreError) -> ApiError:
    """The answer to a read whose object is not the one the run's events pin."""
    return ApiError(409, "tampered", f"run {run_id}: {unreadable(e)}", "run_id")


async def load_payloads(call: Call, trajectory: Trajectory) -> Trajectory:
    """The trajectory with every offloaded result part read back (verified) into its event's body."""
    events: list[TrajectoryEvent] = []
    read: dict[tuple[str, str, str], Any] = {}
    changed = False
    for event in trajectory.events:
        if event.type not in _RESULT_EVENTS:
            events.append(event)
            continue
        body = msgspec.json.decode(event.body)
        result = body.get("result") if isinstance(body, dict) else None
        ref = result.get("payload") if isinstance(result, dict) else None
        if not isinstance(ref, dict) or not isinstance(result, dict):
            events.append(event)
            continue
        key = (str(ref.get("bucket")), str(ref.get("name")), str(ref.get("sha256")))
        payload = read.get(key)
        if payload is None:  # the judged event names the executed one's object: read it once
            try:
                data = await get_object(call.state.js, msgspec.convert(ref, ObjectRef), limit=MAX_PAYLOAD_READ)
            except ObjectStoreError as e:
                raise tampered(trajectory.run_id, e) from e
            except msgspec.ValidationError as e:
                raise tampered(trajectory.run_id, ObjectStoreError(f"unreadable payload reference: {e}")) from e
            payload = read[key] = msgspec.json.decode(data)
        fields = tuple(str(f) for f in result.get("offloaded", ()))
        for name in fields:
            if isinstance(payload, dict) and name in payload:
                result[name] = payload[name]
        events.append(msgspec.structs.replace(event, body=msgspec.Raw(msgspec.json.encode(body)), loaded=fields))
        changed = True
    return msgspec.structs.replace(trajectory, events=tuple(events)) if changed else trajectory


async def run_trajectory(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/trajectory."""
    run_id = path_id(call.request, "run_id")
    await visible_run(call, run_id)
    trajectory = await get_trajectory(call.state.pool, run_id)
    if trajectory is None:
        raise not_found("trajectory of run", "run_id", run_id)
    loaded = await load_payloads(call, trajectory)
    return web.Response(body=msgspec.json.encode(loaded), content_type="application/json")


async def _named_objects(call: Call, trajectory: Trajectory) -> list[ObjectRef]:
    """Every object the trajectory names, those named inside payload objects included."""
    refs: list[ObjectRef] = []
    for event in trajectory.events:
        refs.extend(object_refs(msgspec.json.decode(event.body)))
    refs = list(dict.fromkeys(refs))  # the judged event names the executed one's objects again
    found = list(refs)
    for ref in refs:
        if ref.name.endswith(PAYLOAD_FILES):
            try:
                data = await get_object(call.state.js, ref, limit=MAX_PAYLOAD_READ)
            except ObjectStoreError as e:
                raise tampered(trajectory.run_id, e) from e
            found.extend(object_refs(msgspec.json.decode(data)))
    return found


def _pick(run_id: str, refs: list[ObjectRef], name: str) -> ObjectRef | None:
    """The latest attempt's object `runs/<run token>/a<attempt>/<name>` among `refs` (pure)."""
    base = run_prefix(run_id, 1).removesuffix("1")  # runs/<token>/a
    best: tuple[int, ObjectRef] | None = None
    for ref in refs:
        if not ref.name.startswith(base):
            continue
        attempt, _, rest = ref.name[len(base) :].partition("/")
        if attempt.isdigit() and rest == name and (best is None or int(attempt) > best[0]):
            best = (int(attempt), ref)
    return None if best is None else best[1]


async def run_artifact(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/artifacts/{name}: the bytes of an object the run's events name."""
    run_id = path_id(call.request, "run_id")
    name = call.request.match_info.get("name", "")
    bad = any(ord(c) < 0x20 or ord(c) == 0x7F for c in name)
    if bad or not name or len(name) > _MAX_ARTIFACT_NAME or ".." in name.split("/"):
        raise ApiError(400, "invalid", "name must be an artifact name of the run (e.g. files/out.bin)", "name")
    await visible_run(call, run_id)
    trajectory = await get_trajectory(call.state.pool, run_id)
    if trajectory is None:
        raise not_found("trajectory of run", "run_id", run_id)
    ref = _pick(run_id, await _named_objects(call, trajectory), name)
    if ref is None:
        raise ApiError(404, "not_found", f"run {run_id!r} has no artifact {name!r}", "name")
    js = call.state.js
    try:
        info = await object_info(js, ref)
    except ObjectStoreError as e:
        raise tampered(run_id, e) from e
    if info.size != ref.size:
        raise tampered(run_id, ObjectDigestError(f"object {ref.name!r} is {info.size} bytes; the run pins {ref.size}"))
    response = web.StreamResponse(
        headers={
            "Content-Type": str((info.headers or {}).get("Content-Type", "application/octet-stream")),
            "Content-Length": str(ref.size),
            "Digest": "sha-256=" + base64.b64encode(bytes.fromhex(ref.sha256)).decode(),
            "X-Evalbus-Sha256": ref.sha256,
        }
    )
    await response.prepare(call.request)
    try:
        async for chunk in iter_object(js, ref):
            await response.write(chunk)
    except ObjectStoreError:
        # The last chunk is withheld when the digest does not match: cut the connection so the
        # client never holds a complete body of other bytes.
        if call.request.transport is not None:
            call.request.transport.close()
        return response
    await response.write_eof()
    return response


_RUN_ID = Param("run_id", "path", "Run id (`evb-<batch>-<case>[-t<trial>]`)", {"type": "string"}, required=True)

ROUTES: tuple[Route, ...] = (
    Route(
        ("GET",),
        "/v1/runs/{run_id}/artifacts/{name:[\\s\\S]+}",
        "getRunArtifact",
        "Download an object a run's events name (a declared artifact file, a large log)",
        "member",
        run_artifact,
        tag="runs",
        description="`name` is the object's name under the run attempt (`files/<path>` for a file the harness "
        "declared, `stdout.log` / `stderr.log` for a log over the inline threshold); the latest attempt's is "
        "served. The bytes are checked against the digest the sealed events pin (`Digest` and "
        "`X-Evalbus-Sha256` headers): a size mismatch is `409 tampered`, a digest mismatch cuts the "
        "connection before the last chunk.",
        params=(
            _RUN_ID,
            Param("name", "path", "Artifact name (`files/out.bin`, `stdout.log`)", {"type": "string"}, required=True),
        ),
        responses={
            200: Body("The artifact's bytes", None, "application/octet-stream", {"type": "string", "format": "binary"})
        },
    ),
)
