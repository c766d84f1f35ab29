"""The test rig: pytest fixtures that start real servers (loaded by the root conftest)."""
