"""Trace sources, one module per platform: each turns a `TraceRef` into trace events."""
