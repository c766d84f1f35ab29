"""Root conftest: loads the evalbus test rig for every test folder."""

pytest_plugins = ["evalbus.testing.rig"]
