"""The evalbus gateway: public HTTP API (batches, runs, SSE, OpenAPI), the recorder of the CASES
stream into the PostgreSQL event store, and batch finalisation.

- `service.build_gateway` / `settings.GatewaySettings`: wiring on the chassis (`python -m evalbus_gateway`).
- `client.GatewayClient`: a Python client of the API (aiohttp client only).
- `store`: the event store; `recorder_stage` and `finalize`: its consumer and finalisation.

Nothing is imported here, so `evalbus_gateway.client` stays light.
"""
