"""The gateway's HTTP API: routes, bearer-token auth, validation, JSON errors, OpenAPI and SSE.

Deliberately empty of imports: `api.models` (the wire types) is shared with the client, which
must not pull in the aiohttp server. `api.routes.install_api` wires everything onto an app.
"""
