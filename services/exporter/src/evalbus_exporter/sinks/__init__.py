"""Export sinks: where judged cases go (a JSON-lines file; trace platforms through evalbus_traces)."""
