-- Online evaluation (issue 8): what became of every production observation, per online suite.
-- A read model like `runs`: folded from `online.fate` events and from the `case.judged` events of
-- online pseudo-batches (`online-<suite>`), keyed by (suite, observation, fate) — the events' own
-- dedup key — so a redelivery or a rebuild inserts nothing twice. suite_id is '' for an
-- observation no suite was defined for.
CREATE TABLE online_fates (
    suite_id       text        NOT NULL,
    observation_id text        NOT NULL,
    fate           text        NOT NULL
                   CHECK (fate IN ('sampled', 'skipped', 'dropped', 'late', 'dead_lettered', 'judged')),
    reason         text        NOT NULL,
    detail         text,
    trace_id       text,
    target         text,
    ts             timestamptz NOT NULL,
    PRIMARY KEY (suite_id, observation_id, fate)
);
CREATE INDEX online_fates_trace ON online_fates (trace_id) WHERE trace_id IS NOT NULL;
CREATE INDEX online_fates_observation ON online_fates (observation_id);
CREATE INDEX online_fates_suite_ts ON online_fates (suite_id, ts);
