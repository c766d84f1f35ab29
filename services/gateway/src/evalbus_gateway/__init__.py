"""The evalbus gateway: public HTTP API (batches, runs, SSE, OpenAPI), the recorder of the CASES
stream into the PostgreSQL event store, and batch finalisation.

- `service.build_gateway` / `settings.GatewaySettings`: wiring on the chassis (`python -m evalbus_gateway`).
- `store`: the event store; `recorder_stage` and `finalize`: its consumer and finalisation.

The API's wire types and its Python client are the `evalbus_api` library's (`libs/api`).
"""
