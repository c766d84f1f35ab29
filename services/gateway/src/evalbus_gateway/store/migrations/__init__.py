"""Versioned SQL migrations of the event store, applied in file-name order by `store.migrate`."""
