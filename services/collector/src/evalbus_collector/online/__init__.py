"""Online evaluation in the collector: OTLP/HTTP ingest, trace assembly, the suite registry and the
sampling decision that turns production observations into `case.observed` with every fate counted."""
