"""evalbus package."""
