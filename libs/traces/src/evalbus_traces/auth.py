"""Platform auth conventions: a secret *name* resolved at use into the header its platform wants.

| scheme | platform | header |
|---|---|---|
| `authorization` | otel, mlflow | `Authorization: <secret value verbatim>` (the pull-ingest convention) |
| `bearer` | phoenix | `Authorization: Bearer <value>` (kept as is when the value already says `Bearer `) |
| `basic-pair` | langfuse | `Authorization: Basic base64(<public key>:<secret key>)`; the secret holds `pk:sk` |
| `x-api-key` | langsmith | `x-api-key: <value>` |

No name, no header. A name the store lacks raises `MissingSecretError` — never an anonymous request.
"""

from __future__ import annotations

import base64
from typing import Literal

from evalbus_runtime.secrets import SecretStore
from evalbus_traces.errors import TraceConfigError

AuthScheme = Literal["authorization", "bearer", "basic-pair", "x-api-key"]


def auth_headers(scheme: AuthScheme, secrets: SecretStore, name: str | None) -> dict[str, str]:
    """Headers carrying secret `name` under `scheme` (`{}` when no secret is named)."""
    if not name:
        return {}
    value = secrets.require(name).reveal()
    if scheme == "authorization":
        return {"Authorization": value}
    if scheme == "bearer":
        return {"Authorization": value if value.lower().startswith("bearer ") else f"Bearer {value}"}
    if scheme == "basic-pair":
        if ":" not in value:
            raise TraceConfigError(f"secret {name!r} must hold '<public key>:<secret key>' for basic auth")
        return {"Authorization": "Basic " + base64.b64encode(value.encode()).decode()}
    return {"x-api-key": value}
