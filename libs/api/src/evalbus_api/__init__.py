"""The gateway's HTTP contract, shared by the gateway (which serves it) and the `evalbus` CLI and
SDK (which call it), so the CLI imports no service.

- `views`, `models`, `live`, `online`, `compare`, `actions`: every request body and response of the
  API, as frozen msgspec Structs.
- `validation`: the batch spec's own rules as data (`batch_spec_problems`), checked by the CLI
  before it sends a suite and by the gateway, which answers them as a 400.
- `client`: `GatewayClient`, the async Python client (aiohttp's client only), `ApiRequestError`
  and the server-sent event parser.

Nothing is imported here: the Structs come without aiohttp, the client only when it is asked for.
This library imports `evalbus_contracts`, `evalbus_grading` and third-party packages, never a service.
"""
