"""The gateway's HTTP API: routes, bearer-token auth, validation, JSON errors, OpenAPI and SSE.

The wire types (request bodies and views) and the client are the `evalbus_api` library's, shared
with the CLI, which imports no service. `api.routes.install_api` wires everything onto an app.
"""
