"""Root conftest: loads the evalbus test rig (NATS, PostgreSQL, trace platforms) for every folder."""

pytest_plugins = ["evalbus.testing.rig", "evalbus.testing.platforms", "evalbus.testing.stack"]
